"""CUDA graphs captured by specdec itself, one per compiled call shape: `compile=on`'s
`cuda_graphs="explicit"`.

`compile=on` runs every pass at bucketed static shapes over pooled cache buffers (`specdec.accel.compiled`),
so a pass of one shape always reads and writes the same addresses. On CUDA there are two ways to turn
that into one CUDA-graph replay a pass:

- `trees` (the default): `torch.compile(mode="reduce-overhead")`, inductor's CUDA-graph trees. Each
  call still goes through dynamo's frame and guards and the trees' bookkeeping (checking that static
  inputs have not moved, copying the others in).
- `explicit`: inductor's kernels without CUDA graphs, captured here into a `torch.cuda.CUDAGraph` per
  call shape (vLLM and SGLang capture theirs the same way). A call is then a copy of each input that
  changes between passes (tokens, positions, write slots, a tree's mask) into the graph's own input
  buffers, and one replay: no dynamo, no guards, no Python of the model.

Which is faster is for the device benchmark to measure (`scripts/bench_gpu.py` runs both).

Capture, per new shape: the inputs are copied into buffers the graph owns (`_static`), the call runs
once on a side stream (it compiles there, and libraries such as cuBLAS set up their workspaces
outside the capture), then it is captured. That run is the pass itself: its cache writes are the
ones the replay makes again (same tokens, same slots), so running it twice changes nothing. Every
graph draws its memory from one pool per device (`graph_pool`, kept alive); a graph's outputs are overwritten by its next
replay and may share memory with other graphs' temporaries, so callers copy what they keep before
the next pass (they do: `CompiledForward.forward` and friends clone on CUDA).

What the graph reads must not move: the weights (an `Engine` refuses a model converted behind its
back) and the pooled cache buffers (a pool that grows drops its graphs: `_BucketedPasses`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CUDA_GRAPH_MODES = ("trees", "explicit")

_POOLS: dict[torch.device, tuple[object, torch.cuda.CUDAGraph]] = {}


def check_cuda_graphs(mode: str) -> None:
    """Raise unless `mode` is one of CUDA_GRAPH_MODES."""
    if mode not in CUDA_GRAPH_MODES:
        raise ValueError(f"cuda_graphs={mode!r} is not one of: {', '.join(CUDA_GRAPH_MODES)}")


def graph_pool(device: torch.device):
    """The memory pool every explicit graph on `device` captures into, made once per process and kept.

    The caching allocator counts the graphs that use a pool and lets it go when none is left, but
    only once the memory it holds is free: until then a capture into it fails an internal assertion
    (`use_count > 0`). That happens as soon as a decoder's graphs are dropped while an output of
    theirs is still alive, or a pool that grew drops its graphs, and the next capture comes. So the
    pool's first graph is one of its own (one tiny kernel), held here for the process's life."""
    if device not in _POOLS:
        handle, anchor = torch.cuda.graph_pool_handle(), torch.cuda.CUDAGraph()
        with torch.cuda.device(device), torch.cuda.graph(anchor, pool=handle):
            torch.zeros(1, device=device)
        _POOLS[device] = (handle, anchor)
    return _POOLS[device][0]


def _static(x):
    """A copy of `x` the graph owns: every tensor cloned, tuples, lists and dicts copied through,
    anything else (models, layouts, ints) as it is."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_static(v) for v in x)
    if isinstance(x, dict):
        return {k: _static(v) for k, v in x.items()}
    return x


def _tensors(x) -> list[torch.Tensor]:
    """The tensors in `x`, in a fixed order (what `_static` cloned)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for k in x for t in _tensors(x[k])]
    return []


class CudaGraph:
    """`torch.cuda.CUDAGraph` behind two calls: `capture(fn)` (warm-up on a side stream, then the
    capture; returns what `fn` returned, whose tensors the replays overwrite) and `replay()`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], object]) -> object:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn()
        current.wait_stream(side)
        with torch.cuda.graph(self.graph, pool=graph_pool(self.device)):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class CapturedCall:
    """One call `fn(*args)` captured at its shapes: `__call__(args, extra)` copies the tensors of
    `args` (and of `extra`, the tensors `fn` reads from objects it is given, such as a cache view's
    write slots) into the graph's buffers, replays it and returns its outputs (overwritten by the
    next replay). `graph` is what captures: `CudaGraph` on CUDA, a stand-in in tests."""

    def __init__(self, fn: Callable, args: tuple, extra: dict[str, torch.Tensor], holder: object,
                 graph):
        self.args = _static(args)
        self.extra = _static(extra)
        self.graph = graph
        self._inputs = _tensors(self.args) + _tensors(self.extra)

        def call():
            for name, value in self.extra.items():  # the holder's tensors are the graph's own buffers
                setattr(holder, name, value)
            return fn(*self.args)

        self.out = graph.capture(call)

    def __call__(self, args: tuple, extra: dict[str, torch.Tensor]) -> object:
        new = _tensors(args) + _tensors(extra)
        if len(new) != len(self._inputs):
            raise RuntimeError("a captured call was replayed with other inputs than it was captured with")
        for mine, theirs in zip(self._inputs, new):
            if mine is not theirs:
                mine.copy_(theirs)
        self.graph.replay()
        return self.out
