"""OffloadAdam's options past the hyper-parameters: one frozen record, validated once."""

from __future__ import annotations

import dataclasses

from ..._errors import OptimizerError
from .._subgroups import BACKENDS

__all__ = ["DEFAULT_BUCKET_MB", "Options"]

DEFAULT_BUCKET_MB = 32.0
"""Bucket size in MiB of fp32. Not yet settled by measurement: ``python -m aoffload.bench
offload_adam`` compares 32, 4 and 1 MiB on a 21 MB model, and on the shared 2-core host it
ran on the differences were within the noise (see docs/offload_adam.md)."""


@dataclasses.dataclass(frozen=True)
class Options:
    """The constructor's ``backend``, ``bucket_mb`` (as bytes), ``max_grad_norm``,
    ``skip_nonfinite``, ``worker_cores``, ``start_timeout`` and ``close_timeout``."""

    backend: str
    bucket_bytes: int
    max_grad_norm: float | None
    skip_nonfinite: bool
    worker_cores: float | None
    start_timeout: float
    close_timeout: float

    @property
    def speculative(self) -> bool:
        """Whether the step validates the global gradient norm (clipping, skipping)."""
        return self.max_grad_norm is not None or self.skip_nonfinite

    @classmethod
    def checked(
        cls,
        backend: str,
        bucket_mb: float,
        max_grad_norm: float | None,
        skip_nonfinite: bool,
        worker_cores: float | None,
        start_timeout: float,
        close_timeout: float,
    ) -> Options:
        """The options, each checked (:class:`~aoffload.OptimizerError` names the wrong one)."""
        if backend not in BACKENDS:
            raise OptimizerError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise OptimizerError(f"bucket_mb must be a number > 0, got {bucket_mb!r}")
        if max_grad_norm is not None and not (
            isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0
        ):
            raise OptimizerError(
                f"max_grad_norm must be None or a number > 0, got {max_grad_norm!r}"
            )
        if worker_cores is not None and not 0.0 < worker_cores <= 1.0:
            raise OptimizerError(f"worker_cores must be in (0, 1], got {worker_cores!r}")
        for name, value in (("start_timeout", start_timeout), ("close_timeout", close_timeout)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise OptimizerError(f"{name} must be a number of seconds > 0, got {value!r}")
        return cls(
            backend=backend,
            bucket_bytes=int(bucket_mb * (1 << 20)),
            max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
            skip_nonfinite=bool(skip_nonfinite),
            worker_cores=worker_cores,
            start_timeout=float(start_timeout),
            close_timeout=float(close_timeout),
        )
