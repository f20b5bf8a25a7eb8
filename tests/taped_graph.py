"""A CUDA graph on a CPU, for tests: `TapedGraph` records the operators a call dispatches while it is
captured, and a replay runs that record alone, without the caller's Python.

That is what a real replay does, and what a stand-in that re-runs the call cannot show:

- whatever the Python worked out while capturing (a host length, a key bucket, a list turned into a
  tensor, a branch taken on a host value) is frozen into the graph. If the caller decides something
  differently at a later call that replays the same graph, the replay still does what the capture
  did, and the tokens differ from the eager path's;
- the memory is the capture's: every operator reads the tensors it read then (an input the caller
  forgot to copy into the graph's buffers is read stale), and every result is written into the
  tensor the capture made for it, so the outputs a capture returned are overwritten by each replay;
- a capture refuses what CUDA's refuses, or what a GPU would replay wrongly: a host read of a
  device value (`.item()`, `.tolist()`, `nonzero`, boolean indexing: `specdec.accel.syncs.reads_on_host`),
  a tensor made from host values (`torch.tensor(...)`: its copy to the device would replay from a
  pinned buffer reused since) and a draw from a `torch.Generator` (CUDA graphs replay only
  generators registered with them; specdec draws before a capture) raise the RuntimeError a CUDA
  capture would.

A capture runs the call once as it is (a real capture's warm-up run: compiled calls compile there),
then again while recording: both change nothing that the replay after them does not set again (a
captured call's cache writes are its replay's, `specdec.accel.cuda_graphs`).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from specdec.accel.syncs import reads_on_host
from specdec.core.engine import Engine
from tests.conftest import make_engine

CAPTURE_ERROR = "operation not permitted when stream is capturing"


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Recorder(TorchDispatchMode):
    """Runs each operator and records it with, per result, whether it is a fresh tensor (to be
    copied into the recorded one on replay) or shares memory with an input (a view, an in-place
    result: up to date once the operator has run again)."""

    def __init__(self, tape: list):
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if reads_on_host(func, args):
            raise RuntimeError(f"{CAPTURE_ERROR}: {func} reads a device value on the host")
        if func is torch.ops.aten.lift_fresh.default:  # torch.tensor(host values), then copied over
            raise RuntimeError(f"{CAPTURE_ERROR}: a tensor made from host values inside the capture "
                               "(its copy to the device would replay from a host buffer since reused)")
        if any(isinstance(x, torch.Generator) for x in tree_leaves((args, kwargs))):
            raise RuntimeError(f"{CAPTURE_ERROR}: {func} draws from a generator not registered with the graph")
        out = func(*args, **kwargs)
        inputs = {_storage(x) for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.numel()}
        fresh = [i for i, x in enumerate(tree_leaves(out))
                 if isinstance(x, torch.Tensor) and x.numel() and _storage(x) not in inputs]
        self.tape.append((func, args, kwargs, out, fresh))
        return out


@contextlib.contextmanager
def _no_host_methods():
    """Tensor methods that read a CPU tensor on the host without reaching the dispatcher (on CUDA
    each is a copy to the host and a wait): refused while capturing."""
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}

    def refused(name):
        def method(self, *args, **kwargs):
            raise RuntimeError(f"{CAPTURE_ERROR}: Tensor.{name}() reads a device value on the host")
        return method

    try:
        for name in originals:
            setattr(torch.Tensor, name, refused(name))
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class TapedGraph:
    """What captures an explicit graph in the tests (`graph_class=`): `capture(fn)` runs `fn` once,
    recording its operators, and returns its outputs; `replay()` runs the recorded operators again
    and writes their results into the tensors the capture made (the module's docstring)."""

    captures = 0
    replays = 0

    def __init__(self, device):
        self.tape: list = []
        self.out = None

    def capture(self, fn):
        type(self).captures += 1
        fn()  # the run a real capture makes first, outside it: compiled calls compile here
        # Recorded with dynamo's compiled calls run as their Python: dynamo does not trace under a
        # dispatch mode, and a frame it fails to trace there it never compiles again.
        with torch.compiler.set_stance("force_eager"), _no_host_methods(), _Recorder(self.tape):
            self.out = fn()
        return self.out

    def replay(self) -> None:
        type(self).replays += 1
        with torch.inference_mode():  # the recorded tensors are the capture's, made under it
            for func, args, kwargs, out, fresh in self.tape:
                new = tree_leaves(func(*args, **kwargs))
                mine = tree_leaves(out)
                for i in fresh:
                    mine[i].copy_(new[i])


def taped_engine(target, draft=None, compile: str = "on") -> Engine:
    """A float32 engine whose compiled passes (dynamo's quick `eager` backend) run under explicit CUDA
    graphs captured by `TapedGraph`, as `cuda_graphs="explicit"` runs them on a GPU (a pipelined step
    is then captured whole); compile="off" leaves it eager."""
    return make_engine(target, draft, compile=compile, cuda_graphs="explicit", graph_class=TapedGraph)
