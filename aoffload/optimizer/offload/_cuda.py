"""OffloadAdam's CUDA link: gradients to the CPU masters and updated values back, through
pinned buffers on a side stream.

For every CUDA device that holds parameters there is one side stream; for every CUDA
bucket, a pinned buffer of its gradients and one of its parameters, in the model's dtype.

* **Gradients out** (a hook, on autograd's device thread): the side stream waits for the
  stream that produced the gradient, then copies it into the pinned buffer
  (``non_blocking``); the gradient is recorded on the side stream so the caching allocator
  keeps it until the copy ran. When the bucket is complete, an event is recorded and the
  *link thread* waits for it, widens the pinned gradients into the shared fp32 grad and
  submits the bucket. Nothing waits on the backward's thread.
* **Values back** (the step's thread, once a bucket's step is final): the master is
  narrowed into the pinned parameter buffer (after the previous step's upload from it
  ran), the side stream waits for everything queued so far on the parameters' stream (the
  backward still reads them on the device), and the upload runs on the side stream.
  :meth:`CudaLinks.finish` makes the current streams wait for the uploads: the next
  forward sees the new values, and the host never waits for the device.

None of this runs without a GPU; the CPU path never imports it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import torch

from ..._runtime.threads import DaemonThreadExecutor
from ._buckets import Bucket

__all__ = ["CudaLinks"]


class _Link:
    """The pinned buffers of one CUDA bucket and the event of its last upload."""

    __slots__ = ("grad_views", "param_views", "pinned_grad", "pinned_param", "uploaded")

    def __init__(self, bucket: Bucket) -> None:
        numel = bucket.numel
        self.pinned_grad = torch.empty(numel, dtype=bucket.dtype, pin_memory=True)
        self.pinned_param = torch.empty(numel, dtype=bucket.dtype, pin_memory=True)
        self.grad_views = [
            self.pinned_grad[o : o + p.numel()].view(p.shape)
            for p, o in zip(bucket.params, bucket.offsets, strict=True)
        ]
        self.param_views = [
            self.pinned_param[o : o + p.numel()].view(p.shape)
            for p, o in zip(bucket.params, bucket.offsets, strict=True)
        ]
        self.uploaded: torch.cuda.Event | None = None


def _link(bucket: Bucket) -> _Link:
    link = bucket.link
    if not isinstance(link, _Link):
        raise RuntimeError("a CUDA bucket without its link")  # a bug of ours
    return link


class CudaLinks:
    """The side streams and the link thread of one OffloadAdam's CUDA buckets."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._thread = DaemonThreadExecutor("aoffload-offload-adam-link")

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream

    def attach(self, bucket: Bucket) -> None:
        """Give a CUDA bucket its pinned buffers (at start)."""
        bucket.link = _Link(bucket)
        self._stream(bucket.device)

    def grad_out(self, bucket: Bucket, position: int, grad: torch.Tensor) -> None:
        """Queue the copy of one gradient into the bucket's pinned buffer (a hook's thread)."""
        side = self._stream(bucket.device)
        side.wait_stream(torch.cuda.current_stream(bucket.device))
        with torch.cuda.stream(side):
            _link(bucket).grad_views[position].copy_(grad, non_blocking=True)
        grad.record_stream(side)

    def complete(self, bucket: Bucket, then: Callable[[Bucket], None]) -> None:
        """Once the bucket's gradients are on the host: widen them, then ``then(bucket)``
        (the submit), on the link thread."""
        copied = self._stream(bucket.device).record_event()
        link = _link(bucket)

        def land() -> None:
            copied.synchronize()
            if bucket.grad is None:
                raise RuntimeError("a CUDA bucket without its grad")  # closed meanwhile
            bucket.grad.copy_(link.pinned_grad)
            then(bucket)

        self._thread.submit(land)

    def flush(self) -> concurrent.futures.Future[None]:
        """A future done once every hand-off queued before has run (its failures are the
        hooks' to report)."""
        return self._thread.submit(lambda: None)

    def read(self, bucket: Bucket, positions: list[int]) -> list[torch.Tensor]:
        """The parameters at ``positions`` on the host (to resync the master)."""
        return [bucket.params[i].detach().to("cpu") for i in positions]

    def publish(self, bucket: Bucket) -> None:
        """Upload the stepped master into the model's parameters on the side stream."""
        link = _link(bucket)
        if link.uploaded is not None:
            link.uploaded.synchronize()  # the last upload from the pinned buffer has run
        if bucket.master is None:
            raise RuntimeError("a CUDA bucket without its master")  # a bug of ours
        link.pinned_param.copy_(bucket.master)
        side = self._stream(bucket.device)
        side.wait_stream(torch.cuda.current_stream(bucket.device))
        with torch.no_grad(), torch.cuda.stream(side):
            for param, view in zip(bucket.params, link.param_views, strict=True):
                param.copy_(view, non_blocking=True)
        link.uploaded = side.record_event()
        bucket.mark_published()

    def finish(self) -> None:
        """Order every device's current stream after the uploads (the host does not wait)."""
        for device, side in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(side)

    def close(self) -> None:
        """Stop the link thread after what it has queued."""
        self._thread.shutdown(wait=True)
