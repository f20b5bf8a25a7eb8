"""Counting host synchronisations, on any device.

On a GPU every point where the host reads a device value (`.item()`, `bool(t)`, `.tolist()`, a
data-dependent shape such as `nonzero` or boolean indexing) stalls the host until the device has
caught up, and the next kernel launches only after that: a decoding step with many of them cannot
keep the GPU busy, whatever the kernels cost. CUDA reports them itself
(`torch.cuda.set_sync_debug_mode`), but only on a GPU; this counter sees the same operations on the
CPU too, where they cost nothing, so that tests on a machine without a GPU can bound how often a
decoding step talks to the host.

What it counts: every call that would make the host wait for the device on CUDA, recognised by
the operator (through a dispatch mode) or by the Tensor method (`tolist`, `cpu`, `numpy`, which
do not reach the dispatcher for a CPU tensor), and every `torch.tensor(..., device=...)`: PyTorch
copies pageable host memory to a GPU and then waits for the stream, so even a copy of a few
integers to the device drains the queue. Small host values (lengths, indices) therefore go to the
device through `to_device`, which stages them in pinned memory and copies without waiting.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import specdec.core.device as _device
from specdec.core.device import _TENSOR, HostCopy, reads_are_free, to_device

__all__ = ["HostCopy", "HostSyncs", "count_host_syncs", "detect_cuda_syncs", "reads_are_free", "reads_on_host",
           "to_device"]

# Operators whose result the host must read (a scalar, or a shape that depends on the data).
_READS = {"aten.item.default", "aten._local_scalar_dense.default", "aten.is_nonzero.default",
          "aten.equal.default", "aten.nonzero.default", "aten.masked_select.default",
          "aten._unique2.default", "aten.unique_consecutive.default", "aten.unique_dim.default",
          "aten.repeat_interleave.Tensor", "aten.nonzero_static.default"}
# Reads that also dispatch one of the operators above (bool(t) -> is_nonzero -> item): counted once.
_NESTED = {"aten.item.default": {"aten._local_scalar_dense.default"},
           "aten.is_nonzero.default": {"aten.item.default", "aten._local_scalar_dense.default"}}
_METHODS = ("tolist", "cpu", "numpy")


def _bool_index(args) -> bool:
    """aten.index / index_put with a boolean index: the result's shape depends on the mask's data."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def reads_on_host(func, args) -> bool:
    """Whether the operator call `func(*args)` makes the host read a device value (a scalar, or a
    result whose shape depends on the data): on CUDA a synchronisation, and inside a CUDA-graph
    capture an error."""
    name = str(func)
    return name in _READS or (name in ("aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default")
                              and _bool_index(args))


class HostSyncs:
    """What `count_host_syncs` saw: `total`, `by_kind` (operator or method name -> count) and, with
    `where=True`, the innermost specdec frame of each (file:line -> count), to find them."""

    def __init__(self, where: bool):
        self.by_kind: Counter[str] = Counter()
        self.where: Counter[str] | None = Counter() if where else None
        self._depth: list[str] = []

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def _record(self, kind: str) -> None:
        self.by_kind[kind] += 1
        if self.where is not None:
            frames = [f for f in traceback.extract_stack()[:-2] if "/specdec/" in f.filename
                      and not f.filename.endswith("syncs.py")]
            self.where[f"{frames[-1].filename.rsplit('/specdec/', 1)[1]}:{frames[-1].lineno}" if frames
                       else "outside specdec"] += 1

    def __repr__(self) -> str:
        return f"HostSyncs(total={self.total}, by_kind={dict(self.by_kind)})"


class _Mode(TorchDispatchMode):
    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        outer = self.syncs._depth[-1] if self.syncs._depth else None
        nested = outer is not None and name in _NESTED.get(outer, ())
        if not nested and reads_on_host(func, args):
            self.syncs._record(name.removeprefix("aten.").removesuffix(".default"))
        self.syncs._depth.append(name)
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.syncs._depth.pop()


@contextlib.contextmanager
def count_host_syncs(where: bool = False) -> Iterator[HostSyncs]:
    """Count the host synchronisations of the code inside (every thread's tensor calls; run it alone).

        with count_host_syncs() as syncs:
            decoder.generate(...)
        syncs.total, syncs.by_kind

    Compiled calls run as their Python inside (dynamo's `force_eager` stance; a graph compiled
    already still runs where its caller skips the guards): dynamo does not trace under a dispatch
    mode, and a frame it was asked to compile under one it never compiles again in the process. A
    compiled graph holds no reads (a read breaks the graph and runs eagerly either way), so the
    count is the same.
    """
    syncs = HostSyncs(where)
    originals = {name: getattr(torch.Tensor, name) for name in _METHODS}

    def patched(name):
        original = originals[name]

        def method(self, *args, **kwargs):
            if not syncs._depth:  # a read inside an operator is that operator's
                syncs._record(name)
            return original(self, *args, **kwargs)
        return method

    def tensor(data, *args, **kwargs):
        if kwargs.get("device") is not None:  # a pageable copy to the device: the stream is waited for
            syncs._record("tensor(device=)")
        return _TENSOR(data, *args, **kwargs)

    if _device.COUNTING:
        raise RuntimeError("count_host_syncs blocks do not nest")
    _device.COUNTING += 1
    try:
        for name in _METHODS:
            setattr(torch.Tensor, name, patched(name))
        torch.tensor = tensor
        with torch.compiler.set_stance("force_eager"), _Mode(syncs):
            yield syncs
    finally:
        _device.COUNTING -= 1
        torch.tensor = _TENSOR
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def detect_cuda_syncs() -> Iterator[list[str]]:
    """CUDA's own view, on a GPU: the messages of every synchronisation its sync detector
    (`torch.cuda.set_sync_debug_mode("warn")`) reports inside the block, in a list filled when it ends.
    The ground truth that `count_host_syncs` stands in for where there is no GPU.

        with detect_cuda_syncs() as detected:
            decoder.generate(...)
        len(detected)
    """
    detected: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield detected
        finally:
            torch.cuda.set_sync_debug_mode("default")
            detected += [str(w.message) for w in caught if is_sync_report(str(w.message))]


def is_sync_report(message: str) -> bool:
    """Whether a warning of CUDA's sync detector reports a synchronisation. The first switch to "warn"
    in a process also warns that the detector is a prototype, in words that mention synchronizing
    operations too: counted, it made the first check of a GPU run see one sync more than there was."""
    return "called a synchronizing" in message


