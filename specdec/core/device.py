"""Moving small host values to the device and back without stalling it.

On a GPU every host read of a device value waits for the device, and `torch.tensor(..., device=)`
from pageable memory waits for the stream: a decoding step that does either often cannot keep the
GPU busy. These helpers are what the core uses instead (`specdec.accel.syncs` counts the reads that
remain). On a CPU they are plain copies.
"""

from __future__ import annotations

import torch

__all__ = ["HostCopy", "reads_are_free", "to_device"]

# Open host-sync counters (`specdec.accel.syncs.count_host_syncs`): while one counts, a CPU answers
# `reads_are_free` like a GPU, so that the count is the GPU's.
COUNTING = 0
_TENSOR = torch.tensor  # unpatched: `to_device` makes host tensors while the sync counter watches torch.tensor


def to_device(values, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values (a list, nested lists or a CPU tensor) as a tensor on `device`, without a
    synchronisation: on a GPU through pinned memory and a non-blocking copy (PyTorch's caching host
    allocator keeps the pinned buffer until the copy has run); elsewhere a plain tensor."""
    host = values if isinstance(values, torch.Tensor) else _TENSOR(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def reads_are_free(device: torch.device) -> bool:
    """Whether reading a value back costs nothing on `device` (the CPU): loops that may stop early
    on a device value ("has every row finished?") ask only there, and run to their static bound
    elsewhere, where the extra work is a few small kernels and the question a synchronisation.
    While `count_host_syncs` counts, the CPU answers like a GPU, so that the count is the GPU's."""
    return device.type == "cpu" and not COUNTING


class HostCopy:
    """A device tensor's copy to the host, queued now and read later: on CUDA a non-blocking copy
    into pinned memory followed by an event, so that `read` waits for the work queued before the
    copy and not for what was queued after it; elsewhere a copy made now (what is queued after may
    overwrite the tensor: a captured step's outputs are the next replay's)."""

    def __init__(self, values: torch.Tensor):
        self.event = None
        if values.device.type == "cuda":
            values = values.to("cpu", non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            values = values.clone()
        self.values = values

    def read(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.values.tolist()
