"""``import aoffload`` never imports DeepSpeed: ``aoffload.deepspeed`` is imported on demand."""

from __future__ import annotations

import subprocess
import sys


def test_import_aoffload_does_not_import_deepspeed() -> None:
    code = (
        "import sys, aoffload\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] == 'deepspeed']\n"
        "assert not loaded, loaded\n"
        "assert 'aoffload.deepspeed' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
