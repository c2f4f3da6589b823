"""DeepSpeed's CPU Adam op for the optimizer's worker: from its build when that is provably the
op DeepSpeed would load, else through DeepSpeed, which builds it if it must (worker side).

* **From its stamped build** (:mod:`._deepspeed_stamp`): the library is imported the way
  torch does, without DeepSpeed, in milliseconds.
* **Through DeepSpeed** (``backend="deepspeed"`` only): DeepSpeed's ``CPUAdamBuilder.load()``
  JIT-builds the op with torch's ``cpp_extension`` and ninja when its build is missing or
  out of date, which takes a minute or two. A first build is said at WARNING before it
  starts (why, where, how long), a rebuild as soon as it is seen, and the end at INFO. A
  build lock left by a dead build is removed first (:mod:`._build_lock`), and a live
  build's is waited for, saying so.
* ``backend="auto"`` never builds and never waits: without the proof it is the torch
  backend (:class:`OpUnavailable` says why, and the trainer says it once).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ._build_lock import clear_stale_lock
from ._deepspeed_stamp import NAME, STAMP, file_stat, stamp_mismatch, write_stamp

__all__ = ["BUILD_TIME", "OpLoad", "OpUnavailable", "build_directory", "load_cpu_adam"]

logger = logging.getLogger(__name__)

BUILD_TIME = "1-2 minutes (79 s measured on a 2-core host)"
"""How long a first build of the op takes, as the messages say it."""


class OpUnavailable(RuntimeError):
    """DeepSpeed's op cannot be loaded without a build (``backend="auto"`` then runs torch)."""


@dataclass(frozen=True, slots=True)
class OpLoad:
    """The loaded op (its Python module) and its library's path."""

    module: Any
    library: str


def load_cpu_adam(*, build: bool) -> OpLoad:
    """DeepSpeed's CPU Adam op: from its stamped build if that provably is the op DeepSpeed
    would load; else, with ``build``, through DeepSpeed (built if it must be, then stamped),
    and without, :class:`OpUnavailable`."""
    directory = build_directory()
    clear_stale_lock(directory, wait=build)
    reason = stamp_mismatch(directory)
    if reason is None:
        library = os.path.join(directory, f"{NAME}.so")
        try:
            module = _import_library(library)
        except Exception as exc:  # noqa: BLE001 - DeepSpeed loads it instead, and says why
            reason = f"importing {library} failed ({type(exc).__name__}: {exc})"
        else:
            logger.debug("CPU Adam op loaded from %s, without DeepSpeed (%s holds)", library, STAMP)
            return OpLoad(module, library)
    if not build:
        if importlib.util.find_spec("deepspeed") is None:
            raise OpUnavailable("DeepSpeed is not installed")
        raise OpUnavailable(f"DeepSpeed's CPU Adam op is not known to be built: {reason}")
    logger.debug("loading the CPU Adam op through DeepSpeed: %s", reason)
    return _load_through_deepspeed(directory, reason)


def build_directory() -> str:
    """The directory torch's ``load()`` builds DeepSpeed's ``cpu_adam`` in (as torch names it)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        import torch._appdirs

        cache = torch._appdirs.user_cache_dir(appname="torch_extensions")  # type: ignore[no-untyped-call]
        root = os.path.realpath(cache)
        if torch.version.hip is not None:
            accelerator = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accelerator = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{sys.abiflags}"
        root = os.path.join(root, f"{python}_{accelerator}")
    return os.path.join(root, NAME)


def _where(directory: str) -> str:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return (
        f"{directory} (TORCH_EXTENSIONS_DIR={root})" if root else f"{directory} (torch's default)"
    )


def _import_library(library: str) -> ModuleType:
    # As torch.utils.cpp_extension._import_module_from_library: a module named for its
    # PyInit function, not registered in sys.modules.
    spec = importlib.util.spec_from_file_location(NAME, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"no extension loader for {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_through_deepspeed(directory: str, reason: str) -> OpLoad:
    from ._deepspeed_start import prepare_deepspeed

    library = os.path.join(directory, f"{NAME}.so")
    before = file_stat(library)
    if before is not None:
        logger.info(
            "loading DeepSpeed's CPU Adam op from %s through DeepSpeed (%s); DeepSpeed "
            "rebuilds it first if its sources or flags changed (%s)",
            _where(directory),
            reason,
            BUILD_TIME,
        )
    else:
        logger.warning(
            "building DeepSpeed's CPU Adam op in %s: backend='deepspeed' asked for it and it "
            "is not built there yet. A first build takes %s, once; the optimizer starts "
            "when it ends",
            _where(directory),
            BUILD_TIME,
        )
    started = time.monotonic()
    prepare_deepspeed()
    from deepspeed.ops.op_builder import CPUAdamBuilder

    builder = CPUAdamBuilder()
    module = builder.load()
    library = str(getattr(module, "__file__", library))
    seconds = time.monotonic() - started
    if before is None:
        logger.info("DeepSpeed's CPU Adam op built in %s in %.0f s", directory, seconds)
    elif file_stat(library) != before:
        logger.warning(
            "DeepSpeed rebuilt its CPU Adam op in %s in %.0f s (%s)",
            _where(directory),
            seconds,
            reason,
        )
    try:
        write_stamp(directory, builder, library)
    except Exception as exc:  # the op is loaded; only the next start is slower
        logger.debug("no %s written in %s: %s", STAMP, directory, exc, exc_info=True)
    return OpLoad(module, library)
