"""The public surface: every exported name is documented, and nothing public is left out."""

from __future__ import annotations

import inspect
import subprocess
import sys
import types

import aoffload


def test_all_names_exist_and_are_documented() -> None:
    for name in aoffload.__all__:
        obj = getattr(aoffload, name)
        assert inspect.getdoc(obj), f"aoffload.{name} has no docstring"
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for attr, member in vars(obj).items():
                if attr.startswith("_") and attr not in ("__aiter__", "__anext__"):
                    continue
                if callable(member) or isinstance(member, property):
                    assert inspect.getdoc(member), f"aoffload.{name}.{attr} has no docstring"


def test_every_public_name_is_in_all() -> None:
    public = {
        name
        for name in dir(aoffload)  # the names imported on first use too
        if not name.startswith("_")
        and not isinstance(getattr(aoffload, name), types.ModuleType)
        and name not in ("annotations",)
    }
    assert public == set(aoffload.__all__)
    assert isinstance(aoffload.__all__, tuple)


def test_importing_aoffload_imports_torch_only_for_the_names_that_need_it() -> None:
    code = (
        "import sys, aoffload, aoffload.checkpoint; "
        "before = 'torch' in sys.modules; "
        "aoffload.AoffloadError, aoffload.run; "
        "errors = 'torch' in sys.modules; "
        "from aoffload import CheckpointEngine; "
        "print(before, errors, 'torch' in sys.modules, CheckpointEngine.__name__); "
        "aoffload.Missing"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split() == ["False", "False", "True", "CheckpointEngine"], out.stderr
    assert "module 'aoffload' has no attribute 'Missing'" in out.stderr


def test_error_tree_matches_the_contract() -> None:
    assert issubclass(aoffload.WorkerDiedError, aoffload.WorkerError)
    assert issubclass(aoffload.RemoteError, aoffload.WorkerError)
    assert issubclass(aoffload.WorkerStartupError, aoffload.WorkerError)
    assert issubclass(aoffload.InvalidStateError, aoffload.CheckpointError)
    assert issubclass(aoffload.InvalidStateError, TypeError)
    assert issubclass(aoffload.InvalidStateError, ValueError)
    assert issubclass(aoffload.CorruptCheckpointError, aoffload.CheckpointError)
    assert issubclass(aoffload.OptimizerError, ValueError)
    for error in (
        aoffload.ClosedError,
        aoffload.WorkerError,
        aoffload.CheckpointError,
        aoffload.OptimizerError,
    ):
        assert issubclass(error, aoffload.AoffloadError)


def test_importing_aoffload_imports_neither_deepspeed_nor_uvloop_nor_lightning() -> None:
    code = (
        "import sys, aoffload; "
        "print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('deepspeed', 'uvloop', 'lightning')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_pytest_plugin_and_the_console_script_are_declared_and_importable() -> None:
    import importlib
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert project["project"]["requires-python"] == ">=3.11"
    plugin = project["project"]["entry-points"]["pytest11"]["aoffload"]
    module = importlib.import_module(plugin)
    for name in module.__all__:
        assert inspect.getdoc(getattr(module, name)), f"{plugin}.{name} has no docstring"
    for name in ("aoffload_engine", "aoffload_optimizer", "aoffload_kill"):
        assert name in module.__all__
    script = project["project"]["scripts"]["aoffload"]
    module_name, function = script.split(":")
    assert callable(getattr(importlib.import_module(module_name), function))


def test_run_without_uvloop_chains_no_import_error_to_the_users_exceptions() -> None:
    code = (
        "import sys; sys.modules['uvloop'] = None\n"  # as if uvloop were not installed
        "import asyncio, aoffload\n"
        "async def main():\n"
        "    assert type(asyncio.get_running_loop()).__module__.startswith('asyncio')\n"
        "    raise RuntimeError('the user error')\n"
        "try:\n"
        "    aoffload.run(main())\n"
        "except RuntimeError as exc:\n"
        "    print(repr(exc.__context__), repr(exc.__cause__))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None None"
