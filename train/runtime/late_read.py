"""A value of the device the host reads later, without draining the device's queue.

Reading a device tensor on the host (`.item()`, `.tolist()`, `bool()`) waits for every kernel queued before
it: the GPU goes idle while the host, which should be queuing the next step, waits and then catches up.
`LateRead` instead copies the value to page-locked host memory as soon as the device makes it (the copy is
queued behind the kernels that make it; nothing waits now) and marks that point with an event; `tolist()`
waits for that event only. Read one step later, the event is long past by then: the device has moved on to
the next step's kernels, which stay queued. On the CPU the value is simply kept.
"""

from __future__ import annotations

import torch


class LateRead:
    """`tensor`'s value as it is now, read when asked (see the module docstring)."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.is_cuda:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host, self._copied = tensor, None

    def tolist(self):
        """The value (waits for its copy only)."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host.tolist()
