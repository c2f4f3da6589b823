"""OffloadAdam: a ``torch.optim`` optimizer whose step runs in the CPU optimizer's worker.

- :mod:`._optimizer`: :class:`~._optimizer.OffloadAdam`, the optimizer face;
- :mod:`._offloader`: the worker, the buckets and the backward's hooks, without a face;
- :mod:`._plan`, :mod:`._buckets`: which parameters go together, and their shared memory;
- :mod:`._step`: one step once the backward is over (validate, redo, settle);
- :mod:`._state`: the state dict in ``torch.optim.AdamW``'s layout;
- :mod:`._cuda`: CUDA parameters' side streams and pinned buffers.
"""
