"""The checkpoint wing keeps the shape it was drawn in (as trio's ``test_exports.py`` keeps
its exports): read from the source with ``ast``, and from a fresh interpreter's modules.

Import direction: ``format`` <- ``core`` <- roles (``ranks``, ``remote``, ``preemption``) <-
``_assemble`` <- the faces. The graph counts every ``import`` a module makes (at its top,
inside a function, under ``TYPE_CHECKING``) for cycles and for the rules below; its levels
count what a module imports when it runs (``TYPE_CHECKING`` blocks only name types), a
module being one level above everything it imports.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "aoffload.checkpoint"
WING = ROOT / "aoffload" / "checkpoint"
ROLES = ("ranks", "remote", "preemption")
MAX_LEVELS = 6


@dataclass
class Module:
    name: str
    path: Path
    imports: set[str] = field(default_factory=set)
    """Every module of the package it imports, anywhere."""
    runtime: set[str] = field(default_factory=set)
    """Those it imports when it runs (not under ``TYPE_CHECKING``)."""
    external: set[str] = field(default_factory=set)
    """The top-level names of what it imports from outside the package (``torch``...)."""


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _walk(node: ast.AST, guarded: bool = False) -> list[tuple[ast.AST, bool]]:
    """Every node under ``node``, with whether it sits under ``if TYPE_CHECKING:``."""
    found = [(node, guarded)]
    for child in ast.iter_child_nodes(node):
        found += _walk(child, guarded or _type_checking(node))
    return found


@cache
def graph() -> dict[str, Module]:
    modules = {_name(path): Module(_name(path), path) for path in WING.rglob("*.py")}
    for module in modules.values():
        tree = ast.parse(module.path.read_text(encoding="utf-8"))
        base = module.name.split(".")
        if module.path.name != "__init__.py":
            base.pop()
        for node, guarded in _walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                origin = node.module or ""
                if node.level:
                    up = base[: len(base) - (node.level - 1)]
                    origin = ".".join([*up, *([node.module] if node.module else [])])
                # `from .x import a` imports module x; `from . import x`, module x itself
                names = [f"{origin}.{alias.name}" for alias in node.names]
                targets = [name if name in modules else origin for name in names]
            for target in targets:
                if target in modules:
                    if target != module.name:
                        module.imports.add(target)
                        if not guarded:
                            module.runtime.add(target)
                elif target and not target.startswith("aoffload"):
                    module.external.add(target.split(".")[0])
    return modules


def room(name: str) -> str:
    """The folder of the wing a module lives in (``core``, ``format``...), or ``""`` for
    the modules at the top of the wing (the faces, the options, the assembler)."""
    rest = name.removeprefix(PACKAGE).lstrip(".")
    folder = rest.split(".")[0]
    return folder if (WING / folder).is_dir() else ""


def levels() -> dict[str, int]:
    found: dict[str, int] = {}

    def level(name: str, path: tuple[str, ...] = ()) -> int:
        if name in path:
            raise AssertionError(f"an import cycle: {' -> '.join((*path, name))}")
        if name not in found:
            below = [level(m, (*path, name)) for m in graph()[name].runtime]
            found[name] = 1 + max(below, default=0)
        return found[name]

    for name in graph():
        level(name)
    return found


def test_the_import_graph_has_no_cycle() -> None:
    modules = graph()
    state: dict[str, int] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = (*path[path.index(name) :], name)
            raise AssertionError(f"an import cycle (type imports count): {' -> '.join(cycle)}")
        state[name] = 1
        for imported in sorted(modules[name].imports):
            visit(imported, (*path, name))
        state[name] = 2

    for name in sorted(modules):
        visit(name, ())


def test_the_import_graph_is_at_most_six_levels_deep() -> None:
    found = levels()
    top = max(found.values())
    chain = sorted(found, key=found.__getitem__, reverse=True)[:3]
    assert top <= MAX_LEVELS, f"{top} levels; the highest modules: {chain}"


def test_the_rooms_of_the_wing_stand_at_most_six_floors() -> None:
    """The same measure for rooms (each folder of the wing one room, each module at its top
    one room), counting every import, type imports too: the house as a reader draws it."""
    rooms: dict[str, set[str]] = {}
    for module in graph().values():
        here = room(module.name) or module.name
        rooms.setdefault(here, set()).update(
            there for m in module.imports if (there := room(m) or m) != here
        )
    floors: dict[str, int] = {}

    def floor(name: str, path: tuple[str, ...] = ()) -> int:
        if name in path:
            raise AssertionError(f"rooms import each other: {' -> '.join((*path, name))}")
        if name not in floors:
            floors[name] = 1 + max((floor(r, (*path, name)) for r in rooms[name]), default=0)
        return floors[name]

    top = max(floor(name) for name in rooms)
    chain = sorted(floors, key=floors.__getitem__, reverse=True)[:3]
    assert top <= MAX_LEVELS, f"{top} floors; the highest rooms: {chain}"


def test_where_the_ranks_meet_stands_below_every_role() -> None:
    for module in graph().values():
        if room(module.name) == "meet":
            rooms = {room(m) or m for m in module.imports}
            assert rooms <= {"meet", "format"}, f"{module.name} imports {sorted(rooms)}"


def test_the_core_imports_no_role_nor_the_assembler() -> None:
    for module in graph().values():
        if room(module.name) == "core":
            rooms = {room(m) or m for m in module.imports}
            allowed = {"core", "format", "writer"}
            assert rooms <= allowed, f"{module.name} imports {sorted(rooms - allowed)}"


def test_the_format_imports_nothing_above_it_and_no_torch() -> None:
    for module in graph().values():
        if room(module.name) == "format":
            rooms = {room(m) or m for m in module.imports}
            assert rooms <= {"format"}, f"{module.name} imports {sorted(rooms)}"
            assert "torch" not in module.external or module.name.endswith(".inspect"), (
                f"{module.name} imports torch"
            )
    code = (
        "import sys\n"
        "import aoffload.checkpoint.format.layout, aoffload.checkpoint.format.read\n"
        "import aoffload.checkpoint.format.write, aoffload.checkpoint.format.inspect\n"
        "import aoffload.checkpoint.format.lock, aoffload.checkpoint.format.shm\n"
        "import aoffload.checkpoint.remote.inspect, aoffload._cli\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", "the format (and the command line) imported torch"


def test_the_writer_imports_nothing_of_the_trainer_side() -> None:
    for module in graph().values():
        if room(module.name) == "writer":
            rooms = {room(m) or m for m in module.imports}
            assert rooms <= {"writer"}, f"{module.name} imports {sorted(rooms)}"


def test_only_the_assembler_imports_the_roles() -> None:
    for module in graph().values():
        if room(module.name) in ROLES:
            continue
        roles = {
            m
            for m in module.imports
            if room(m) in ROLES and not m.startswith(f"{PACKAGE}.remote.worker")
        }
        if module.name != f"{PACKAGE}._assemble":
            assert not roles, f"{module.name} imports the roles {sorted(roles)}"


CHECKPOINT_ADAPTERS = [
    "deepspeed/_checkpoint.py",
    "deepspeed/_inflight.py",
    "deepspeed/_load.py",
    "lightning/_checkpoint_io.py",
]


@pytest.mark.parametrize("adapter", CHECKPOINT_ADAPTERS)
def test_the_checkpoint_adapters_use_public_names_only(adapter: str) -> None:
    path = ROOT / "aoffload" / adapter
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            assert node.level == 1 or node.module is None, f"{adapter} imports ..{node.module}"
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            assert not (node.module or "").startswith("aoffload"), f"{adapter}: {node.module}"
        if isinstance(node, ast.Attribute):
            inner = node.value
            reached = node.attr in ("_core", "catalog", "writer") or (
                isinstance(inner, ast.Attribute) and inner.attr == "tags"
            )
            assert not (reached and "engine" in ast.unparse(node)), (
                f"{adapter} reaches into {ast.unparse(node)}"
            )


def test_the_workers_are_named_by_their_calls_not_by_importing_them() -> None:
    from aoffload._runtime.serve import target
    from aoffload.checkpoint.remote.worker import calls as uploader_calls
    from aoffload.checkpoint.remote.worker.service import UploaderService
    from aoffload.checkpoint.writer import calls as writer_calls
    from aoffload.checkpoint.writer.service import WriterService

    assert target(WriterService) == writer_calls.TARGET
    assert target(UploaderService) == uploader_calls.TARGET
