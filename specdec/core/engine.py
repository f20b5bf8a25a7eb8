"""One device and dtype for target and draft; forward passes with explicit positions and masks.

`CachedModel` pairs a Hugging Face causal LM with its own `RowCache`. Every forward pass names the
position of each token; a batch whose rows hold different numbers of tokens (ragged prompts,
different acceptance) also gets 4-D attention masks built from the per-row valid lengths, one per
kind of attention layer (full, sliding window), so it gives the same logits as each row run alone.
The layout check, the masks and the call into transformers live in `attention.py`. `Engine` holds
the target and the optional draft and makes sure they share a device and dtype.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from contextlib import contextmanager

import torch

from specdec.core.attention import SLIDING, AttentionLayout, grouped_attention
from specdec.core.cache import RowCache
from specdec.core.decoder_stack import decoder_stack, hidden_source
from specdec.core.device import to_device
from specdec.core.types import CompiledPasses, Passes


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device} requested but CUDA is not available; use device=cpu or auto")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:  # torch's message lists every backend it knows
        raise ValueError(f"device={device!r} is not a device torch knows; use auto, cpu, cuda or cuda:N") from err


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}
DTYPE_NAMES = tuple(_DTYPES)  # what `dtype=` takes besides auto


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on a GPU, and on a CPU with native bfloat16 matrix units (AVX512-BF16 or
    AMX); float32 otherwise. With those units bfloat16 is faster and scoring several tokens costs
    little more than one, which is what speculation needs (experiments/benchmarks/LOG.md, "Where the
    time of a step goes"); without them bfloat16 is emulated and its cost grows with the tokens
    scored (experiments/gpu/LOG.md, "Widths")."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_bfloat16_units() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of: auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def cpu_has_bfloat16_units() -> bool:
    """Whether this CPU runs bfloat16 matrix products natively (AVX512-BF16 or AMX), as oneDNN
    reports it; elsewhere (AVX2) bfloat16 is emulated. `dtype=auto`, the compiled passes' widths and
    concatenation, and bfloat16 packed linear layers ask it."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that a clock read after it measures the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Accumulates the wall time of a phase (drafting, verifying) over a generation.

    On a GPU the phase boundaries are CUDA events on the stream, not host clock reads after a
    synchronisation: the host goes on queueing the next phase while the device still runs this
    one, and `total` waits only for the events it reads (by then the step's own read of its
    outcome has usually waited for them). An event's time is when the device reached it, so a
    phase that the host's launches hold up still counts as long as it took."""

    def __init__(self, device: torch.device):
        self.device = device
        self._total = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __enter__(self):
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(torch.cuda.current_stream(self.device))
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            self._events.append((self._start, end))
        else:
            self._total += time.perf_counter() - self._t0

    @property
    def total(self) -> float:
        """Seconds spent in the phase so far."""
        for start, end in self._events:
            end.synchronize()
            self._total += start.elapsed_time(end) / 1000
        self._events.clear()
        return self._total


def overlay_columns(layout: AttentionLayout, masks, columns: torch.Tensor, visible: torch.Tensor,
                    query_positions: torch.Tensor, column_positions: torch.Tensor) -> None:
    """Set, in place, which of the cache indices `columns: [B, W]` each query sees: `visible: [B, T, W]`
    (restricted to the window on sliding-window layers). `masks` are the layout's additive masks
    `[B, 1, T, kv_len]` (one tensor, or a dict by layer type); positions `[B, T]` and `[B, W]`."""
    by_kind = masks if isinstance(masks, dict) else {layout.layer_types[0]: masks}
    b, t, w = visible.shape
    index = columns[:, None, :].expand(b, t, w)
    for kind, mask in by_kind.items():
        seen = visible
        if kind == SLIDING:
            seen = seen & (query_positions[:, :, None] - column_positions[:, None, :] < layout.sliding_window)
        block = torch.zeros(seen.shape, dtype=mask.dtype, device=mask.device)
        mask[:, 0].scatter_(2, index, block.masked_fill_(~seen, torch.finfo(mask.dtype).min))


class CachedModel:
    """A causal LM plus its KV cache. Call `reset` before a new batch.

    Raises `UnsupportedModelError` (a ValueError naming the model type) for an attention layout it
    cannot run exactly, before any work is done.
    """

    def __init__(self, model: torch.nn.Module, name: str = "model"):
        self.model = model
        self.name = name
        self.layout = AttentionLayout.of(model)
        self._hidden_source: torch.nn.Module | None = None  # set by keep_hidden_states
        self._hidden_layers: list[int] | None = None  # the taps, where keep_hidden_states names layers
        self.cache: RowCache | None = None
        self.compiled: CompiledPasses | None = None  # set by the engine's passes where they compile
        cfg = model.config.get_text_config(decoder=True)  # a multimodal wrapper's language model
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = model.get_output_embeddings().out_features
        self.context_length: int | None = getattr(cfg, "max_position_embeddings", None)

    @property
    def device(self) -> torch.device:
        return self._parameter().device

    @property
    def dtype(self) -> torch.dtype:
        return self._parameter().dtype

    def _parameter(self) -> torch.nn.Parameter:
        """The model's first parameter, found once (asked for on every pass: walking the module tree
        each time costs microseconds a pass); a conversion (`.to()`) changes it in place, so its
        device and dtype stay current."""
        if getattr(self, "_first", None) is None:
            self._first = next(self.model.parameters())
        return self._first

    @property
    def lengths(self) -> list[int]:
        return self.cache.lengths

    def reset(self, batch_size: int, max_len: int) -> None:
        """A fresh cache for `batch_size` rows of up to `max_len` positions (allocated on first write)."""
        if self.context_length is not None and max_len > self.context_length:
            raise ValueError(
                f"{self.name}: {max_len} positions requested but the model's context is "
                f"{self.context_length}; shorten the prompt or lower max_new_tokens."
            )
        self.cache = RowCache(self.num_layers, batch_size, max_len, self.device)

    def rollback(self, lengths: list[int]) -> None:
        self.cache.rollback(lengths)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, advance: list[int] | None = None,
                keep: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                block_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Feed `tokens: [B, T]` after each row's valid length; return logits `[B, T or len(keep), V]`.

        advance:    how many of the T tokens become valid per row (default all T). Positions written
                    beyond that are scratch: masked from now on and overwritten by the next write.
        keep:       optional 1-D indices of the T positions whose logits are needed (saves the
                    [B, T, V] head output on long prefills).
        positions:  optional `[B, T]` position ids (default: each row's valid length + 0..T-1); a tree
                    block gives each node its root's position plus its depth.
        block_mask: optional `[B, T, T]` bool, which tokens of this block each token sees (default
                    causal); every token also sees its row's valid entries before the block.
        """
        if self.compiled is not None:  # static shapes through torch.compile; None: this pass runs eagerly
            logits = self.compiled.forward(tokens, advance, keep, positions, block_mask)
            if logits is not None:
                return logits
        b, t = tokens.shape
        cache = self.cache
        slots = cache.begin_write(t, advance)
        positions = slots if positions is None else positions
        # Rows at equal lengths need no custom mask: the model builds its usual causal (and sliding
        # window) masks from the positions and the cache's sizes, and SDPA takes the same kernels as
        # in plain `generate`. Ragged rows get explicit per-row masks, one per layer type, and so
        # does a block with its own visibility (a token tree), and so does a view that runs past the
        # block's end (`fixed_kv_len`): transformers assumes, as in `generate`, that the view ends
        # with the block, and for one query it skips the mask, which would attend to unwritten keys.
        uniform = (cache.uniform_start is not None and block_mask is None
                   and cache.kv_len == cache.uniform_start + t)
        mask = None if uniform else self.layout.masks(positions, cache.kv_len, self.dtype)
        if block_mask is not None:
            self._overlay_block(mask, slots, positions, block_mask)
        logits = self._call(tokens, positions, mask, keep)
        cache.advance(advance if advance is not None else [t] * b)
        return logits

    def _overlay_block(self, masks, slots: torch.Tensor, positions: torch.Tensor, block_mask: torch.Tensor) -> None:
        """For a block with its own visibility (a token tree): the layout's masks, built from the true
        positions, are right for the entries before the block (there a cache index is the position);
        the block's own columns, `slots: [B, T]`, are replaced by `block_mask: [B, T, T]`."""
        overlay_columns(self.layout, masks, slots, block_mask, positions, positions)

    def hidden_source(self) -> torch.nn.Module:
        """The decoder whose output is the output head's input (`hidden_source`), which drafters of
        hidden states read; they ask first, before they load a checkpoint, so that the refusal names
        the model, not the checkpoint."""
        return hidden_source(self.model, self.name)

    def keep_hidden_states(self, layers: list[int] | None = None) -> None:
        """From now on every pass also stores hidden states in the cache, beside the keys and values
        (at every position fed, whatever `keep` says): drafters that read the target's features get
        them from the scoring pass itself, with no second pass. Each drafter reads its own with
        `hidden_at(layers, ...)`.

        layers: None keeps the model's last hidden states (the output head's input), `[B, T, H]`.
        A list keeps, per pass, the concatenation in ascending order of the residual stream entering
        decoder layer i for each i (transformers' `output_hidden_states[i]`; i == N, the number of
        layers, is the final normed output, the same tensor as None's), `[B, T, n * H]`: EAGLE-3's
        taps. Under `compile=on`, the passes of a model that keeps several taps run eagerly (the
        compiled forward declines them).

        Drafters on one engine that ask for different kinds (EAGLE's last hidden states beside
        EAGLE-3's taps) share it: the engine keeps the union of their taps, and each reads its own
        columns. Ask before a generation starts: the cache's store is sized at a generation's first pass."""
        layers = None if layers is None else [int(i) for i in layers]
        if layers is not None:
            if not layers or layers != sorted(set(layers)) or layers[0] < 0 or layers[-1] > self.num_layers:
                raise ValueError(f"{self.name}: the hidden-state taps {layers} must be distinct ascending layer "
                                 f"indices in [0, {self.num_layers}] (the model has {self.num_layers} layers)")
        source = self.hidden_source()
        if layers is not None and layers != [self.num_layers] and decoder_stack(source) is None:
            raise ValueError(f"{self.name}: {type(self.model).__name__}'s decoder has no list of layers to "
                             "tap; drafters that read several layers (EAGLE-3) cannot use it")
        kept = self._kept_taps() if self._hidden_source is not None else []
        union = sorted(set(kept) | set(self._taps(layers)))
        self._hidden_source = source
        # The last hidden states alone keep None: the decoder's output, through one hook (and the compiled path's).
        self._hidden_layers = None if union == [self.num_layers] else union

    def _taps(self, layers: list[int] | None) -> list[int]:
        """`layers` as taps: None, the last hidden states, is tap N."""
        return [self.num_layers] if layers is None else layers

    def _kept_taps(self) -> list[int]:
        return self._taps(self._hidden_layers)

    def hidden_at(self, layers: list[int] | None, *index) -> torch.Tensor:
        """The hidden states that `keep_hidden_states(layers)` asked for, at `cache.hidden[index]`
        (e.g. `rows[:, None], positions`): `[..., n * H]`, the columns of those taps in what the
        engine keeps for every drafter on it."""
        states = self.cache.hidden[index]
        kept, asked = self._kept_taps(), self._taps(layers)
        if asked == kept:
            return states
        try:
            blocks = [kept.index(i) for i in asked]
        except ValueError:
            raise ValueError(f"{self.name}: the taps {asked} were never asked for (keep_hidden_states); "
                             f"it keeps {kept}") from None
        width = states.shape[-1] // len(kept)
        if blocks == list(range(blocks[0], blocks[0] + len(blocks))):  # one run of columns: a view
            return states[..., blocks[0] * width:(blocks[-1] + 1) * width]
        return states.unflatten(-1, (len(kept), width))[..., blocks, :].flatten(-2)

    def _tap_hooks(self, taps: dict[int, torch.Tensor]) -> list:
        """Hooks that put, for each kept layer i, the residual stream entering layer i (or the
        decoder's output, for i == N) into `taps[i]` during one call."""
        layers = decoder_stack(self._hidden_source)[1]

        def entering(i: int):
            def hook(module, args, kwargs):
                taps[i] = args[0] if args else kwargs["hidden_states"]
            return hook

        hooks = [layers[i].register_forward_pre_hook(entering(i), with_kwargs=True)
                 for i in self._hidden_layers if i < self.num_layers]
        if self._hidden_layers[-1] == self.num_layers:
            hooks.append(self._hidden_source.register_forward_hook(
                lambda module, args, out: taps.__setitem__(self.num_layers, out[0])))
        return hooks

    def _call(self, tokens, positions, mask, keep) -> torch.Tensor:
        """The model call; with `keep_hidden_states`, hooks (on the decoder, or on the kept layers)
        store the hidden states for the duration of this call only (the model object may be shared
        with other callers)."""
        with grouped_attention(self.model):
            if self._hidden_source is None:
                return self.layout.call(self.model, tokens, positions, self.cache, mask, keep)
            if self._hidden_layers is None:
                hooks = [self._hidden_source.register_forward_hook(
                    lambda module, args, out: self.cache.store_hidden(out[0]))]
            else:
                taps: dict[int, torch.Tensor] = {}
                hooks = self._tap_hooks(taps)
            try:
                logits = self.layout.call(self.model, tokens, positions, self.cache, mask, keep)
            finally:
                for hook in hooks:
                    hook.remove()
            if self._hidden_layers is not None:
                self.cache.store_hidden(torch.cat([taps[i] for i in self._hidden_layers], dim=-1))
            return logits

    @torch.inference_mode()
    def keep_path(self, roots: list[int], path: list[list[int]]) -> None:
        """After a tree pass whose root sat at cache index `roots[b]` (node i at roots[b] + 1 + i),
        keep each row's entries up to its root and then its accepted path, in order, and nothing
        else. path: per row, node indices from depth 1 down, -1 after the path (on the host: read
        with the verification)."""
        self.cache.compact([r + 1 for r in roots], [[r + 1 + i for i in p if i >= 0] for r, p in zip(roots, path)])

    def _unseen(self, tokens: torch.Tensor, upto: list[int]) -> tuple[list[int], torch.Tensor]:
        """Per row, how many tokens it has not fed (`upto[b]` less its cache length), and those tokens,
        `[B, max count]` (a shorter row's padded with the tokens after it, to be dropped)."""
        counts = [u - n for u, n in zip(upto, self.cache.lengths)]
        if min(counts) < 1:
            raise ValueError(f"{self.name}: catch_up needs at least one new token per row, got {counts}")
        t = max(counts)
        end = tokens.shape[1] - 1
        idx = to_device([[min(n + i, end) for i in range(t)] for n in self.cache.lengths], tokens.device)
        return counts, tokens.gather(1, idx)

    def catch_up_chain(self, tokens: torch.Tensor, upto: list[int], n: int) -> torch.Tensor | None:
        """`catch_up` and n greedy single-token passes after it, in one compiled call (compile=on):
        `[B, n + 1]`, the greedy token after each row's last fed token and the n drafted after it. None,
        having fed nothing, where that cannot run compiled (eagerly, or the prefill: the caller runs
        `catch_up` and the passes itself)."""
        if self.compiled is None:
            return None
        counts, chunk = self._unseen(tokens, upto)
        return self.compiled.catch_up_chain(chunk, counts, n)

    def catch_up(self, tokens: torch.Tensor, upto: list[int]) -> torch.Tensor:
        """Feed each row's tokens it has not seen, `tokens[b, len_b : upto[b]]`, in one ragged pass.

        tokens: [B, L] the decoding buffer. Returns the logits after each row's last fed token, [B, V].
        This is prefill (from an empty cache), multi-turn continuation, and a draft's catch-up.
        """
        counts, chunk = self._unseen(tokens, upto)
        # The positions whose logits are wanted, and where each row's lands among them, worked out
        # on the host from the counts it already has (on the device it would be a synchronisation).
        keep = sorted({c - 1 for c in counts})
        logits = self.forward(chunk, advance=counts, keep=to_device(keep, tokens.device))
        if len(keep) == 1:  # every row fed as many tokens (batch 1 always)
            return logits[:, 0]
        pick = to_device([keep.index(c - 1) for c in counts], tokens.device)
        return logits[torch.arange(len(counts), device=tokens.device), pick]

    def cache_bytes(self) -> int:
        return self.cache.nbytes() if self.cache is not None else 0


class EngineBusyError(RuntimeError):
    """A second generation was started on an Engine that is decoding."""


# The live Engines holding each model object: `nn.Module.to` converts in place, so an Engine in
# another device or dtype would silently change the numbers of every engine already running it.
_HOLDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class Engine:
    """Target and optional draft on one device with one dtype (moved there on construction).

    Engines may share model objects only in the same device and dtype: building one that would
    convert a model another live Engine runs is refused. One Engine decodes one batch at a time,
    because its caches hold that batch: `exclusive()` refuses a second concurrent generation
    (another thread, or generate() called from a streaming callback) instead of letting both write
    the same caches.

    passes: None runs every pass eagerly, the reference the rest accelerates; a `Passes` object
    (`specdec.accel.Accelerated(compile=..., cuda_graphs=..., packed_linear=...)`) runs the same passes
    compiled, captured or packed, and may pipeline a draft model's steps. Greedy outputs are the
    same either way in float32.
    """

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module | None = None,
                 device: str | torch.device = "cpu", dtype: str | torch.dtype = "auto",
                 passes: Passes | None = None):
        self.device = device if isinstance(device, torch.device) else resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if passes is not None and not all(callable(getattr(passes, f, None)) for f in Passes.METHODS):
            raise TypeError(f"passes= takes None (eager) or a Passes object such as specdec.accel.Accelerated(), "
                            f"got {passes!r}")
        self.passes = passes
        if passes is not None:
            passes.settle(self.device, self.dtype)  # refuses what cannot apply before any model moves
        models = [(m, role) for m, role in ((target, "target"), (draft, "draft")) if m is not None]
        for model, role in models:
            self._refuse_converting(model, role)
        self.target = CachedModel(target.to(self.device, self.dtype).eval(), "target")
        self.draft = CachedModel(draft.to(self.device, self.dtype).eval(), "draft") if draft is not None else None
        if self.draft is not None and self.draft.vocab_size != self.target.vocab_size:
            raise ValueError(
                f"draft vocabulary ({self.draft.vocab_size} logits) does not match the target's "
                f"({self.target.vocab_size}); speculative decoding needs a draft with the target's tokenizer."
            )
        for model, _ in models:
            _HOLDERS.setdefault(model, weakref.WeakSet()).add(self)
        if passes is not None:
            passes.attach(self)
        # Other compiled passes that run in this engine's generations (a proposer's own drafter), by name.
        self.compiled_modules: dict[str, object] = {}
        # Models of a proposer's own that run in this engine's generations (`add_model`); weak, so a
        # dropped proposer's model goes with it.
        self._proposer_models: weakref.WeakSet[CachedModel] = weakref.WeakSet()
        # Cache-free modules of a proposer's own (an EAGLE drafter, Medusa's heads: `add_module`); weak too.
        self._proposer_modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._busy = threading.Lock()

    def add_model(self, model: CachedModel) -> None:
        """A model a proposer runs in this engine's generations beside target and draft (layer
        skipping's view of the target's first layers): held like them for each generation (its
        attention implementation swapped once, not around every pass)."""
        self._proposer_models.add(model)

    def add_module(self, module: torch.nn.Module) -> None:
        """A module of a proposer's own that runs in this engine's generations outside any `CachedModel`
        (an EAGLE drafter, Medusa's heads; `compiled` adds those it is given): held by the passes for
        each generation as the models are (where passes run eagerly on a CPU, its linear layers packed,
        which its small products need as much as the target's do: experiments/drafters/LOG.md, section 6)."""
        self._proposer_modules.add(module)

    @property
    def compile(self) -> bool:
        """Whether the target's passes compile (the passes object gave it compiled passes)."""
        return self.target.compiled is not None

    def compiled(self, name: str, what, kind: str):
        """`what` compiled as the target's passes are, or None where they run eagerly (then run `what`
        as it is): the hook through which a proposer's own modules follow the engine. kind `model` (a
        `CachedModel`, held through `add_model`), `module` (a drafter over its own RowCache) or `call` (a
        cache-free module); the last two are held for each generation here (`add_module`), compiled or not."""
        if kind != "model":
            self.add_module(what)
        if self.passes is None or self.target.compiled is None:
            return None
        compiled = self.passes.compiled(what, kind, self.target)
        self.compiled_modules[name] = compiled
        return compiled

    def compile_report(self) -> dict | None:
        """Per model (and per proposer module compiled with them): graphs compiled so far, passes run
        compiled and eagerly (`compile=on`); else None."""
        if not self.compile:
            return None
        report = {m.name: m.compiled.report() for m in (self.target, self.draft) if m is not None}
        return report | {name: c.report() for name, c in self.compiled_modules.items()}

    def _refuse_converting(self, model: torch.nn.Module, role: str) -> None:
        for other in list(_HOLDERS.get(model, ())):
            if other.dtype != self.dtype or not _same_device(other.device, self.device):
                raise ValueError(
                    f"the {role} model is in use by another Engine ({str(other.dtype).removeprefix('torch.')} "
                    f"on {other.device}); an Engine in {str(self.dtype).removeprefix('torch.')} on {self.device} "
                    "would convert it in place (nn.Module.to) under that engine. Use the same device and "
                    "dtype, give this Engine a copy (copy.deepcopy(model)), or drop the other Engine first."
                )

    def check_models(self) -> None:
        """Raise if a model no longer sits in this engine's device and dtype (converted behind its back)."""
        for m in (self.target, self.draft):
            if m is not None and (m.dtype != self.dtype or not _same_device(m.device, self.device)):
                raise RuntimeError(
                    f"the {m.name} model is now {str(m.dtype).removeprefix('torch.')} on {m.device}, but this "
                    f"Engine runs {str(self.dtype).removeprefix('torch.')} on {self.device}: it was converted "
                    "after the Engine was built (model.to(), .half(), ...). Build a new Engine, or give the "
                    "other user a copy of the model."
                )

    @contextmanager
    def exclusive(self):
        """Hold the engine (its caches) for one generation; raise `EngineBusyError` if another holds it."""
        if not self._busy.acquire(blocking=False):
            raise EngineBusyError(
                "this Engine is already decoding: generate() was called from another thread, or from inside "
                "a streaming callback, while a generation runs on it. One Engine decodes one batch at a time "
                "(its KV caches hold that batch): give each thread its own Engine (engines in the same device "
                "and dtype may share the model objects), or wait for the running call to return."
            )
        try:
            self.check_models()
            with contextlib.ExitStack() as held:  # the swaps held for the generation, not per pass
                models = (self.target, self.draft, *self._proposer_models)
                for model in {id(m.model): m.model for m in models if m is not None}.values():
                    held.enter_context(grouped_attention(model))
                    if self.passes is not None:
                        held.enter_context(self.passes.hold(model))
                if self.passes is not None:
                    for module in list(self._proposer_modules):
                        held.enter_context(self.passes.hold(module))
                yield
        finally:
            self._busy.release()

    def cache_bytes(self) -> dict[str, int]:
        """Bytes each model's KV cache holds now."""
        out = {"target": self.target.cache_bytes()}
        if self.draft is not None:
            out["draft"] = self.draft.cache_bytes()
        return out
