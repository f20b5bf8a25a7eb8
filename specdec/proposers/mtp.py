"""MTP heads as drafters (method=mtp): the multi-token-prediction modules that DeepSeek-V3/R1, GLM-4.x
and Qwen3-Next/3.5 ship inside their own checkpoints, drafting a chain.

An MTP module predicts the token after next from the target's hidden state h_t at position t and the
embedding of the next token x_{t+1}. Two layouts are read (/work/shared FORMATS.md, table 1.1 and
section 1.2):

- DeepSeek-V3 (GLM-4.x uses it): MTP layer k is `model.layers.{N+k}` of an N-layer target, with
  `num_nextn_predict_layers` in the config. `h' = eh_proj(cat([enorm(emb(x_{t+1})), hnorm(h_t)]))`,
  then one decoder block of the target's own class built at layer index N+k (so a dense or a
  mixture-of-experts MLP, and the attention kind, follow the target), then `shared_head.norm` and
  `shared_head.head`. The embedding at position 0 is zeroed, as vLLM's `deepseek_mtp` does. The
  block's pre-norm output is fed back as the next hidden state. The layer's own `embed_tokens` is
  used where the file has one, else the target's; its `shared_head.head` likewise.
- Qwen3-Next / Qwen3.5: `mtp.fc([pre_fc_norm_embedding(emb), pre_fc_norm_hidden(h)])`, then
  `mtp.layers.{k}` (a full-attention decoder layer of the target's class), then `mtp.norm` and the
  target's output head; embeddings are the target's. The normed output is fed back (vLLM's
  `qwen3_next_mtp` returns it). Its norms are the model's own RMSNorm class (zero-centred weights).

The feature h_t is the target's last hidden state after its final norm: what vLLM hands both
(`DeepseekV2Model.forward` returns `self.norm(hidden_states, residual)`, and the MTP module reads
that); DeepSeek's README says nothing on it. The engine keeps it in the target's cache from the
scoring passes (`CachedModel.keep_hidden_states`), so nothing is computed twice.

transformers drops these weights when it loads the target (`_keys_to_ignore_on_load_unexpected`:
`model.layers.61.*` for DeepSeek-V3, `^mtp.*` for Qwen3-Next), so they are read here from the target's
own safetensors shards, through `model.safetensors.index.json` or the single `model.safetensors` of
the folder the target was loaded from. A folder without them, a target that came from no folder, and
tensors whose shapes do not fit the target are refused before anything drafts.

Drafting (`MTPProposer`) is a chain of k tokens: step j runs MTP layer `j % n` (vLLM's rule),
fed the previous step's output as its hidden state. The module keeps its own KV cache (a `RowCache`,
one cache layer per MTP layer), caught up each step with the target's true features for the accepted
positions; every MTP layer is fed every position (the catch-up and each drafted token), so each
layer's cache is whole whichever step runs it (with one MTP layer, as every published model has,
this is vLLM's drafting). The drafted positions are scratch, rolled back after each step. Greedy
drafts are the argmax; under sampling, `Proposal.probs` carries the MTP head's distribution over the
target's vocabulary, so speculative sampling stays lossless.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.core.attention import AttentionLayout, grouped_attention
from specdec.core.cache import RowCache
from specdec.core.decoder_stack import decoder_stack
from specdec.core.device import to_device
from specdec.core.engine import Engine
from specdec.core.errors import InvalidInput, MissingInput
from specdec.core.sampling import greedy_tokens, probabilities, sample
from specdec.proposers.base import Proposal
from specdec.proposers.heads import unseen_positions

DEEPSEEK, QWEN3_NEXT = "deepseek_v3", "qwen3_next"
INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
HINT = ("a target whose own folder holds its MTP weights (DeepSeek-V3/R1 and GLM-4.x: model.layers.{N+k}.*; "
        "Qwen3-Next/3.5: mtp.*), loaded from that folder (target.path=<folder>, or a hub id in the local cache)")

# The MTP module's layers attend to all of their positions.
_LAYOUT = AttentionLayout("mtp", ("full_attention",), None, "cache")

# A DeepSeek-layout MTP layer's own tensors (the rest of `model.layers.{N+k}.*` is its decoder block):
# the file's name -> the drafter's.
_DEEPSEEK_OWN = {"enorm.weight": "embed_norm.weight", "hnorm.weight": "hidden_norm.weight",
                 "eh_proj.weight": "proj.weight", "shared_head.norm.weight": "norm.weight",
                 "shared_head.head.weight": "head.weight", "embed_tokens.weight": "embed_tokens.weight"}
# Qwen3-Next's tensors shared by its MTP layers: the file's name -> the drafter's (in every layer).
_QWEN_SHARED = {"mtp.fc.weight": "proj.weight", "mtp.pre_fc_norm_embedding.weight": "embed_norm.weight",
                "mtp.pre_fc_norm_hidden.weight": "hidden_norm.weight", "mtp.norm.weight": "norm.weight"}


@dataclass
class MTPFiles:
    """The MTP weights found in a target's folder.

    layout: DEEPSEEK or QWEN3_NEXT; num_layers: MTP layers; sources: the drafter's tensor name ->
    (the file's key, the shard that holds it); tensors: the drafter's name -> tensor (empty until
    `load`)."""

    path: Path
    layout: str
    num_layers: int
    sources: dict[str, tuple[str, str]]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def load(self) -> MTPFiles:
        """Read the tensors from their shards (only those: a shard is opened, not read whole)."""
        from safetensors import safe_open

        by_file: dict[str, list[tuple[str, str]]] = {}
        for name, (key, file) in self.sources.items():
            by_file.setdefault(file, []).append((name, key))
        for file, pairs in by_file.items():
            with safe_open(str(self.path / file), "pt") as f:
                for name, key in pairs:
                    self.tensors[name] = f.get_tensor(key)
        return self

    def where(self, name: str) -> str:
        """`<shard>: <key>` of the drafter's tensor `name`, for messages."""
        key, file = self.sources[name]
        return f"{self.path / file}: {key}"


def mtp_layer_count(config: Any) -> int | None:
    """The MTP layers a config declares (`num_nextn_predict_layers`, or Qwen3.5's
    `mtp_num_hidden_layers`); None where it says nothing."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        if get(key):
            return int(get(key))
    return None


def weight_files(folder: Path) -> dict[str, str]:
    """Every tensor key of the target's folder -> the shard that holds it: from
    `model.safetensors.index.json`, else the single `model.safetensors`'s header."""
    index = folder / INDEX
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as err:
            raise InvalidInput(f"{index} is not a safetensors index (a `weight_map` of tensor names to shards): "
                               f"{err}; copy the target's files again") from err
    if (folder / SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / SINGLE), "pt") as f:
            return {key: SINGLE for key in f.keys()}
    raise MissingInput(f"method=mtp reads the MTP weights from the target's safetensors, but {folder} holds neither "
                       f"{INDEX} nor {SINGLE}; use {HINT}")


def find_mtp(folder: Path, config: Any) -> MTPFiles:
    """The MTP weights of the target in `folder` (`config`: its text config), found by name alone (no
    tensor is read): the layout, the layer count and where each tensor is. Refuses a folder without
    them, naming the file and the key it looked for."""
    keys = weight_files(folder)
    shown = folder / (INDEX if (folder / INDEX).is_file() else SINGLE)
    declared = mtp_layer_count(config)
    if any(k.startswith("mtp.") for k in keys):
        layers = {int(m.group(1)) for k in keys if (m := re.match(r"mtp\.layers\.(\d+)\.", k))}
        count = declared or len(layers)
        sources = {}
        for k in range(count):
            if k not in layers:
                raise InvalidInput(f"{shown} has no mtp.layers.{k}.* although the config declares {count} MTP "
                                   f"layers; use {HINT}")
            for key, name in _QWEN_SHARED.items():
                if key in keys:
                    sources[f"layers.{k}.{name}"] = (key, keys[key])
            prefix = f"mtp.layers.{k}."
            sources.update({f"layers.{k}.block.{key[len(prefix):]}": (key, keys[key])
                            for key in keys if key.startswith(prefix)})
        extra = [key for key in keys if key.startswith("mtp.") and key not in _QWEN_SHARED
                 and not re.match(r"mtp\.layers\.\d+\.", key)]
        if extra:
            raise InvalidInput(f"{shown} holds MTP tensors of no layout read here ({', '.join(sorted(extra)[:3])}); "
                               f"use {HINT}")
        return MTPFiles(folder, QWEN3_NEXT, count, sources)
    n = config.num_hidden_layers
    found = {int(m.group(1)) for k in keys if (m := re.match(r"model\.layers\.(\d+)\.", k)) and int(m.group(1)) >= n}
    count = declared or len(found)
    first = f"model.layers.{n}.eh_proj.weight"
    if not count:
        raise MissingInput(f"{shown} holds no MTP weights: no key {first} (DeepSeek-V3/GLM layout) and no mtp.* "
                           f"(Qwen3-Next layout), and its config declares no num_nextn_predict_layers; "
                           f"method=mtp needs {HINT}")
    sources = {}
    for k in range(count):
        prefix = f"model.layers.{n + k}."
        if f"{prefix}eh_proj.weight" not in keys:
            raise MissingInput(f"{shown} has no key {prefix}eh_proj.weight: the config declares {count} MTP "
                               f"layer(s) after the target's {n}, but the weights are not in its shards; "
                               f"method=mtp needs {HINT}")
        for key in keys:
            if key.startswith(prefix):
                rest = key[len(prefix):]
                sources[f"layers.{k}.{_DEEPSEEK_OWN.get(rest, 'block.' + rest)}"] = (key, keys[key])
    return MTPFiles(folder, DEEPSEEK, count, sources)


def target_folder(model: torch.nn.Module) -> Path:
    """The folder `model` was loaded from (`name_or_path`: a local folder, or a hub id found in the local
    Hugging Face cache); refused where it came from none (built in-process, `tiny_random`)."""
    source = str(getattr(model, "name_or_path", "") or "")
    if source and Path(source).expanduser().is_dir():
        return Path(source).expanduser()
    if source and not source.startswith(("/", ".", "~")):
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(source, "config.json")
        if isinstance(found, str):
            return Path(found).parent
    raise InvalidInput(f"method=mtp reads the MTP weights from the folder the target was loaded from, but this "
                       f"target ({type(model).__name__}) came from no folder (name_or_path={source!r}: built in "
                       f"process, tiny_random, or a path that is gone); use {HINT}")


def check_target_files(source: Path | str) -> None:
    """For the config's checks before any model loads: the target's files hold MTP weights. `source`:
    where its config resolved to (`specdec.models.locate`): a folder, a GGUF file, a cached hub id, or
    "tiny_random" (built in process)."""
    from transformers import AutoConfig

    if source == "tiny_random":
        raise InvalidInput(f"method=mtp reads the MTP weights from the target's folder; target=tiny_random is built "
                           f"in process and has none; use {HINT}")
    if isinstance(source, Path) and source.is_file():
        raise InvalidInput(f"method=mtp reads the MTP weights from the target's safetensors; {source} is a GGUF file "
                           f"(converted without them); use {HINT}")
    if isinstance(source, str):
        from huggingface_hub import try_to_load_from_cache

        source = Path(try_to_load_from_cache(source, "config.json")).parent
    find_mtp(source, AutoConfig.from_pretrained(str(source)).get_text_config(decoder=True))


def _block_config(config: Any, index: int) -> Any:
    """The config to build the decoder block of MTP layer `index` from: the target's own, or, where
    its `layer_types` do not make that index full attention (Qwen3-Next's linear layers, an index past
    the target's layers), a copy that does."""
    kinds = getattr(config, "layer_types", None)
    if kinds is None or (index < len(kinds) and kinds[index] == "full_attention"):
        return config
    copied = copy.deepcopy(config)
    kinds = list(kinds) + ["full_attention"] * max(0, index + 1 - len(kinds))
    kinds[index] = "full_attention"
    copied.__dict__["layer_types"] = kinds  # not through setattr: the config would check it against its layers
    return copied


def _fuse_experts(files: MTPFiles, want: dict[str, torch.Tensor]) -> None:
    """Published shards keep a mixture of experts one expert at a time (`mlp.experts.{e}.gate_proj.weight`,
    `up_proj`, `down_proj`); transformers' layers hold them stacked (`mlp.experts.gate_up_proj` [E, 2I, H],
    gate first, and `mlp.experts.down_proj` [E, H, I]), as its own loader converts them. In place."""
    pattern = re.compile(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    groups: dict[str, dict[str, dict[int, str]]] = {}
    for name in files.tensors:
        if (m := pattern.match(name)) and f"{m.group(1)}.gate_up_proj" in want:
            groups.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = name
    for prefix, parts in groups.items():
        count = want[f"{prefix}.down_proj"].shape[0]
        for part in ("gate", "up", "down"):
            if sorted(parts.get(part, {})) != list(range(count)):
                raise InvalidInput(f"{files.path}: the MTP layer's experts {prefix} hold {part}_proj for experts "
                                   f"{sorted(parts.get(part, {}))}, where the target's config has {count}; use {HINT}")
        stacked = {part: torch.stack([files.tensors.pop(parts[part][e]) for e in range(count)]) for part in parts}
        first = {part: files.sources.pop(parts[part][0]) for part in parts}
        for e in range(1, count):
            for part in parts:
                files.sources.pop(parts[part][e])
        files.tensors[f"{prefix}.gate_up_proj"] = torch.cat([stacked["gate"], stacked["up"]], dim=1)
        files.tensors[f"{prefix}.down_proj"] = stacked["down"]
        files.sources[f"{prefix}.gate_up_proj"] = first["gate"]
        files.sources[f"{prefix}.down_proj"] = first["down"]


class MTPLayer(torch.nn.Module):
    """One MTP layer under the drafter's names: `embed_norm`, `hidden_norm`, `proj` [2H -> H], `block`
    (a decoder layer of the target's class), `norm`; optionally its own `head` [V, H] and
    `embed_tokens` [V, H] (DeepSeek's `shared_head.head`, `embed_tokens`)."""

    def __init__(self, block: torch.nn.Module, norm: torch.nn.Module, hidden: int, vocab: int, head: bool,
                 embed: bool):
        super().__init__()
        self.embed_norm, self.hidden_norm, self.norm = (copy.deepcopy(norm) for _ in range(3))
        self.proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.block = block
        if head:
            self.head = torch.nn.Linear(hidden, vocab, bias=False)
        if embed:
            self.embed_tokens = torch.nn.Embedding(vocab, hidden)


class MTPDrafter(torch.nn.Module):
    """The target's MTP layers, built from the target (its decoder layer and norm classes, its config,
    its rotary embedding) and loaded from `MTPFiles` (`from_files`)."""

    def __init__(self, target_model: torch.nn.Module, files: MTPFiles):
        super().__init__()
        config = target_model.config.get_text_config(decoder=True)
        decoder = target_model.get_decoder()
        stack = decoder_stack(decoder)
        if stack is None or getattr(decoder, "rotary_emb", None) is None:
            raise InvalidInput(f"method=mtp builds the MTP block as the target's own decoder layer, but "
                               f"{type(target_model).__name__} has no list of layers, final norm and rotary "
                               f"embedding to copy; use {HINT}")
        layers, norm = stack[1], stack[2]
        h = config.hidden_size
        vocab = target_model.get_output_embeddings().out_features
        self.layout, self.num_layers = files.layout, files.num_layers
        self.zero_first_embedding = files.layout == DEEPSEEK  # vLLM's deepseek_mtp
        self.feed_normed = files.layout == QWEN3_NEXT  # vLLM's qwen3_next_mtp returns mtp.norm's output
        built = []
        for k in range(files.num_layers):
            index = config.num_hidden_layers + k if files.layout == DEEPSEEK else k
            block = type(layers[-1])(_block_config(config, index), layer_idx=index)
            for module in block.modules():  # each MTP layer reads and writes cache layer k of the drafter's cache
                if isinstance(getattr(module, "layer_idx", None), int):
                    module.layer_idx = k
            own = {n for n in files.sources if n.startswith(f"layers.{k}.")}
            built.append(MTPLayer(block, norm, h, vocab, f"layers.{k}.head.weight" in own,
                                  f"layers.{k}.embed_tokens.weight" in own))
        self.layers = torch.nn.ModuleList(built)
        self.rotary = type(decoder.rotary_emb)(config=config)
        params = inspect.signature(type(layers[-1]).forward).parameters
        self._cache_kwarg = next((n for n in ("cache", "past_key_values") if n in params), "cache")
        self._use_cache = "use_cache" in params
        # The target's output head and embeddings, where a layer has none of its own: held outside the
        # module tree (the engine moves and converts them with the target).
        self._target = (target_model.get_output_embeddings(), target_model.get_input_embeddings())

    @classmethod
    def from_files(cls, files: MTPFiles, target_model: torch.nn.Module) -> MTPDrafter:
        """The drafter of `files`, its tensors read and checked against the layers built from the
        target: every tensor the layers need is there, none is left over, and each has the shape the
        target's config gives it; each refusal names the shard and the key."""
        if not files.tensors:
            files.load()
        drafter = cls(target_model, files)
        want = drafter.state_dict()
        _fuse_experts(files, want)
        wrong = [n for n, t in files.tensors.items() if n in want and tuple(t.shape) != tuple(want[n].shape)]
        if wrong:
            n = wrong[0]
            raise InvalidInput(f"{files.where(n)} has shape {tuple(files.tensors[n].shape)}, but the target's "
                               f"config gives its MTP layer {tuple(want[n].shape)}; these MTP weights do not fit "
                               f"this target; use {HINT}")
        scales = [files.where(n) for n in files.tensors if n.endswith("_scale_inv") or n.endswith(".weight_scale")]
        if scales:
            raise InvalidInput(f"{scales[0]} is a quantization scale: the MTP weights are quantized (FP8 blocks), "
                               f"which method=mtp does not read; use a bfloat16 copy of the target")
        missing, unexpected = drafter.load_state_dict(files.tensors, strict=False)
        missing = [n for n in missing if not n.startswith("rotary.")]
        if unexpected:
            raise InvalidInput(f"{files.where(unexpected[0])} is not a tensor of the MTP layer the target's config "
                               f"builds (a {type(drafter.layers[0].block).__name__}); {len(unexpected)} such; use {HINT}")
        if missing:
            n = missing[0]
            k, rest = n.split(".", 2)[1], n.split(".", 2)[2]
            if files.layout == DEEPSEEK:
                base = f"model.layers.{target_model.config.get_text_config(decoder=True).num_hidden_layers + int(k)}."
                inverse = {v: f for f, v in _DEEPSEEK_OWN.items()}
                key = base + inverse.get(rest, rest.removeprefix("block."))
            else:
                inverse = {v: f for f, v in _QWEN_SHARED.items()}
                key = inverse.get(rest, f"mtp.layers.{k}.{rest.removeprefix('block.')}")
            raise InvalidInput(f"{files.path} has no key {key} (and {len(missing) - 1} more of its MTP layer); "
                               f"use {HINT}")
        return drafter

    def embed(self, k: int, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B, T] -> the embeddings MTP layer k reads, [B, T, H]."""
        own = getattr(self.layers[k], "embed_tokens", None)
        return (own if own is not None else self._target[1])(tokens)

    def forward(self, k: int, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, cache: RowCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer k. embeds: [B, T, H] of the next tokens; hidden: [B, T, H] the target's features (or
        the previous step's output); positions: [B, T]; mask: additive [B, 1, T, kv], or None (causal,
        no cache) -> (the hidden state to feed back [B, T, H], the normed one the head reads [B, T, H])."""
        layer = self.layers[k]
        dtype = layer.proj.weight.dtype
        embeds, hidden = embeds.to(dtype), hidden.to(dtype)
        if self.zero_first_embedding:
            embeds = embeds.masked_fill((positions == 0)[..., None], 0)
        x = layer.proj(torch.cat([layer.embed_norm(embeds), layer.hidden_norm(hidden)], dim=-1))
        if mask is None and cache is None:
            t = x.shape[1]
            mask = torch.full((t, t), torch.finfo(dtype).min, dtype=dtype, device=x.device).triu(1)[None, None]
        kwargs = {"use_cache": cache is not None} if self._use_cache else {}
        out = layer.block(x, attention_mask=mask, position_ids=positions, position_embeddings=self.rotary(x, positions),
                          **{self._cache_kwarg: cache}, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        normed = layer.norm(out)
        return (normed if self.feed_normed else out), normed

    def logits(self, k: int, normed: torch.Tensor) -> torch.Tensor:
        """normed: [..., H] (forward's second output) -> MTP layer k's logits over the target's vocabulary."""
        head = getattr(self.layers[k], "head", None)
        return (head if head is not None else self._target[0])(normed)


class MTPProposer:
    """Drafts a chain of k tokens (the schedule's k) with the target's own MTP layers, read from the
    folder the target was loaded from."""

    name = "mtp"

    def __init__(self, engine: Engine):
        self.engine, target = engine, engine.target
        target.hidden_source()  # a target without usable hidden states is refused before its files are read
        config = target.model.config.get_text_config(decoder=True)
        files = find_mtp(target_folder(target.model), config)
        self.drafter = MTPDrafter.from_files(files, target.model).to(engine.device, engine.dtype).eval()
        self.files = files
        self.target = target
        self.cache: RowCache | None = None
        target.keep_hidden_states()

    @staticmethod
    def check_target(source: Path | str) -> None:
        """The config's check before any model loads (`check_target_files`)."""
        check_target_files(source)

    def reset(self, state) -> None:
        # The drafted tokens sit where the target scores them, so its room is the drafter's, plus scratch.
        self.cache = RowCache(self.drafter.num_layers, state.batch_size, state.max_len + 1, state.tokens.device)

    def _feed(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, counts: list[int],
              step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of every MTP layer at each row's valid length (tokens, positions: [B, T]; hidden:
        [B, T, H]), so every layer's cache holds these positions; returns layer `step % n`'s outputs."""
        cache, t = self.cache, tokens.shape[1]
        slots = cache.begin_write(t, counts)
        mask = _LAYOUT.masks(slots, cache.kv_len, self.drafter.layers[0].proj.weight.dtype)
        chosen = step % self.drafter.num_layers
        with grouped_attention(self.target.model):
            outs = [self.drafter(k, self.drafter.embed(k, tokens), hidden, positions, mask, cache)
                    for k in range(self.drafter.num_layers)]
        cache.advance(counts)
        return outs[chosen]

    @torch.inference_mode()
    def propose(self, state, k: int) -> Proposal:
        b, device = state.batch_size, state.tokens.device
        if k == 0:
            return Proposal.empty(b, device)
        rows = torch.arange(b, device=device)
        # Catch up on the positions not seen yet: x_{p+1} with the target's feature at p.
        upto = self.target.lengths
        counts, pos = unseen_positions(list(self.cache.lengths), upto, device)
        last = to_device(counts, device) - 1
        feedback, normed = self._feed(state.tokens[rows[:, None], pos + 1], self.target.hidden_at(None, rows[:, None], pos),
                                      pos, counts, 0)
        feedback, normed = feedback[rows, last][:, None], normed[rows, last]  # [B, 1, H], [B, H]
        base = to_device(upto, device)
        tokens, probs = [], []
        for i in range(k):
            logits = self.drafter.logits(i % self.drafter.num_layers, normed).float()  # [B, V]
            if state.sampling.greedy:
                token = greedy_tokens(logits)
            else:
                q = probabilities(logits, state.sampling)
                token = sample(q, state.generator)
                probs.append(q)
            tokens.append(token)
            if i < k - 1:
                feedback, normed = self._feed(token[:, None], feedback, (base + i)[:, None], [1] * b, i + 1)
                normed = normed[:, 0]
        self.cache.rollback(upto)  # the drafted tokens were scratch
        return Proposal(torch.stack(tokens, 1), [k] * b, torch.stack(probs, 1) if probs else None)

    def observe(self, state, outcome) -> None:
        pass
