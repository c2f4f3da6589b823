"""The documentation site builds strictly (a broken link or reference fails), and its API
reference documents every public name."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PUBLIC = (
    "aoffload",
    "aoffload.deepspeed",
    "aoffload.lightning",
    "aoffload.testing",
    "aoffload.dcp",
)


def _inventory(site: Path) -> set[str]:
    """The names in the site's ``objects.inv`` (Sphinx's inventory format, version 2)."""
    data = (site / "objects.inv").read_bytes()
    start = 0
    for _ in range(4):  # four header lines, then the zlib-compressed body
        start = data.index(b"\n", start) + 1
    lines = zlib.decompress(data[start:]).decode().splitlines()
    return {line.split(" ", 1)[0] for line in lines if line.strip()}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        pytest.fail("mkdocs is not installed: `pip install -e .[docs]` (make setup does it)")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONWARNINGS": "ignore"}
    build = subprocess.run(
        [mkdocs, "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    return out


def test_the_site_builds_strictly(site: Path) -> None:
    assert (site / "index.html").is_file()
    assert (site / "reference" / "aoffload" / "index.html").is_file()


@pytest.mark.parametrize("module", PUBLIC)
def test_the_reference_documents_every_public_name(site: Path, module: str) -> None:
    exported = importlib.import_module(module).__all__
    documented = _inventory(site)
    missing = sorted(name for name in exported if f"{module}.{name}" not in documented)
    assert not missing, f"{module}: not in the API reference: {missing}"
