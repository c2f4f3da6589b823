"""The proof that a build of DeepSpeed's CPU Adam op is the op DeepSpeed would load (worker side).

Loading the op through DeepSpeed costs a worker about a second before its first step: the
import of DeepSpeed (with its accelerator detection), py-cpuinfo's fresh interpreter (asked
for the CPU's SIMD width), torch's ``cpp_extension`` (with setuptools) and a ninja run. For a
JIT build, all of that ends in torch importing ``<build directory>/cpu_adam.so``, the
directory being ``$TORCH_EXTENSIONS_DIR/cpu_adam`` (or torch's default root).

The proof. In a fresh process, DeepSpeed passes its arguments (sources, include paths, flags)
to torch's ``load()``, which writes them into ``build.ninja`` (unless it holds them already),
runs ninja and imports the library. After a worker has loaded the op that way, it writes a
*stamp* beside the build (:data:`STAMP`) recording everything those three steps depend on:

* the arguments: DeepSpeed's version (one reviewed here, :data:`REVIEWED`: its CPU and CUDA
  accelerators share one builder whose flags depend only on the CPU) and the size and mtime
  of its op-builder and accelerator code; which accelerator DeepSpeed chose; the variables it
  and torch read (:data:`ENVIRONMENT`); the CPU (``-march=native`` and the SIMD width);
* the ``build.ninja`` they give: torch, Python, and the file itself;
* ninja's decision: its binary, its logs, every file of its deps log (sources, headers,
  objects) and the library, all by size and mtime;
* that DeepSpeed took the JIT path at all (no prebuilt op) and that no other package has been
  installed beside it since (the mtime of its ``site-packages``), nor one of the packages
  that make DeepSpeed pick another accelerator (and with it another builder).

A later worker reads the stamp and, if every item still holds, imports the library the way
torch does, without DeepSpeed (:mod:`._deepspeed_op`). What stays unproven: a file changed
between ninja's run and the stamp, or between the check and the import (torch races the
same way).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["ENVIRONMENT", "NAME", "REVIEWED", "STAMP", "stamp_mismatch", "file_stat", "write_stamp"]

logger = logging.getLogger(__name__)

STAMP = "aoffload-stamp.json"
"""The stamp's name in the op's build directory."""

REVIEWED = ("0.19.8",)
"""DeepSpeed versions whose choice of build was read for this proof: the ``cpu`` and ``cuda``
accelerators both map ``CPUAdamBuilder`` to ``deepspeed.ops.op_builder.cpu``'s, whose flags
are a function of the CPU, and accelerator detection tries the packages in
:data:`_ACCELERATOR_PACKAGES`, XPU, MPS and then CUDA."""

ENVIRONMENT = ("DS_ACCELERATOR", "CXX")
"""Variables that change the op's build arguments or its ``build.ninja``."""

_FORMAT = 1
NAME = "cpu_adam"
"""The op's name, its build directory's and its library's."""
_BUILDER = "deepspeed.ops.op_builder.cpu.cpu_adam"
_ACCELERATORS = (None, "cpu", "cuda")  # DS_ACCELERATOR values that keep that builder
_ACCELERATOR_PACKAGES = (
    "torch_npu", "torch_sdaa", "habana_frameworks", "torch_mlu", "torch_supa", "torch_xmlir",
)  # fmt: skip
_DEEPSPEED_CODE = ("ops/op_builder", "accelerator")  # every .py below: the build's decisions
_DEEPSPEED_FILES = ("git_version_info.py", "git_version_info_installed.py", "ops/adam/cpu_adam.py")
_TORCH_FILES = ("version.py", "utils/cpp_extension.py")
_BUILD_FILES = ("build.ninja", ".ninja_log", ".ninja_deps", f"{NAME}.so")


def _facts(deepspeed_origin: str) -> dict[str, Any]:
    """What the stamp records besides its files, as of now."""
    return {
        "format": _FORMAT,
        "deepspeed_origin": deepspeed_origin,
        "torch": str(torch.__version__),
        "python": [sys.version, sys.executable],
        "environment": {name: os.environ.get(name) for name in ENVIRONMENT},
        "cpu": _cpu(),
        "ninja": shutil.which("ninja"),
    }


def stamp_mismatch(directory: str) -> str | None:
    """Why the stamp in ``directory`` does not prove its library is DeepSpeed's op; ``None``
    if it does."""
    try:
        stamp = json.loads(Path(directory, STAMP).read_text())
    except FileNotFoundError:
        return f"no {STAMP} in {directory} (DeepSpeed has not loaded this build in a worker)"
    except (OSError, ValueError) as exc:
        return f"{STAMP} in {directory} is unreadable ({exc})"
    if not isinstance(stamp, dict) or stamp.get("format") != _FORMAT:
        return f"{STAMP} in {directory} has another format"
    if stamp.get("deepspeed") not in REVIEWED:
        return f"DeepSpeed {stamp.get('deepspeed')} is not one reviewed for this ({REVIEWED})"
    if os.path.exists(os.path.join(directory, "lock")):
        return "torch's build lock is held: a build is under way"
    blocker = _other_accelerator()
    if blocker is not None:
        return blocker
    spec = importlib.util.find_spec("deepspeed")
    origin = spec.origin if spec is not None and spec.origin is not None else ""
    now = _facts(origin)
    if not now["cpu"]:
        return "the CPU is unknown (no /proc/cpuinfo)"
    for key, value in now.items():
        if stamp.get(key) != value:
            return f"{key} differs from the stamp's ({value!r}, stamped {stamp.get(key)!r})"
    if stamp.get("library") != os.path.join(directory, f"{NAME}.so"):
        return f"the stamp names another library ({stamp.get('library')!r})"
    files = stamp.get("files")
    if not isinstance(files, dict) or not files:
        return "the stamp lists no files"
    for path, recorded in files.items():
        if file_stat(path) != recorded:
            return f"{path} changed since the stamp"
    return None


def _other_accelerator() -> str | None:
    """Why DeepSpeed could pick an accelerator other than CPU or CUDA now, if it could."""
    chosen = os.environ.get("DS_ACCELERATOR")
    if chosen not in _ACCELERATORS:
        return f"DS_ACCELERATOR={chosen}"
    if chosen is not None:
        return None  # DeepSpeed takes it without detecting
    for package in _ACCELERATOR_PACKAGES:
        if importlib.util.find_spec(package) is not None:
            return f"{package} is installed (DeepSpeed would pick its accelerator)"
    if sys.platform == "darwin":
        return "macOS: DeepSpeed would try MPS"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "an XPU is available"
    return None


def write_stamp(directory: str, builder: Any, library: str) -> None:
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    expected = os.path.join(directory, f"{NAME}.so")
    accelerator = get_accelerator()._name
    if library != expected:
        raise ValueError(f"DeepSpeed loaded {library!r}, not a JIT build at {expected!r}")
    if installed_ops.get(NAME, False):
        raise ValueError("DeepSpeed has a prebuilt op")
    if type(builder).__module__ != _BUILDER or accelerator not in _ACCELERATORS:
        raise ValueError(f"accelerator {accelerator!r} built it with {type(builder)!r}")
    if deepspeed.__version__ not in REVIEWED:
        raise ValueError(f"DeepSpeed {deepspeed.__version__} is not one reviewed ({REVIEWED})")
    blocker = _other_accelerator()
    if blocker is not None:
        raise ValueError(blocker)
    origin = str(deepspeed.__file__)
    root = os.path.dirname(origin)
    paths = [os.path.join(directory, name) for name in _BUILD_FILES]
    paths += _ninja_deps_paths(directory)
    paths += [origin] + [os.path.join(root, name) for name in _DEEPSPEED_FILES]
    paths += _python_files([os.path.join(root, name) for name in _DEEPSPEED_CODE])
    paths.append(os.path.dirname(root))  # its site-packages: any install changes its mtime
    paths += [os.path.join(os.path.dirname(str(torch.__file__)), name) for name in _TORCH_FILES]
    ninja = shutil.which("ninja")
    if ninja is not None:
        paths.append(ninja)
    stamp = _facts(origin) | {
        "deepspeed": deepspeed.__version__,
        "accelerator": accelerator,
        "library": library,
        "files": {path: file_stat(path) for path in dict.fromkeys(paths)},
    }
    if not stamp["cpu"]:
        raise ValueError("the CPU is unknown (no /proc/cpuinfo)")
    fd, temporary = tempfile.mkstemp(prefix=f".{STAMP}.", dir=directory)
    try:
        with os.fdopen(fd, "w") as file:
            json.dump(stamp, file, indent=1, sort_keys=True)
        # Readable by whoever may read the build (mkstemp made it private).
        os.chmod(temporary, os.stat(os.path.join(directory, "build.ninja")).st_mode & 0o666)
        os.replace(temporary, os.path.join(directory, STAMP))
    except BaseException:
        os.unlink(temporary)
        raise
    logger.debug("%s written in %s", STAMP, directory)


def file_stat(path: str) -> list[int] | None:
    try:
        status = os.stat(path)
    except OSError:
        return None
    return [status.st_size, status.st_mtime_ns]


def _python_files(roots: list[str]) -> list[str]:
    found = []
    for root in roots:
        for folder, folders, names in os.walk(root):
            folders[:] = sorted(name for name in folders if name != "__pycache__")
            found.append(folder)  # its mtime: a file added or removed
            found += [os.path.join(folder, name) for name in sorted(names) if name.endswith(".py")]
    return found


def _ninja_deps_paths(directory: str) -> list[str]:
    """Every path in ninja's deps log (``.ninja_deps``): objects, sources and their headers."""
    data = Path(directory, ".ninja_deps").read_bytes()
    header = b"# ninjadeps\n"
    if not data.startswith(header):
        raise ValueError(".ninja_deps has no ninja deps header")
    (version,) = struct.unpack_from("<i", data, len(header))
    if version not in (3, 4):
        raise ValueError(f".ninja_deps version {version}")
    paths, offset = [], len(header) + 4
    while offset + 4 <= len(data):
        (size,) = struct.unpack_from("<I", data, offset)
        is_deps, size = size >> 31, size & 0x7FFFFFFF
        record = data[offset + 4 : offset + 4 + size]
        offset += 4 + size
        if len(record) < size:
            break  # a truncated last record: ninja ignores it too
        if not is_deps:  # a path record: the path, NUL padding, then ~id
            path = record[:-4].rstrip(b"\0").decode()
            paths.append(os.path.join(directory, path))  # absolute paths stay absolute
    if not paths:
        raise ValueError(".ninja_deps lists no file")
    return paths


def _cpu() -> str:
    """The CPU as DeepSpeed's flags see it: architecture, vendor, model and feature flags
    (empty if ``/proc/cpuinfo`` cannot be read)."""
    keep = ("vendor_id", "cpu family", "model", "model name", "flags", "features", "cpu part")
    lines = [os.uname().machine]
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break  # the first processor's block
                name, _, value = line.partition(":")
                if name.strip().lower() in keep:
                    lines.append(f"{name.strip()}: {value.strip()}")
    except OSError:
        return ""
    return "\n".join(lines)
