"""Compiled forward passes at a small set of fixed shapes: the engine's `compile=on`.

Eager decoding is launch-bound on a GPU: every step runs the model's Python and hundreds of small
kernels. `torch.compile` removes both (on CUDA with `mode="reduce-overhead"`, CUDA graphs), but
only if the shapes it sees repeat: a graph is specialised to its shapes, and the eager path's
shapes change every step (the key length grows by the tokens accepted, the width by k).

So a compiled pass runs at *bucketed* shapes:

- width: the T tokens of a pass are padded to the next of `WIDTHS` (1, 2, 4, 6, 8, 10, 12, 16) with
  copies of the last token (in bfloat16 on a CPU with bfloat16 units, to at least 4:
  `narrowest_width`). The padding is written after every row's real tokens, is never made valid
  (`advance` counts only the real ones) and its logits are dropped, exactly like the padding of a ragged pass. Wider passes (prefill, long catch-ups) run eagerly: they happen once per turn.
- key length: attention reads the preallocated cache up to the next power of two >= the longest
  row's end (at least `MIN_KV`), with every row's valid length in an explicit 4-D mask, so the
  key length changes about log2(context) times a generation instead of every step.
- the cache's buffers: pooled per batch size, at least `MIN_BUFFER` positions or as long as the
  longest generation so far needed, and reused by the next generation, so that graphs (whose
  inputs include the buffers' full shape) are not compiled again per prompt length and a CUDA
  graph captured on them stays valid (it records addresses).

A change of k or of the batch's raggedness therefore reuses graphs; a new batch size, width or
key bucket compiles one more. `CompiledForward.report()` counts the graphs compiled, the passes
run compiled and eagerly, and the seconds spent in the passes that compiled.

Token-tree passes (EAGLE, Medusa, suffix trees) run compiled too, padded to a width bucket like
every pass: a tree of another size this step reuses the graph of its bucket (at most one per width
up to the node budget). Their attention mask is built outside the graph, as the eager path
builds it (the key-bucket mask from the nodes' positions, the tree's block `[B, N+1, N+1]` overlaid
on the block's columns; padding slots see only themselves), and is an input of the graph, whose
shape is fixed by the buckets. Passes that keep the target's hidden states for a drafter return
them from the graph at the bucketed width, through a forward hook on the decoder installed once
per model (`_Capture`); they are stored in the cache at the positions the keys went to, padding at
scratch positions, exactly as an eager ragged pass stores its padding's. Passes of a model that
keeps several layers' hidden states (EAGLE-3's taps, `CachedModel.keep_hidden_states(layers)`) run
eagerly: the compiled forward declines them.

EAGLE's drafter (one decoder layer over a cache of its own) compiles the same way: `CompiledModule`
runs any module that takes `[B, T, ...]` inputs, positions, a mask and a cache at the same width and
key buckets over pooled buffers, its mask built outside the graph by the caller. A module without a
cache (Medusa's heads with the output head they read) compiles whole at the shapes it is called
with (`CompiledCall`).

Two things inside every compiled pass differ from the eager path, for speed, not for results:

- on a CPU, inductor *freezes* the weights (`freezes`): they become constants of the graph, so each
  linear layer's weight is packed once for oneDNN's bfloat16 kernels instead of at every call;
- grouped-query attention runs without repeating the keys and values per query head
  (`specdec.core.attention.grouped_sdpa`, which the eager path runs too): under dynamo, transformers'
  SDPA path copies the cache to every head first.

The speed is measured in experiments/gpu/README.md; in float32 the compiled path's greedy tokens
equal the eager path's (tests/test_compile.py).
"""

from __future__ import annotations

import contextlib
import inspect
import time
import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec.accel.cuda_graphs import CapturedCall, CudaGraph, check_cuda_graphs, graph_pool
from specdec.accel.syncs import to_device
from specdec.core.attention import grouped_attention
from specdec.core.cache import row_index
from specdec.core.engine import cpu_has_bfloat16_units
from specdec.core.sampling import greedy_tokens

COMPILE_MODES = ("off", "on", "autotune", "frozen", "auto")
# The widths a pass is padded to. Powers of two, and 6, 10 and 12 between, so that the defaults'
# passes (n-gram's k = 4 and EAGLE's 4-node tree: 5 tokens; suffix decoding's k = 8 and 8-node trees:
# 9 or 10) do not pay for the next power of two (experiments/gpu/LOG.md, "Widths").
WIDTHS = (1, 2, 4, 6, 8, 10, 12, 16)
# The narrowest width a pass runs at, by (device type, dtype), where the CPU has bfloat16 units
# (`narrowest_width`): passes of fewer tokens are padded to it. Compiled on a CPU with bfloat16 units,
# oneDNN's bfloat16 kernels serve one or two rows worse than four, so a pass of 1 token costs more
# than one of 4; in float32, and where bfloat16 is emulated (AVX2), one token is the cheapest
# (experiments/gpu/LOG.md, "Widths"). Anything else: 1.
NARROWEST = {("cpu", torch.bfloat16): 4}
MAX_WIDTH = WIDTHS[-1]  # passes wider than this run eagerly (prefill): compiling every prompt length never pays
MIN_KV = 64  # the smallest key bucket
# Pooled cache buffers hold at least this many positions: a longer buffer for a longer prompt would
# compile every graph again (SmolLM2 at batch 1: 24 MB; a 1B Llama at batch 32: 1 GB).
MIN_BUFFER = 1024
RECOMPILE_LIMIT = 64  # torch's default (8) is below widths x key buckets x batch sizes x models
# Under compile=autotune, bfloat16 on a CPU with bfloat16 units (`gemm_backends`): graphs whose matrix
# products take at most this many rows (batch x width) autotune among inductor's C++ GEMM templates
# alone: with oneDNN's kernels among the choices, autotuning (which times each product on its own)
# keeps some that cost more inside the graph. Wider, the C++ templates alone are far slower, so wider
# graphs keep both; in float32 both choices cost the same, so it keeps the default
# (experiments/gpu/LOG.md, "Autotuning among the C++ GEMMs alone for narrow graphs (run 33)").
CPP_GEMM_ROWS = 4
# Calls whose graph a caller has already run skip dynamo's guard evaluation (`_unguarded`), host time
# paid on every call (experiments/gpu/LOG.md, "Guard evaluation"). False: every call evaluates them.
SKIP_KNOWN_GUARDS = True


def resolve_compile(compile: str | bool, device: torch.device) -> bool:
    """Whether passes compile: `on`, `autotune` (on, with inductor's GEMM autotuning: `autotunes`)
    and `frozen` (on, with the weights frozen into the graphs on every device: `frozen_weights`)
    do, `off` does not, `auto` compiles on CUDA only. On a CPU compiled decoding is faster, but
    every process first compiles its graphs again (inductor's on-disk cache skips graphs whose
    frozen weights are packed for oneDNN), so a typical run does not win that time back: `auto`
    keeps the CPU eager (experiments/gpu/LOG.md, "Runs 11-14").
    On CUDA, eager decoding is launch-bound, which is what compiling removes (experiments/gpu/LOG.md,
    "NVIDIA H200: first measurements")."""
    if compile is True or compile in ("on", "autotune", "frozen"):
        return True
    if compile is False or compile == "off":
        return False
    if compile == "auto":
        return device.type == "cuda"
    raise ValueError(f"compile={compile!r} is not one of: {', '.join(COMPILE_MODES)}")


def autotunes(compile: str | bool) -> bool:
    """`compile=autotune`: inductor's `max_autotune`, which benchmarks each matrix product's kernels
    (its C++ GEMM templates against oneDNN's on a CPU, Triton's against cuBLAS on CUDA) while
    compiling and keeps the fastest. On a CPU with bfloat16 units its C++ micro-GEMMs beat oneDNN's
    packed linear layers for a few rows, at the price of a much longer compile
    (experiments/gpu/LOG.md, "Autotuning")."""
    return compile == "autotune"


def frozen_weights(compile: str | bool) -> bool | None:
    """`compile=frozen`: inductor's weight freezing on every device (True), where `on` freezes on a
    CPU only (None: `freezes` decides). On CUDA the freezing passes also concatenate the linear
    layers that read one input, q/k/v and gate/up, into one product each: fewer, larger products,
    a small gain on a GPU. It is not the default there because the concatenated weights are copies
    beside the model's own (the eager prefill reads those): about half the weights' memory more for a
    Llama-shaped model (experiments/gpu/LOG.md, "NVIDIA H200: run 3")."""
    return True if compile == "frozen" else None


def narrowest_width(device: torch.device, dtype: torch.dtype, autotune: bool = False) -> int:
    """`NARROWEST` for (device, dtype); on a CPU only where it has bfloat16 units, else 1. Under
    `autotune` 1: the padding serves oneDNN's kernels, and autotuning picks others where they do better."""
    if autotune or device.type == "cpu" and not cpu_has_bfloat16_units():
        return 1
    return NARROWEST.get((device.type, dtype), 1)


def gemm_backends(device: torch.device, dtype: torch.dtype, autotune: bool, rows: int | None) -> str | None:
    """The GEMM kernels a graph autotunes among when not inductor's default (None): under
    `compile=autotune`, bfloat16 on a CPU with bfloat16 units, a graph whose matrix products take at
    most `CPP_GEMM_ROWS` rows (batch x width) tunes among inductor's C++ GEMM templates only."""
    if autotune and rows is not None and rows <= CPP_GEMM_ROWS and device.type == "cpu" \
            and dtype == torch.bfloat16 and cpu_has_bfloat16_units():
        return "CPP"
    return None


def width_bucket(t: int, least: int = 1) -> int:
    """The smallest of WIDTHS >= max(t, least) (t itself past the last: such a pass runs eagerly)."""
    return next((w for w in WIDTHS if w >= max(t, least)), t)


def bucket(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least)."""
    n = max(n, least)
    return 1 << (n - 1).bit_length()


class _BucketLayer(CacheLayerMixin):
    """One layer of a `_BucketView`: writes each row at its own positions, returns the bucketed view."""

    def __init__(self, view: _BucketView, index: int):
        self.view, self.index = view, index
        super().__init__()
        self.is_initialized = True

    # The row cache's buffers, which a model may read as a layer's state: Mllama asks every layer
    # whether `keys.numel() > 0` (cross-attention states cached) before it runs it.
    @property
    def keys(self) -> torch.Tensor:
        return self.view.cache.layers[self.index].keys

    @keys.setter
    def keys(self, value) -> None:  # the mixin's `__init__` sets None; the buffers are the row cache's
        pass

    @property
    def values(self) -> torch.Tensor:
        return self.view.cache.layers[self.index].values

    @values.setter
    def values(self, value) -> None:
        pass

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Never called: the buffers are the row cache's, allocated by its first (eager) pass."""
        raise RuntimeError("a compiled pass ran before the row cache allocated its buffers")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write `key_states, value_states: [B, H, W, D]` at `view.write_pos: [B, W]`; return the first
        `view.kv_len` positions of the buffers."""
        layer = self.view.cache.layers[self.index]
        if not layer.is_initialized:  # read while tracing: no guard, no branch in the graph
            raise RuntimeError(f"cache layer {self.index} was first written by a compiled pass; its first pass "
                               "(the prefill, eager) left it unallocated, as for a layer the model never writes")
        rows, pos, n = self.view.rows, self.view.write_pos, self.view.kv_len
        layer.keys[rows, :, pos] = key_states.transpose(1, 2)
        layer.values[rows, :, pos] = value_states.transpose(1, 2)
        return layer.keys[:, :, :n], layer.values[:, :, :n]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.view.kv_len, 0

    def get_seq_length(self) -> int:
        return self.view.kv_len

    def get_max_length(self) -> int:
        return self.view.cache.max_len


class _BucketView(Cache):
    """What the compiled model sees instead of the `RowCache`: the same buffers, written at tensor
    positions (no Python branch on the rows' lengths, which would specialise the graph to them) and
    read at a bucketed key length. `rows`, `write_pos` and `kv_len` are set before every pass."""

    def __init__(self, cache):
        self.cache = cache
        self.rows: torch.Tensor | None = None  # [B, W]
        self.write_pos: torch.Tensor | None = None  # [B, W]
        self.kv_len = 0
        super().__init__(layers=[_BucketLayer(self, i) for i in range(len(cache.layers))])


def _forward(model: torch.nn.Module, layout, view: _BucketView, tokens: torch.Tensor, positions: torch.Tensor,
             dtype: torch.dtype, mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
             capture: _Capture | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The compiled region: masks from `positions: [B, W]` over the bucketed keys (unless `mask`, the
    additive `[B, 1, W, kv_len]` masks of a tree pass, is given), then the model. Returns logits
    [B, W, V], and with `capture` (its hook active) the decoder's output `[B, W, H]` too: an output
    of the graph, not a side effect, so that a replayed CUDA graph hands it back as well."""
    if mask is None:
        mask = layout.masks(positions, view.kv_len, dtype)
    logits = layout.call(model, tokens, positions, view, mask, None)
    return logits if capture is None else (logits, capture.take())


def _catch_up_chain(model: torch.nn.Module, layout, view: _BucketView, tokens: torch.Tensor, positions: torch.Tensor,
                    last: torch.Tensor, rows: torch.Tensor, chain_positions: torch.Tensor,
                    chain_slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The compiled region of a draft's whole greedy step: its catch-up pass over `tokens: [B, W]` at
    `positions: [B, W]` (the view set up for it), the greedy token after each row's last real token
    (`last: [B]`, its index), then the chain of n single-token passes from there (`rows: [B, 1]` the
    view's rows for them, `chain_positions, chain_slots: [B, n]`). Returns `[B, n + 1]` the drafts."""
    logits = _forward(model, layout, view, tokens, positions, dtype)
    first = greedy_tokens(logits.gather(1, last[:, None, None].expand(-1, 1, logits.shape[-1])))  # [B, 1]
    view.rows = rows
    return torch.cat([first, _chain(model, layout, view, first, chain_positions, chain_slots, dtype)], dim=1)


def _chain(model: torch.nn.Module, layout, view: _BucketView, token: torch.Tensor, positions: torch.Tensor,
           slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The compiled region of a greedy draft chain: n single-token passes in one graph, each feeding
    the previous pass's argmax. `token: [B, 1]` the first token fed, `positions, slots: [B, n]` each
    pass's position and cache index. Returns the n tokens drafted, `[B, n]`."""
    drafted = []
    for j in range(slots.shape[1]):
        view.write_pos = slots[:, j:j + 1]
        logits = _forward(model, layout, view, token, positions[:, j:j + 1], dtype)
        token = greedy_tokens(logits[:, -1:])
        drafted.append(token)
    return torch.cat(drafted, dim=1)


class _Capture:
    """Where the decoder's output (the output head's input, `[B, W, H]`) of a compiled pass goes:
    a forward hook on the decoder, installed once per decoder and kept, writes it here while
    `active`. The eager path registers a hook around each pass instead; a compiled graph runs the
    hooks that were there when it was traced (their guards: `_hook_guards`), so this one is there
    before the first pass that needs it and stays. One decoder, one hook: engines that share the
    model share it, and a pass that keeps no hidden states leaves it inactive."""

    def __init__(self, decoder: torch.nn.Module):
        self.active = False
        self.value: torch.Tensor | None = None
        decoder.register_forward_hook(self._hook)

    def _hook(self, module, args, out) -> None:
        if self.active:
            self.value = out[0]

    def take(self) -> torch.Tensor:
        """The captured output of the pass being run (raises if the hook did not capture one)."""
        value, self.value = self.value, None
        if value is None:
            raise RuntimeError("a compiled pass that keeps hidden states captured none: the decoder's hook did "
                               "not run")
        return value


_CAPTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder module -> its _Capture


def _capture(decoder: torch.nn.Module) -> _Capture:
    if decoder not in _CAPTURES:
        _CAPTURES[decoder] = _Capture(decoder)
    return _CAPTURES[decoder]


def freezes(device: torch.device, backend: str) -> bool:
    """Whether passes compile with inductor's weight freezing: on a CPU, yes. The weights become
    constants of the graph, which lets inductor fold them and pack each linear layer's weight once
    for oneDNN's bfloat16 kernels instead of at every call, which is most of what compiling gains on
    a CPU (experiments/gpu/LOG.md, "Runs 6-10"). Dynamo then
    guards on each weight's identity, so another model of the same shape compiles its own graphs;
    a weight changed *in place* after compiling is not seen (specdec never trains a model it
    decodes with). CUDA keeps CUDA graphs without freezing by default: a caller's `freezing=True`
    (the device benchmark's `frozen` stage) freezes there too, where inductor's freezing passes also
    concatenate the linear layers that read one input (q/k/v, gate/up) into one matrix product each:
    fewer, larger products for a one-token pass whose per-layer products run below the bandwidth
    limit (experiments/gpu/LOG.md, "NVIDIA H200: first measurements", the profiles)."""
    return backend == "inductor" and device.type == "cpu"


def concatenates(device: torch.device, dtype: torch.dtype, freezing: bool) -> bool:
    """Whether a CPU's frozen graphs concatenate the linear layers that read one input (q/k/v,
    gate/up; inductor's `cpp.enable_concat_linear`): in bfloat16 on a CPU with bfloat16 units, where
    a one-token pass of the embedded SmolLM2 then costs 0.95x (32.6 against 34.2 ms, AMX; the
    products stay on oneDNN's packed path, four a layer where there were seven). Without bfloat16
    units the concatenated products cost 2.6x (AVX2): off, as in float32, where it was not measured
    (experiments/gpu/LOG.md, "concatenated")."""
    return (freezing and device.type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and cpu_has_bfloat16_units())


_COMPILED: dict[tuple, object] = {}


def allow_recompiles(limit: int = RECOMPILE_LIMIT) -> None:
    """Let dynamo keep at least `limit` graphs per code object (`RECOMPILE_LIMIT`); the setting was
    `cache_size_limit` before torch 2.7."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), limit))


def _compiled(fn, device: torch.device, backend: str, cuda_graphs: str = "trees", autotune: bool = False,
              freezing: bool = False, concat_linear: bool = False, cpp_wrapper: bool = False):
    """One compiled `fn` per device type, backend, CUDA-graph mode, autotuning, freezing and the
    other inductor options (dynamo
    keeps one cache per code object; graphs for the target and the draft, and for each shape, are
    entries of it, each guarded on the compiled function it came from, so an autotuned or frozen graph
    and another of the same shape do not stand in for each other). On CUDA, `trees` compiles with inductor's CUDA-graph
    trees; `explicit` without them (specdec captures its own, `specdec.accel.cuda_graphs`)."""
    key = (fn, device.type, backend, cuda_graphs, autotune, freezing, concat_linear, cpp_wrapper)
    if key not in _COMPILED:
        allow_recompiles()
        trees = device.type == "cuda" and backend == "inductor" and cuda_graphs == "trees"
        mode = {(True, False): "reduce-overhead", (True, True): "max-autotune",
                (False, True): "max-autotune-no-cudagraphs"}.get((trees, autotune and backend == "inductor"))
        if backend != "inductor":
            _COMPILED[key] = torch.compile(fn, backend=backend, mode=mode, dynamic=False)
        else:
            # The mode's options, and freezing among them: dynamo reuses a graph compiled by any backend
            # that compares equal, and inductor's compare by their options, so a frozen graph and an
            # unfrozen one of the same shape would otherwise stand in for each other. (`_compiling`
            # patches freezing as well: dynamo reads it while tracing, before the options apply.)
            from torch._inductor import list_mode_options  # not imported by `import torch` in every release

            options = (list_mode_options(mode, dynamic=False) if mode else {}) | (
                {"freezing": True} if freezing else {}) | ({"cpp.enable_concat_linear": True} if concat_linear else {}) | (
                {"cpp_wrapper": True} if cpp_wrapper else {})
            _COMPILED[key] = torch.compile(fn, backend=backend, options=options or None, dynamic=False)
    return _COMPILED[key]


QUIET_AUTOTUNE = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}


def _compiling(freezing: bool, autotune: bool, backends: str | None = None):
    """Inductor settings read while a graph compiles, patched around a call that may compile and left
    as they were for everything else in the process. `freezing`: read both while dynamo traces
    (weights become graph constants, guarded by identity) and while inductor compiles, so it is
    patched rather than passed as a compile option. `autotune`: what inductor prints for every matrix
    product it tunes (a table of timings, a JSON of the choices' stats: screenfuls for each graph of
    a real model) is not printed (`QUIET_AUTOTUNE`, as far as this torch has the settings);
    `backends`: the GEMM kernels it tunes among (`gemm_backends`), when not its default."""
    import torch._inductor.config as inductor_config

    patches = {"freezing": True} if freezing else {}
    if autotune:
        patches.update({k: v for k, v in QUIET_AUTOTUNE.items() if hasattr(inductor_config, k)})
    if autotune and backends is not None:
        patches["max_autotune_gemm_backends"] = backends
    return inductor_config.patch(patches) if patches else contextlib.nullcontext()


def _entry(fn, args: tuple) -> tuple:
    """What picks a compiled graph for `fn(*args)`, as the host knows it: the objects passed (models,
    layouts: by identity, alive as long as their caller), every tensor's shape, strides, dtype,
    device and kind, the cache view's key bucket and buffers, and the plain values. The numbers a
    model reads off the view in Python, which dynamo bakes into a graph, are in it: the key bucket
    (`get_seq_length`, `get_mask_sizes`, and 5.17's `get_query_offset` through them) and the cache's
    max length (`get_max_length`, its buffers' length less the scratch position)."""
    def part(x):
        if isinstance(x, torch.Tensor):
            return tuple(x.shape), x.stride(), x.dtype, x.device, x.is_inference()
        if isinstance(x, _BucketView):
            return x.kv_len, tuple((id(layer.keys), id(layer.values), tuple(layer.keys.shape))
                                   if layer.is_initialized else None for layer in x.cache.layers)
        if isinstance(x, dict):  # a tree pass's masks, one per kind of layer
            return tuple((k, part(v)) for k, v in x.items())
        if x is None or isinstance(x, (bool, int, float, str, torch.dtype)):
            return x
        return id(x)
    return (fn, *map(part, args))


def _unguarded(known: bool):
    """For a call whose graph this caller has run with these very inputs (`known`): dynamo's stance
    that evaluates only the guards that tell its compiled graphs apart, not all of them (thousands
    for a model: every weight, every cache tensor). Dynamo calls this unsafe because a call that
    needs a new graph would not get one; here the host has seen this entry compile or match, so it
    exists."""
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if known else contextlib.nullcontext()


def _can_skip_guards() -> bool:
    """Whether this torch has the stance (recent releases); older ones evaluate every guard."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance is not None and "skip_guard_eval_unsafe" in inspect.signature(stance).parameters


_CAN_SKIP_GUARDS = _can_skip_guards()


def _hook_guards(tracing: bool):
    """Graphs that guard on the modules' hooks. Dynamo skips guards on a module's hooks while it has
    none (`skip_nnmodule_hook_guards`). After a graph break, the model's own forward is a frame of its
    own that does not see `_forward`'s `capture`; traced for a model before a `_Capture` hooked its
    decoder, that frame's graph ran again after it, without the hook, and the pass captured nothing
    (torch 2.7, a model shared by a plain engine and then an EAGLE one). Guards are built while
    tracing, so a known call (`tracing` False), which runs a graph that exists, skips the patch."""
    return torch._dynamo.config.patch(skip_nnmodule_hook_guards=False) if tracing else contextlib.nullcontext()


def _graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _key_length(cache, end: int) -> int:
    """The keys a pass over `cache` reads when its writes end before index `end`: the next key
    bucket (at least MIN_KV), within the buffers."""
    return min(bucket(end, MIN_KV), next(layer.keys.shape[2] for layer in cache.layers if layer.is_initialized))


_INLINE = [0]  # > 0 while a caller captures a CUDA graph around compiled calls (`inline_calls`)


@contextlib.contextmanager
def inline_calls():
    """While a caller captures one CUDA graph around several compiled calls (a pipelined step,
    `specdec.accel.pipeline`): each call runs its compiled kernels as they come, without the capture and
    replay of its own that explicit graphs give it (a capture cannot hold another)."""
    _INLINE[0] += 1
    try:
        yield
    finally:
        _INLINE[0] -= 1


_GRAPH_CAPTURES = [0]  # CUDA graphs captured in this process (`count_cuda_graph_captures`)


def count_cuda_graph_captures() -> None:
    """Count every CUDA graph capture from now on (`torch.cuda.CUDAGraph.capture_begin`, through which
    inductor's CUDA-graph trees record): a graph is captured per compiled graph and input layout, and
    again when its static inputs move, so a count that grows during decoding means re-captures.
    Installed once per process; the class's own method is called unchanged."""
    graph = torch.cuda.CUDAGraph
    if getattr(graph.capture_begin, "specdec_counts", False):
        return
    original = graph.capture_begin

    def capture_begin(self, *args, **kwargs):
        _GRAPH_CAPTURES[0] += 1
        return original(self, *args, **kwargs)

    capture_begin.specdec_counts = True
    graph.capture_begin = capture_begin


def _cuda_graph_skips() -> int:
    """Compiled graphs that inductor runs without CUDA graphs (each logged with its reason: a CPU
    tensor among the inputs, an input mutated that is not static, ...): on a GPU, launch-bound."""
    return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


def _pad(x: torch.Tensor, w: int) -> torch.Tensor:
    """`x: [B, T, ...]` padded to `[B, w, ...]` with copies of its last entry along dim 1 (a new tensor
    even without padding: made under inference mode like every other input, else the graph's guards
    see two kinds of tensor (the caller's may be an ordinary one) and compile the same shape twice)."""
    return torch.cat([x, x[:, -1:].expand(x.shape[0], w - x.shape[1], *x.shape[2:])], dim=1)


def _slot_positions(lengths: list[int], w: int, context_length: int | None, device: torch.device) -> torch.Tensor:
    """`[B, w]` the positions of each row's next w cache slots (from its length in `lengths` onwards),
    clamped to the context (padding may run past it; its logits are dropped). Worked out on the host,
    which knows the lengths: one copy to the device, no kernels to launch."""
    last = context_length - 1 if context_length is not None else None
    return to_device([[n + i if last is None else min(n + i, last) for i in range(w)] for n in lengths], device)


_STEPS: dict[tuple, torch.Tensor] = {}


def _steps(w: int, device: torch.device) -> torch.Tensor:
    """`[w]` 0..w-1 on `device`, made once (an arange a pass would otherwise launch)."""
    key = (w, device, torch.is_inference_mode_enabled())
    if key not in _STEPS:
        _STEPS[key] = torch.arange(w, device=device)
    return _STEPS[key]


def _pad_positions(positions: torch.Tensor, w: int) -> torch.Tensor:
    """`positions: [B, T]` padded to `[B, w]` with the positions after each row's last one (where the
    padding's copies of the last token sit)."""
    t = positions.shape[1]
    return torch.cat([positions, positions[:, -1:] + torch.arange(1, w - t + 1, device=positions.device)], 1)


class _BucketedPasses:
    """What every compiled caller shares: the pooled cache buffers, the bucketed view of its cache,
    the compiled call (freezing and grouped attention around it) and the counters it reports.

    backend: torch.compile's backend; `inductor` (generated kernels, CUDA graphs on a GPU) is what
             `compile=on` runs. `eager` captures the same graphs at the same shapes without
             generating code: the tests use it to check the shapes and the recompilations quickly.
    cuda_graphs: on CUDA, whose CUDA graphs: `trees` (inductor's, `mode="reduce-overhead"`) or
             `explicit` (inductor's kernels captured by specdec, one graph per call shape, replayed
             without dynamo: `specdec.accel.cuda_graphs`). Elsewhere nothing is captured.
    autotune: inductor's `max_autotune` (`compile=autotune`, `autotunes`); the eager backend,
             which generates no kernels, ignores it.
    freezing: inductor's weight freezing; None: where `freezes` says (a CPU). The eager backend
             ignores it.
    concat_linear: on a CPU, let freezing concatenate the linear layers that read one input (q/k/v,
             gate/up) as it does on CUDA (inductor's `cpp.enable_concat_linear`); None: where
             `concatenates` says (bfloat16 with bfloat16 units). experiments/gpu/widths.py
             `--modes off,on,concat` measures it.
    cpp_wrapper: inductor's `cpp_wrapper`: each graph's calls of its kernels from C++ instead of
             Python. Plain decoding of the embedded SmolLM2 in bfloat16 on one CPU thread 1.065x
             (32.7 against 30.7 tok/s), its graphs compiling 1.5x as long (experiments/peers/LOG.md).
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, backend: str = "inductor",
                 cuda_graphs: str = "trees", graph_class=None, autotune: bool = False,
                 freezing: bool | None = None, concat_linear: bool | None = None, cpp_wrapper: bool = False):
        check_cuda_graphs(cuda_graphs)
        self.backend = backend
        self.device = device
        self.autotune = autotune
        self.freezing = freezes(device, backend) if freezing is None else freezing
        self.concat_linear = concatenates(device, dtype, self.freezing) if concat_linear is None else concat_linear
        self.cpp_wrapper = cpp_wrapper
        self.dtype = dtype
        self.narrowest = narrowest_width(device, dtype, autotune)  # passes of fewer tokens are padded to it
        self.cuda_graphs = cuda_graphs
        # What captures an explicit graph (`CudaGraph` on CUDA; the tests give a stand-in on a CPU),
        # and the graphs captured, by the call's `_entry`.
        if graph_class is None and cuda_graphs == "explicit" and device.type == "cuda":
            graph_class = CudaGraph
            graph_pool(device)  # made here, so that its own capture is no call's (`cuda_graph_captures`)
        self.graph_class = graph_class
        self._captured: dict[tuple, CapturedCall] = {}
        self._view: _BucketView | None = None
        self._pool: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pooled_cache = None
        self.graphs = 0
        self.compiled_calls = 0
        self.eager_calls = 0
        self.compile_s = 0.0
        self.shapes: set[tuple] = set()  # (kind, batch, width, key bucket); a CompiledCall's: its inputs' shapes
        self._entries: set[tuple] = set()  # `_entry` of every call run: their graphs exist
        self._guarded: set[tuple] = set()  # entries whose guards turned out to matter: always evaluated
        self.unguarded_calls = 0
        self.cuda_graph_captures = 0  # CUDA graphs captured by this caller's calls (on CUDA)
        self.cuda_graph_skips = 0  # graphs its calls compiled that run without CUDA graphs
        if device.type == "cuda":
            count_cuda_graph_captures()

    def options(self) -> dict:
        """How this caller compiles, for the compiled callers a proposer adds beside it."""
        return {"backend": self.backend, "cuda_graphs": self.cuda_graphs, "graph_class": self.graph_class,
                "autotune": self.autotune, "freezing": self.freezing, "concat_linear": self.concat_linear,
                "cpp_wrapper": self.cpp_wrapper}

    def report(self) -> dict:
        """Graphs compiled (recompilations included), passes run compiled / eagerly (of which
        `unguarded_calls` skipped the guards that do not tell graphs apart), seconds spent in the
        passes that compiled, the distinct (batch, width, key bucket) shapes run and, on CUDA, the
        CUDA graphs captured and the compiled graphs that run without them (0 elsewhere)."""
        return {"graphs": self.graphs, "compiled_calls": self.compiled_calls, "eager_calls": self.eager_calls,
                "unguarded_calls": self.unguarded_calls, "compile_s": round(self.compile_s, 3),
                "shapes": len(self.shapes), "cuda_graph_captures": self.cuda_graph_captures,
                "cuda_graph_skips": self.cuda_graph_skips}

    def _pool_buffers(self, cache) -> None:
        """Let the cache's layers take their buffers from the pool when they allocate: one pair per
        layer and batch size, zeroed on reuse, as long as the longest needed so far (rounded up to a
        power of two). The buffers' full shape is an input of every graph: a buffer per prompt
        length would compile every graph again for each."""
        if self._pooled_cache is cache:
            return
        self._pooled_cache = cache
        # What the cache would allocate (its `buffer_len`: positions plus scratch, rounded up to its
        # key-length multiple), rounded up to a power of two.
        length = bucket(getattr(cache, "buffer_len", cache.max_len + 1), MIN_BUFFER)
        for index, layer in enumerate(cache.layers):
            if layer.is_initialized:
                continue

            def allocate(key_states, value_states, layer=layer, index=index):
                b, h, _, d = key_states.shape
                key = (index, b, h, d, value_states.shape[-1], key_states.dtype)
                if key not in self._pool or self._pool[key][0].shape[2] < length:
                    k = torch.zeros((b, h, length, d), dtype=key_states.dtype, device=key_states.device)
                    v = torch.zeros((b, h, length, value_states.shape[-1]), dtype=value_states.dtype,
                                    device=value_states.device)
                    if k.device.type == "cuda":  # CUDA graphs record these addresses
                        torch._dynamo.mark_static_address(k)
                        torch._dynamo.mark_static_address(v)
                    self._pool[key] = (k, v)
                    self._captured.clear()  # graphs that recorded the old buffers' addresses
                layer.keys, layer.values = self._pool[key]
                layer.keys.zero_()
                layer.values.zero_()
                layer.is_initialized = True

            layer.lazy_initialization = allocate

    def width(self, t: int) -> int:
        """The width a pass of `t` tokens runs at (`width_bucket`, at least `narrowest`)."""
        return width_bucket(t, self.narrowest)

    def _compilable(self, cache, w: int) -> bool:
        """Whether a pass `w` wide over `cache` can run compiled: at most MAX_WIDTH, and the cache's
        (pooled) buffers allocated, which its first pass, the prefill, does eagerly. A layer that pass
        left unallocated is one the model never writes (Gemma-3n's layers that read another layer's
        keys and values), not a reason to run every later pass eagerly."""
        self._pool_buffers(cache)
        return w <= MAX_WIDTH and any(layer.is_initialized for layer in cache.layers)

    def _begin(self, cache, t: int, w: int, counts: list[int], kind: str = "pass",
               more: int = 0) -> tuple[torch.Tensor, _BucketView] | None:
        """Set up a pass of `t` tokens padded to `w` over `cache`: its write positions, `slots: [B, w]`
        (each row's valid length onwards), and the bucketed view (its keys cover `more` positions
        past the pass, for passes that follow it in the same call). None when it must run eagerly:
        wider than MAX_WIDTH, or the cache's buffers not yet allocated (its first pass, the prefill)."""
        if not self._compilable(cache, w):
            self.eager_calls += 1
            return None
        slots = cache.begin_write(w, counts)  # checks each row's capacity for its real tokens
        view = self._view_for(cache, len(counts), w, cache.max_row_len + w + more, kind)
        view.write_pos = cache.clamp_slots(slots)  # padding past the end goes to the scratch position
        return slots, view

    def _view_for(self, cache, b: int, w: int, end: int, kind: str) -> _BucketView:
        """The bucketed view of `cache` for a pass `w` wide over `b` rows whose writes (and the passes
        after it in the same call) end before cache index `end`: its keys cover the next key bucket."""
        view = self._view if self._view is not None and self._view.cache is cache else _BucketView(cache)
        self._view = view
        view.rows = row_index(b, w, self.device)
        view.kv_len = _key_length(cache, end)
        self.shapes.add((kind, b, w, view.kv_len))
        return view

    def _end_at(self, t: int, end: int, n: int = 0) -> int:
        """The bound past every index a pass at device lengths writes (`forward_at`: `n` = 0;
        `catch_up_chain_at`: its `n` chained passes), from the caller's bound `end` on its `t` tokens:
        the padding's slots, or the chain's, come after them."""
        return end + max(self.width(t) - t, n)

    def at_key(self, t: int, end: int, n: int = 0) -> tuple:
        """What the host decides for a pass at device lengths from its bound `end` (`forward_at`,
        `catch_up_chain_at` with `n`): the width, the key bucket, which clamps run, and the cache
        buffers read. Two calls of one key launch the same kernels over the same memory, which is what
        a caller that captures them in a graph of its own replays them under (`specdec.accel.pipeline`)."""
        cache, end = self.model.cache, self._end_at(t, end, n)
        layers = [layer for layer in cache.layers if layer.is_initialized]
        return (self.width(t), _key_length(cache, end) if layers else None, *self._clamps(end),
                tuple(id(layer.keys) for layer in layers))

    def _clamps(self, end: int) -> tuple[bool, bool]:
        """Whether a pass at device lengths bounded by `end` clamps its positions to the context and
        its write slots to the buffer (`_device_slots`): only where the bound says it may bite."""
        return self.model.context_length is not None and end > self.model.context_length, \
            end > self.model.cache.max_len + 1

    def _device_slots(self, start: torch.Tensor, w: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For a pass whose rows' lengths only the device knows: `start: [B]` each row's first cache
        index, `end` a bound (on the host) past the last index a row may write. Returns `[B, w]` the
        positions (clamped to the context, padding may run past it) and the write slots (past the
        buffer's end: the scratch position); a clamp runs only where the bound says it may bite."""
        slots = start[:, None] + _steps(w, start.device)
        clamp_positions, clamp_slots = self._clamps(end)
        positions = slots.clamp(max=self.model.context_length - 1) if clamp_positions else slots
        return positions, slots.clamp(max=self.model.cache.max_len) if clamp_slots else slots

    def _run(self, fn, model: torch.nn.Module, *args, rows: int | None = None):
        """`fn(*args)` compiled; `model` is the transformers model whose config names the attention;
        `rows`: the most rows (batch x width) its matrix products take, where known (`gemm_backends`).
        With explicit CUDA graphs, a call of a shape captured before is a replay of its graph."""
        before, start = _graphs_compiled(), time.perf_counter()
        captures, skips = _GRAPH_CAPTURES[0], _cuda_graph_skips()
        if self.device.type == "cuda" and self.graph_class is None:
            torch.compiler.cudagraph_mark_step_begin()
        entry = _entry(fn, args)
        known = SKIP_KNOWN_GUARDS and entry in self._entries and entry not in self._guarded and _CAN_SKIP_GUARDS
        compiled = _compiled(fn, self.device, self.backend, self.cuda_graphs, self.autotune, self.freezing,
                             self.concat_linear, self.cpp_wrapper)

        def call(*args):
            # Settings read only while compiling: a known entry, which runs a graph that exists, skips the
            # patch. `known` is read here, at the call, since a refused known call runs again unknown (below).
            backends = None if known else gemm_backends(self.device, self.dtype, self.autotune, rows)
            compiling = _compiling(self.freezing and self.backend == "inductor" and not known,
                                   self.autotune and not known, backends)
            with _unguarded(known), _hook_guards(not known), compiling, grouped_attention(model):
                return compiled(*args)

        # A call without a cache view (a `CompiledCall`'s) runs compiled but uncaptured, whatever the mode.
        view = None if self.graph_class is None else next((a for a in args if isinstance(a, _BucketView)), None)

        def dispatch():
            if view is None or _INLINE[0]:
                return call(*args)
            extra = {"rows": view.rows, "write_pos": view.write_pos}  # read from the view, set per pass
            if entry not in self._captured:
                self._captured[entry] = CapturedCall(call, args, extra, view, self.graph_class(self.device))
            return self._captured[entry](args, extra)

        try:
            out = dispatch()
        except RuntimeError as err:
            if not (known and "skip_guard_eval_unsafe" in str(err)):
                raise
            # Dynamo found that the entry's graph does not fit after all: something the host does not
            # see changed (a Python value the traced code reads, such as a timer wrapped around a
            # forward). Nothing ran; this entry's guards are evaluated from now on, so it recompiles.
            self._guarded.add(entry)
            known = False
            out = dispatch()
        self._entries.add(entry)
        self.unguarded_calls += known
        self.cuda_graph_captures += _GRAPH_CAPTURES[0] - captures
        self.cuda_graph_skips += _cuda_graph_skips() - skips
        compiled_now = _graphs_compiled() - before
        if compiled_now:
            self.graphs += compiled_now
            self.compile_s += time.perf_counter() - start
        self.compiled_calls += 1
        return out


class CompiledForward(_BucketedPasses):
    """The compiled path of one `CachedModel` (`engine.py` calls `forward` first and runs its eager
    path when it returns None)."""

    def __init__(self, model, backend: str = "inductor", cuda_graphs: str = "trees", graph_class=None,
                 autotune: bool = False, freezing: bool | None = None, concat_linear: bool | None = None,
                 cpp_wrapper: bool = False):
        super().__init__(model.device, model.dtype, backend, cuda_graphs, graph_class, autotune, freezing,
                         concat_linear, cpp_wrapper)
        self.model = model

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, advance: list[int] | None = None, keep: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, block_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """`CachedModel.forward`'s contract, compiled; None when this pass runs eagerly instead (a
        model that keeps several layers' hidden states, EAGLE-3's taps, always does)."""
        owner, cache = self.model, self.model.cache
        if getattr(owner, "_hidden_layers", None) is not None:
            self.eager_calls += 1
            return None
        b, t = tokens.shape
        w = self.width(t)  # a token tree's too: trees of other sizes share their bucket's graph
        counts = list(advance) if advance is not None else [t] * b
        begun = self._begin(cache, t, w, counts)
        if begun is None:
            return None
        slots, view = begun
        # Padding: copies of the last token, at the positions after it.
        tokens = _pad(tokens, w)
        if positions is None:
            positions = _slot_positions(cache.lengths, w, owner.context_length, self.device)
        else:  # padding may run past the context: its positions are clamped, its logits dropped
            positions = _pad_positions(positions, w)
            if owner.context_length is not None:
                positions = positions.clamp(max=owner.context_length - 1)
        mask = None if block_mask is None else self._tree_mask(block_mask, positions, view)
        source = getattr(owner, "_hidden_source", None)
        capture = _capture(source) if source is not None else None
        if capture is not None:
            capture.active = True
        try:
            out = self._run(_forward, owner.model, owner.model, owner.layout, view, tokens, positions, owner.dtype,
                            mask, capture, rows=b * w)
        finally:
            if capture is not None:
                capture.active = False
        logits = out
        if capture is not None:  # every written position's, padding to scratch, as the keys were written
            logits, hidden = out
            cache.store_hidden(hidden)
        cache.advance(counts)
        logits = logits[:, :t]
        if self.device.type == "cuda":  # a CUDA graph's output is overwritten by its next replay
            logits = logits.clone()
        return logits[:, keep] if keep is not None else logits

    @torch.inference_mode()
    def chain(self, first: torch.Tensor, n: int) -> torch.Tensor | None:
        """n greedy single-token passes in one compiled call (`_chain`), the first feeding `first: [B]`,
        each next one the argmax of the last: a draft's chain of k - 1 passes costs one call's host
        time and, on a GPU, one CUDA-graph replay instead of n. Returns the n tokens drafted `[B, n]`,
        or None when it must run pass by pass (a model whose hidden states a drafter keeps, n past
        MAX_WIDTH, the cache not yet allocated). One graph per (batch, n, key bucket)."""
        owner, cache = self.model, self.model.cache
        b = first.shape[0]
        if getattr(owner, "_hidden_source", None) is not None or n > MAX_WIDTH:
            return None
        begun = self._begin(cache, n, n, [n] * b, kind="chain")
        if begun is None:
            return None
        _, view = begun
        view.rows = row_index(b, 1, self.device)  # each pass of the chain writes one slot per row
        positions = _slot_positions(cache.lengths, n, owner.context_length, self.device)
        drafted = self._run(_chain, owner.model, owner.model, owner.layout, view, first[:, None], positions,
                            view.write_pos, owner.dtype, rows=b)
        cache.advance([n] * b)
        return drafted.clone() if self.device.type == "cuda" else drafted

    @torch.inference_mode()
    def catch_up_chain(self, chunk: torch.Tensor, counts: list[int], n: int) -> torch.Tensor | None:
        """A greedy draft's step in one compiled call: the catch-up pass over `chunk: [B, T]` (row b's
        first `counts[b]` tokens are real), the greedy token after each row's last one, then `chain`'s
        n passes from it. Returns the n + 1 drafts `[B, n + 1]`, or None (nothing run) when the catch-up
        must run eagerly (the prefill, wider than MAX_WIDTH), the chain pass by pass, or a row lacks room
        for it. One graph per (batch, catch-up width, n, key bucket)."""
        owner, cache = self.model, self.model.cache
        b, t = chunk.shape
        w = self.width(t)
        after = [length + c for length, c in zip(cache.lengths, counts)]
        if (getattr(owner, "_hidden_source", None) is not None or n > MAX_WIDTH or max(after) + n > cache.max_len
                or not self._compilable(cache, w)):
            return None
        slots, view = self._begin(cache, t, w, counts, kind=f"catch-up and chain of {n}", more=n)
        positions = _slot_positions(cache.lengths, w, owner.context_length, self.device)
        chain_slots = to_device([[a + j for j in range(n)] for a in after], self.device)  # room checked above
        drafted = self._run(_catch_up_chain, owner.model, owner.model, owner.layout, view, _pad(chunk, w), positions,
                            to_device([c - 1 for c in counts], self.device), row_index(b, 1, self.device),
                            _slot_positions(after, n, owner.context_length, self.device), chain_slots, owner.dtype,
                            rows=b * w)
        cache.advance(counts)
        cache.advance([n] * b)
        return drafted.clone() if self.device.type == "cuda" else drafted

    @torch.inference_mode()
    def forward_at(self, tokens: torch.Tensor, start: torch.Tensor, end: int) -> torch.Tensor | None:
        """A pass at lengths only the device knows (pipelined steps, `specdec.accel.pipeline`): row b's
        `tokens: [B, T]` go to cache indices, and positions, start[b] onwards (`start: [B]` on the
        device); `end` bounds every start[b] + T on the host and sets the key bucket. The cache's
        host lengths are neither read nor moved: the caller settles them when it has read the
        outcome (`rollback`). Returns logits `[B, T, V]`, or None where the pass cannot run compiled."""
        owner, cache = self.model, self.model.cache
        b, t = tokens.shape
        w = self.width(t)
        if getattr(owner, "_hidden_source", None) is not None or not self._compilable(cache, w):
            self.eager_calls += 1
            return None
        end = self._end_at(t, end)
        view = self._view_for(cache, b, w, end, "pass at device lengths")
        positions, view.write_pos = self._device_slots(start, w, end)
        logits = self._run(_forward, owner.model, owner.model, owner.layout, view, _pad(tokens, w), positions,
                           owner.dtype, rows=b * w)[:, :t]
        return logits.clone() if self.device.type == "cuda" else logits

    @torch.inference_mode()
    def catch_up_chain_at(self, chunk: torch.Tensor, start: torch.Tensor, counts: torch.Tensor, n: int,
                          end: int) -> torch.Tensor | None:
        """`catch_up_chain` at lengths only the device knows: row b's first `counts[b]` tokens of
        `chunk: [B, T]` are real and go to cache index start[b] onwards (`start, counts: [B]` on the
        device), the n chained passes after them; `end` bounds start[b] + T on the host. The host
        lengths are not moved (`forward_at`). Returns the n + 1 drafts `[B, n + 1]`, or None where
        the call cannot run compiled."""
        owner, cache = self.model, self.model.cache
        b, t = chunk.shape
        w = self.width(t)
        if getattr(owner, "_hidden_source", None) is not None or not 0 < n <= MAX_WIDTH \
                or not self._compilable(cache, w):
            self.eager_calls += 1
            return None
        end = self._end_at(t, end, n)
        view = self._view_for(cache, b, w, end, f"catch-up and chain of {n} at device lengths")
        positions, view.write_pos = self._device_slots(start, w, end)
        chain_positions, chain_slots = self._device_slots(start + counts, n, end)
        drafted = self._run(_catch_up_chain, owner.model, owner.model, owner.layout, view, _pad(chunk, w), positions,
                            counts - 1, row_index(b, 1, self.device), chain_positions, chain_slots, owner.dtype,
                            rows=b * w)
        return drafted.clone() if self.device.type == "cuda" else drafted

    def _tree_mask(self, block_mask: torch.Tensor, positions: torch.Tensor, view: _BucketView):
        """The additive masks `[B, 1, W, kv_len]` of a tree pass padded to W slots: the key-bucket mask
        from the nodes' `positions: [B, W]`, with the block's columns (`view.write_pos`) replaced by
        `block_mask: [B, T, T]` (the eager path's overlay); padding slots see only themselves (and
        what their positions let them see before the block), and no real node sees them."""
        owner = self.model
        b, t, _ = block_mask.shape
        w = positions.shape[1]
        block = torch.eye(w, dtype=torch.bool, device=block_mask.device).repeat(b, 1, 1)
        block[:, :t, :t] = block_mask
        mask = owner.layout.masks(positions, view.kv_len, owner.dtype)
        owner._overlay_block(mask, view.write_pos, positions, block)
        return mask


def _call(module: torch.nn.Module, *args):
    """The compiled region of a module that is not a transformers model (a drafter)."""
    return module(*args)


class _ModulePasses(_BucketedPasses):
    """Compiled calls of a module that is not a transformers model, on its parameters' device and
    dtype; `model`: the transformers model whose attention implementation its layers share."""

    def __init__(self, module: torch.nn.Module, model: torch.nn.Module, backend: str = "inductor",
                 cuda_graphs: str = "trees", graph_class=None, autotune: bool = False,
                 freezing: bool | None = None, concat_linear: bool | None = None, cpp_wrapper: bool = False):
        first = next(module.parameters())
        super().__init__(first.device, first.dtype, backend, cuda_graphs, graph_class, autotune, freezing,
                         concat_linear, cpp_wrapper)
        self.module, self.model = module, model


class CompiledModule(_ModulePasses):
    """A drafter's passes over its own `RowCache`, compiled at the same buckets as a model's (width,
    key length, pooled buffers): `module(inputs..., positions, mask, cache)` for a module whose
    tokens come as `[B, T, ...]` tensors and whose attention reads the mask it is given. `model` is
    the transformers model whose attention implementation the module's layers share (EAGLE's drafter
    layer is built from the target's config)."""

    @torch.inference_mode()
    def forward(self, cache, inputs: tuple[torch.Tensor, ...], positions: torch.Tensor, counts: list[int],
                masks) -> torch.Tensor | None:
        """Run `module(*inputs, positions, mask, view)` for `inputs: [B, T, ...]` and `positions: [B, T]`,
        padded to a width bucket; `masks(slots, positions, kv_len)` builds the additive mask
        `[B, 1, W, kv_len]` for the W queries at cache indices `slots: [B, W]` and `positions: [B, W]`,
        of which the first T are real. Returns the module's output for the T real tokens
        (`[B, T, ...]`), or None when this pass must run eagerly."""
        b, t = positions.shape
        w = self.width(t)
        begun = self._begin(cache, t, w, counts)
        if begun is None:
            return None
        slots, view = begun
        positions = _pad_positions(positions, w)
        inputs = tuple(_pad(x, w) for x in inputs)
        out = self._run(_call, self.model, self.module, *inputs, positions, masks(slots, positions, view.kv_len), view,
                        rows=b * w)
        cache.advance(counts)
        out = out[:, :t]
        return out.clone() if self.device.type == "cuda" else out


class CompiledCall(_ModulePasses):
    """A module without a cache, compiled whole at the shapes it is called with: `module(*inputs)`,
    one graph per distinct set of input shapes and plain values (a proposer calls it with a few).
    Its weights are frozen on a CPU like a model's: Medusa's heads end in the target's full output
    head (49,152 x 576 for SmolLM2), whose matmul for a few rows costs far less with the weight
    packed once (experiments/gpu/LOG.md, "Output heads"). Under
    `cuda_graphs="explicit"` its kernels run compiled but uncaptured (no cache view to capture
    over); under `trees`, inductor captures them as any compiled call."""

    @torch.inference_mode()
    def forward(self, *inputs):
        """`module(*inputs)` compiled (tensors and plain values; every tensor's shape picks a graph)."""
        batch = next(x.shape[0] for x in inputs if isinstance(x, torch.Tensor))
        self.shapes.add(("call", batch, *(tuple(x.shape[1:]) if isinstance(x, torch.Tensor) else x for x in inputs)))
        out = self._run(_call, self.model, self.module, *inputs)
        return out.clone() if self.device.type == "cuda" else out
