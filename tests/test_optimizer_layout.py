"""The optimizer wing keeps its shape: its worker (``optimizer/worker/``) imports nothing of the
trainer's side, and a worker process loads its service without the trainer's modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import aoffload.optimizer

OPTIMIZER = Path(aoffload.optimizer.__file__).parent
WORKER = OPTIMIZER / "worker"
ALLOWED = ("aoffload._runtime", "aoffload._errors", "aoffload.optimizer.worker")


def _imports(path: Path) -> set[str]:
    """The aoffload modules ``path`` imports (relative imports resolved)."""
    package = ".".join(("aoffload", *path.relative_to(OPTIMIZER.parent).parent.parts))
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.add(".".join([*base, node.module] if node.module else base))
            elif node.module and node.module.startswith("aoffload"):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("aoffload")}
    return found


def test_the_worker_imports_nothing_of_the_trainer_side() -> None:
    modules = sorted(WORKER.glob("*.py"))
    assert len(modules) > 5
    wrong = {
        f"{path.name}: {module}"
        for path in modules
        for module in _imports(path)
        if not module.startswith(ALLOWED)
    }
    assert not wrong, wrong


def test_a_worker_process_loads_its_service_without_the_trainer_side() -> None:
    script = (
        "import sys, aoffload.optimizer.worker\n"
        "print(sorted(m for m in sys.modules if m.startswith('aoffload.optimizer.')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert "aoffload.optimizer.worker._service" in loaded
    for trainer in ("_core", "_cpu_adam", "_results", "_state", "offload"):
        assert f"'aoffload.optimizer.{trainer}" not in loaded, loaded
