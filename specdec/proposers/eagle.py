"""An EAGLE-style drafter (Li et al. 2024) drafting a dynamic tree as EAGLE-2 does.

The drafter is one decoder layer of the target's own kind. At position t it reads the target's final
hidden state f_t and the embedding of the next token x_{t+1}, joined and projected 2H -> H, and
predicts f_{t+1}; the target's frozen output head (whole, or a reduced vocabulary, `heads.py`)
turns that into the distribution of x_{t+2}. The embedding is the target's own, frozen. The target's
f_t come from its scoring passes: the engine keeps them in the target's cache beside the keys and
values (`CachedModel.keep_hidden_states`), compacted to the accepted path after each tree step, so
nothing is computed twice.

Each step (`propose`):

1. catch up: the drafter feeds, with the target's true features, the positions it has not seen
   (after a step: the accepted tokens and the root), in one ragged pass over its own KV cache;
2. expand: from the root's predicted feature, the top `topk` tokens become depth-1 candidates, each
   scored by its log-probability. Then, level by level up to depth k (the schedule's k, at most
   `depth`), the `width` candidates of highest *path* score (sum of log-probabilities from the root,
   EAGLE-2's estimate of the chance the path is accepted) are fed to the drafter, in one pass per
   level, each with its parent's predicted feature, seeing only its own ancestors (a tree mask over
   the drafter's cache), and their top `topk` children join the candidates;
3. re-rank: the `budget` candidates of highest path score form the tree the target verifies. A
   child's score never exceeds its parent's, so the chosen set always contains every ancestor.

The drafted levels are scratch in the drafter's cache: it rolls back to the caught-up length, and
the next step re-feeds the accepted tokens with the target's true features.

Under `compile=on` the drafter's passes run compiled at the target's width and key buckets over
pooled buffers (`specdec.accel.compiled.CompiledModule`); the output head stays eager: compiling it
did not make a step faster (experiments/gpu/LOG.md, "Output heads").

Nodes are deterministic choices (a one-hot q), so greedy verification gives the target's greedy
output and recursive rejection sampling keeps its distribution at any temperature.

`heads_path` is a specdec checkpoint (a file, `scripts/train_heads.py`), or a published EAGLE-1/2
drafter's folder (SafeAILab's `yuhuili/EAGLE-*`, HASS), which `formats.read_drafter` reads as kind
`eagle`. A published drafter runs SafeAILab's forward (`eagle/model/cnets1.py`; /work/shared
FORMATS.md, section 1.2), which differs from specdec's own in four ways, all read from the tensors:
its layers are Llama decoder layers built from its config (as many as the tensors hold), whatever
the target's class; `fc` has a bias where the file has `fc.bias`; layer 0 has no input norm; and
there is no final norm, the last layer's output goes straight into the target's output head. Its
embeddings are the file's `embed_tokens` where it has them, else the target's.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from specdec.core.attention import AttentionLayout, grouped_attention
from specdec.core.cache import RowCache
from specdec.core.decoder_stack import decoder_stack
from specdec.core.device import to_device
from specdec.core.engine import Engine, overlay_columns
from specdec.core.errors import InvalidInput, MissingInput
from specdec.core.tree import TokenTree, TreeProposal
from specdec.proposers.base import Proposal
from specdec.proposers.heads import OutputHead, load_checkpoint, unseen_positions

# The drafter's layers attend to all of their positions (whatever the target's layers do).
_LAYOUT = AttentionLayout("eagle", ("full_attention",), None, "cache")

HEADS_HINT = ("a specdec checkpoint (scripts/train_heads.py kind=eagle) or a published EAGLE-1/2 drafter's folder "
              "(config.json and its weights: SafeAILab's EAGLE-*, HASS) trained for this target")


def is_published(heads_path: Any) -> bool:
    """Whether `heads_path` names a published drafter (a folder, or files already read: an object
    with `config` and `tensors`) rather than a specdec checkpoint file (or `embedded`)."""
    if hasattr(heads_path, "config") and hasattr(heads_path, "tensors"):
        return True
    return heads_path is not None and str(heads_path) not in ("", "embedded") and \
        Path(str(heads_path)).expanduser().is_dir()


def read_files(heads_path: Any, kind: str, hint: str):
    """The published drafter at `heads_path` (`formats.read_drafter`), or files already read; refuses
    a drafter of another kind, naming the method that runs it."""
    if hasattr(heads_path, "config") and hasattr(heads_path, "tensors"):
        files = heads_path
    else:
        from specdec.proposers.formats import read_drafter

        files = read_drafter(Path(str(heads_path)).expanduser())
    got = getattr(files, "kind", kind)
    if got != kind:
        raise InvalidInput(f"method.heads_path={getattr(files, 'path', heads_path)} holds a {got} drafter "
                           f"({getattr(files, 'format', got)}), not a {kind} one; use method={got} for it, or {hint}")
    return files


def _llama_config(config: dict) -> LlamaConfig:
    """The transformers config of a published EAGLE-1/2 drafter's Llama layers, from the canonical
    config of `formats.read_drafter` (kind `eagle`)."""
    heads = config["num_attention_heads"]
    rope = {"rope_type": "default", "rope_theta": float(config.get("rope_theta") or 10000.0)}
    scaling = config.get("rope_scaling")
    if scaling:
        rope.update({k: v for k, v in scaling.items() if k != "type"})
        rope["rope_type"] = scaling.get("rope_type") or scaling.get("type") or "default"
    llama = LlamaConfig(
        hidden_size=config["hidden_size"], num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=config["intermediate_size"], rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_parameters=rope, max_position_embeddings=config.get("max_position_embeddings", 2048),
        vocab_size=config["vocab_size"], attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)), num_hidden_layers=config["num_layers"])
    llama._attn_implementation = "sdpa"
    return llama


def _rotary_arguments(rotary: torch.nn.Module | None, layer_type: str | None) -> dict | None:
    """What the drafter passes the target's rotary embedding beside the hidden states and positions:
    nothing for most, the drafter's layer type (`layer_type`, the last layer's) where the rotary takes
    one (Gemma-3 and -4 keep a table per kind of layer, local and global); None when it needs
    something else, or there is no rotary embedding."""
    if rotary is None:
        return None
    required = [n for n, p in list(inspect.signature(rotary.forward).parameters.items())[2:]
                if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not required:
        return {}
    if required == ["layer_type"] and layer_type is not None:
        return {"layer_type": layer_type}
    return None


def _check_layout(model: torch.nn.Module, decoder: torch.nn.Module, config) -> tuple[torch.nn.ModuleList,
                                                                                      torch.nn.Module, dict]:
    """The drafter copies the target's decoder layer, norm and rotary classes: a Llama-like layout
    (a list of layers and a final norm, `decoder_stack`; `rotary_emb` called with the hidden states and
    positions, and the layer's type where it takes one). Returns the layers, the final norm and the
    rotary's extra arguments. Others (GPT-2's learned positions, OPT) are refused here rather than
    failing at the first draft. Layers that take per-layer inputs beside the hidden states (Gemma-3n,
    Gemma-4's E2B and E4B) are refused too: the drafter has none to give them. (Those models are also
    the ones whose last layers read an earlier layer's keys and values, which a one-layer drafter
    could not copy.) `config`: the language model's config."""
    model_type = getattr(model.config, "model_type", None)
    if getattr(config, "hidden_size_per_layer_input", None):
        raise ValueError(f"method=eagle: model type {model_type!r} ({type(model).__name__}) feeds each decoder "
                         "layer per-layer inputs beside the hidden states, which a one-layer drafter does not "
                         "have; use method=medusa or a draft model")
    stack = decoder_stack(decoder)
    kinds = getattr(config, "layer_types", None)
    rotary_args = None if stack is None else _rotary_arguments(
        getattr(decoder, "rotary_emb", None), kinds[len(stack[1]) - 1] if kinds else None)
    if rotary_args is None:
        raise ValueError(f"method=eagle needs a Llama-like target (a list of decoder layers, a final norm, a rotary "
                         f"embedding of the positions: Llama, Qwen2, Gemma-3, Phi, GPT-NeoX, ...); model type {model_type!r} "
                         f"({type(model).__name__}) has another layout; use method=medusa or a draft model")
    return (*stack[1:], rotary_args)


class EagleDrafter(torch.nn.Module):
    """fc: [2H -> H] over (token embedding, feature); decoder layers; a final norm.

    specdec's own drafter (`config` None) is built from the target model: one layer of its last
    decoder layer's class and kind, a copy of its final norm, its rotary class and its language
    model's config, so the drafter has the target's attention shape and positions.
    `init_from_target` starts the layer and norm as the target's last ones and fc as "pass the
    feature through".

    A published EAGLE-1/2 drafter (`config`: the canonical config of `formats.read_drafter`, kind
    `eagle`; `from_files` checks it against the target and loads its tensors) is SafeAILab's:
    `num_layers` Llama decoder layers (`layers.{i}`) built from that config, fc with a bias where
    `fc_bias`, no input norm in layer 0, no final norm (`norm` is the identity)."""

    def __init__(self, target_model: torch.nn.Module, init_from_target: bool = True, config: dict | None = None):
        super().__init__()
        if config is not None:
            self._build_published(config)
            return
        decoder = target_model.get_decoder()
        # A multimodal wrapper's language model (GOT-OCR2's Qwen2) is built from its text config, which has
        # the sizes the top-level config lacks.
        config = target_model.config.get_text_config(decoder=True)
        layers, norm, self._rotary_args = _check_layout(target_model, decoder, config)  # the layer's type for Gemma-3
        h = config.hidden_size
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        last, index = layers[-1], len(layers) - 1
        # The layer is built as the target's last one (its index picks its kind in many models: a dense or
        # a mixture-of-experts MLP, local or global attention), then reads and writes the drafter's own
        # cache: the cache indices its sublayers hold (one for most; LongCat-Flash's two attentions a layer
        # hold 2i and 2i + 1) are renumbered from 0, and the cache has `cache_layers` of them. The norm is
        # a copy of the target's final norm (its class, epsilon, bias), not one built from a guessed
        # epsilon (a LayerNorm's is `layer_norm_eps`), trainable like the rest of the drafter however
        # frozen the target is.
        try:
            self.layer = type(last)(config, layer_idx=index)
        except TypeError as err:  # GPT-NeoX-Japanese's layers take no index
            raise ValueError(f"method=eagle: the drafter's layer is built as {type(last).__name__}(config, layer_idx=...), "
                             f"which this model's layers do not take ({err}); use method=medusa or a draft model") from None
        held = [m for m in self.layer.modules() if isinstance(getattr(m, "layer_idx", None), int)]
        indices = sorted({m.layer_idx for m in held if m is not self.layer}) or [index]
        renumbered = {old: new for new, old in enumerate(indices)}
        for module in held:
            module.layer_idx = renumbered.get(module.layer_idx, 0)
        self.cache_layers = len(indices)
        self.norm = copy.deepcopy(norm, {id(config): config}).requires_grad_(True)
        self.rotary = type(decoder.rotary_emb)(config=config)
        params = inspect.signature(self.layer.forward).parameters
        self._cache_kwarg = next((n for n in ("cache", "past_key_values", "layer_past") if n in params),
                                 "past_key_values")  # GPT-NeoX's layers call it `layer_past`
        # Arguments some families' layers need: Gemma-4's dict through which a layer hands its keys and
        # values to the layers that share them (the drafter's layer shares with none: a fresh one each
        # call), Falcon's ALiBi bias (None in its rotary variant; ALiBi models are refused by the engine).
        self._extra = [n for n in ("shared_kv_states", "alibi") if n in params]
        if init_from_target:
            self.layer.load_state_dict(last.state_dict())
            self.norm.load_state_dict(norm.state_dict())
            with torch.no_grad():
                self.fc.weight.zero_()
                self.fc.weight[:, h:].copy_(torch.eye(h))

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, cache: RowCache | None = None) -> torch.Tensor:
        """embeds, features: [B, T, H]; positions: [B, T]; mask: additive [B, 1, T, kv] or None
        (causal, for training) -> predicted next features [B, T, H]."""
        x = self.fc(torch.cat([embeds, features], dim=-1).to(self.fc.weight.dtype))
        rotary = self.rotary(x, positions, **self._rotary_args)
        for layer in (self.layers if hasattr(self, "layers") else (self.layer,)):
            out = layer(x, attention_mask=mask, position_ids=positions, use_cache=cache is not None,
                        position_embeddings=rotary, **{n: {} if n == "shared_kv_states" else None for n in self._extra},
                        **{self._cache_kwarg: cache})
            x = out[0] if isinstance(out, tuple) else out
        return self.norm(x)

    def _build_published(self, config: dict) -> None:
        """SafeAILab's EAGLE-1/2 drafter from the canonical config: `fc` (its bias where `fc_bias`),
        `layers.{i}` Llama decoder layers (layer 0 without input_layernorm), no final norm."""
        llama = _llama_config(config)
        h = config["hidden_size"]
        self.fc = torch.nn.Linear(2 * h, h, bias=bool(config.get("fc_bias", False)))
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(llama, layer_idx=i) for i in range(config["num_layers"]))
        self.layers[0].input_layernorm = torch.nn.Identity()  # cnets1.py: `if self.index != 0` around it
        for layer in self.layers:  # SafeAILab's qkv_bias puts a bias on q, k and v, never on o_proj
            layer.self_attn.o_proj.bias = None
        self.norm = torch.nn.Identity()  # the last layer's output goes straight into the target's head
        self.rotary = LlamaRotaryEmbedding(llama)
        self.cache_layers = len(self.layers)
        self._rotary_args, self._cache_kwarg, self._extra = {}, "cache", []

    @classmethod
    def from_files(cls, files: Any, target_model: torch.nn.Module) -> EagleDrafter:
        """The published drafter of `files` (a `DrafterFiles` of kind `eagle`: `config`, `tensors`),
        checked against the target before anything drafts: its hidden size and vocabulary must be
        the target's (it reads the target's features and ends in the target's output head), and its
        tensors must be the Llama layers its config builds. `embed_tokens.weight` (when the file
        has it) becomes `embed_tokens`, which the proposer uses in place of the target's embeddings;
        `d2t` (an FR-Spec token map) becomes `vocab_ids`, the target ids the drafter proposes."""
        where = getattr(files, "path", "the drafter")
        config, tensors = dict(files.config), dict(files.tensors)
        text = target_model.config.get_text_config(decoder=True)
        want = {"hidden_size": text.hidden_size, "vocab_size": target_model.get_output_embeddings().out_features}
        wrong = {k: (config.get(k), v) for k, v in want.items() if config.get(k) != v}
        if wrong:
            said = ", ".join(f"{k}={got} where the target has {v}" for k, (got, v) in wrong.items())
            raise InvalidInput(f"method.heads_path={where}: the EAGLE drafter does not fit this target ({said}); it "
                               f"reads the target's final hidden states and ends in its output head; use {HEADS_HINT}")
        embed = tensors.pop("embed_tokens.weight", None)
        if embed is not None and tuple(embed.shape) != (want["vocab_size"], want["hidden_size"]):
            raise InvalidInput(f"method.heads_path={where}: embed_tokens.weight has shape {tuple(embed.shape)}, not the "
                               f"target's [{want['vocab_size']}, {want['hidden_size']}]; use {HEADS_HINT}")
        d2t = tensors.pop("d2t", None)
        tensors.pop("layers.0.input_layernorm.weight", None)  # some exports carry it; SafeAILab's forward skips it
        drafter = cls(target_model, init_from_target=False, config=config)
        missing, unexpected = drafter.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise InvalidInput(f"method.heads_path={where}: the tensors are not the Llama decoder layers of SafeAILab's "
                               f"EAGLE drafter that its config builds (missing {sorted(missing)}, unexpected "
                               f"{sorted(unexpected)}); layers of another kind do not run here; use {HEADS_HINT}")
        if embed is not None:
            drafter.embed_tokens = torch.nn.Embedding.from_pretrained(embed, freeze=True)
        if d2t is not None:
            ids = torch.arange(d2t.numel()) + d2t.long()
            if d2t.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= want["vocab_size"]:
                raise InvalidInput(f"method.heads_path={where}: d2t maps the drafter's tokens outside the target's "
                                   f"{want['vocab_size']} (or is empty); use a token map of this target's ids")
            drafter.register_buffer("vocab_ids", ids)
        return drafter


class EagleProposer:
    """Drafts a dynamic tree of `budget` nodes with an EAGLE-style drafter loaded from `heads_path`.

    topk:  children proposed per expanded node; width: nodes expanded per level; depth: the deepest
    level (the schedule's k caps it per step).
    """

    name = "eagle"
    taps: list[int] | None = None  # the target's hidden states it reads (`keep_hidden_states`; None: the last)
    drafts_trees = True  # its proposals are TreeProposals: only verifiers with a tree form (config checks it)

    def __init__(self, engine: Engine, heads_path: str, budget: int = 12, topk: int = 4, width: int = 4,
                 depth: int = 5):
        if not (budget >= 1 and topk >= 1 and width >= 1 and depth >= 1):
            raise ValueError(f"method.proposer: budget, topk, width and depth must be >= 1, got "
                             f"{budget}, {topk}, {width}, {depth}")
        self.engine, target = engine, engine.target
        target.hidden_source()  # a target without usable hidden states is refused before the file is read
        if is_published(heads_path):
            self.drafter = EagleDrafter.from_files(read_files(heads_path, "eagle", HEADS_HINT), target.model)
            vocab_ids = getattr(self.drafter, "vocab_ids", None)
        else:
            if heads_path is None or heads_path == "":
                raise MissingInput(f"method=eagle needs a drafter: set method.heads_path=<path>, {HEADS_HINT}")
            tensors, meta = load_checkpoint(heads_path, "eagle", target.model)
            self.drafter = EagleDrafter(target.model, init_from_target=False)
            self.drafter.load_state_dict({k: v for k, v in tensors.items() if k != "vocab_ids"})
            vocab_ids = tensors.get("vocab_ids")
        self.drafter.to(engine.device, engine.dtype).eval()
        self.head = OutputHead.of(target.model, vocab_ids)
        vocab = self.head.weight.shape[0]
        if topk > vocab:  # topk would fail at the first step
            raise InvalidInput(f"method.proposer.topk={topk}: the drafter proposes from {vocab} tokens"
                               f"{' (the drafter reduced the vocabulary)' if self.head.vocab_ids is not None else ''}; "
                               f"use a topk of at most {vocab}")
        own = getattr(self.drafter, "embed_tokens", None)
        self.embed = own if own is not None else target.model.get_input_embeddings()
        self.budget, self.topk, self.width, self.depth = budget, topk, width, depth
        self.num_nodes = budget
        self.target = target
        self.cache: RowCache | None = None
        target.keep_hidden_states()
        # compile=on: the drafter's passes compile at the target's buckets, with its backend
        self.compiled = engine.compiled("eagle drafter", self.drafter, "module")

    @staticmethod
    def heads_info(heads_path: Any) -> tuple[int, bool] | None:
        """For the config's checks before any model loads: (tokens the drafter proposes from, whether
        that is a reduced vocabulary) of a published drafter's folder, refusing what `read_files` and
        the reader refuse; None for a specdec checkpoint, which the config checks from its header."""
        if not is_published(heads_path):
            return None
        files = read_files(heads_path, "eagle", HEADS_HINT)
        vocab = files.config.get("draft_vocab_size") or files.config["vocab_size"]
        return vocab, vocab != files.config["vocab_size"]

    def reset(self, state) -> None:
        # Room for the sequence plus the drafted levels, which are scratch beyond the valid length.
        self.cache = RowCache(self.drafter.cache_layers, state.batch_size, state.max_len + self.depth * self.width + 1,
                              state.tokens.device)

    def _feed(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
              counts: list[int], region: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """One drafter pass at each row's valid length (tokens, positions: [B, T]; features: [B, T, H]).
        `region` = (columns [B, W], visible [B, T, W], their positions [B, W]) sets which of those cache
        entries each token sees (the drafted tree so far, and itself)."""
        cache, t = self.cache, tokens.shape[1]

        def masks(slots: torch.Tensor, query_positions: torch.Tensor, kv_len: int):
            """For queries at cache indices `slots: [B, W]` (W >= T: padding rows of a compiled pass see
            nothing of the region)."""
            mask = _LAYOUT.masks(slots, kv_len, self.drafter.fc.weight.dtype)
            if region is not None:
                columns, visible, column_positions = region
                if slots.shape[1] > t:
                    visible = torch.cat([visible, visible.new_zeros(visible.shape[0], slots.shape[1] - t,
                                                                    visible.shape[2])], 1)
                overlay_columns(_LAYOUT, mask, columns, visible, query_positions, column_positions)
            return mask

        embeds = self.embed(tokens)
        if self.compiled is not None:
            out = self.compiled.forward(cache, (embeds, features), positions, counts, masks)
            if out is not None:
                return out
        slots = cache.begin_write(t, counts)
        with grouped_attention(self.target.model):
            out = self.drafter(embeds, features, positions, masks(slots, positions, cache.kv_len), cache)
        cache.advance(counts)
        return out

    @torch.inference_mode()
    def propose(self, state, k: int) -> Proposal:
        b, device = state.batch_size, state.tokens.device
        if k == 0:
            return Proposal.empty(b, device)
        rows = torch.arange(b, device=device)

        # 1. catch up on the positions the drafter has not seen, with the target's features
        upto = self.target.lengths
        counts, pos = unseen_positions(list(self.cache.lengths), upto, device)
        features = self.target.hidden_at(self.taps, rows[:, None], pos)
        out = self._feed(state.tokens[rows[:, None], pos + 1], features, pos, counts)
        root = out[rows, to_device(counts, device) - 1]  # [B, H] predicted feature after the last token
        base = to_device(upto, device)  # the drafted region starts at each row's valid length

        # 2. expand the best paths level by level
        depth = min(k, self.depth)
        h = root.shape[-1]
        score, index = torch.log_softmax(self.head.logits(root).float(), -1).topk(self.topk, dim=-1)  # [B, K]
        cand_tokens, cand_scores = [self.head.token_ids(index)], [score]
        cand_parents = [torch.full_like(index, -1)]  # global candidate index of each candidate's parent
        parent_feature = root[:, None].expand(b, self.topk, h)  # the feature each candidate would be fed
        total = self.topk * (1 + (depth - 1) * self.width)
        fed_index = torch.full((b, total), -1, dtype=torch.long, device=device)  # candidate -> fed order
        visible_fed = torch.zeros(b, 0, 0, dtype=torch.bool, device=device)  # fed node i sees fed node j
        fed_positions = torch.zeros(b, 0, dtype=torch.long, device=device)
        level_start = 0
        for level in range(1, depth):
            level_scores = cand_scores[-1]
            w = min(self.width, level_scores.shape[1])
            chosen = level_scores.topk(w, dim=-1).indices  # [B, w] within the level
            n_fed = visible_fed.shape[1]
            parents = cand_parents[-1].gather(1, chosen)
            inherit = visible_fed[rows[:, None], fed_index.gather(1, parents.clamp(min=0))] if n_fed else \
                visible_fed.new_zeros(b, w, 0)
            visible = torch.cat([inherit, torch.eye(w, dtype=torch.bool, device=device).expand(b, w, w)], -1)
            positions = (base - 1 + level)[:, None].expand(b, w)
            fed_positions = torch.cat([fed_positions, positions], 1)
            columns = base[:, None] + torch.arange(n_fed + w, device=device)
            out = self._feed(cand_tokens[-1].gather(1, chosen), parent_feature.gather(1, chosen[..., None].expand(b, w, h)),
                             positions, [w] * b, (columns, visible, fed_positions))  # [B, w, H]
            fed_index.scatter_(1, level_start + chosen, n_fed + torch.arange(w, device=device).expand(b, w))
            grown = torch.zeros(b, n_fed + w, n_fed + w, dtype=torch.bool, device=device)
            grown[:, :n_fed, :n_fed] = visible_fed
            grown[:, n_fed:] = visible
            visible_fed = grown
            score, index = torch.log_softmax(self.head.logits(out).float(), -1).topk(self.topk, dim=-1)  # [B, w, K]
            cand_tokens.append(self.head.token_ids(index).flatten(1))
            cand_scores.append((level_scores.gather(1, chosen)[..., None] + score).flatten(1))
            cand_parents.append((level_start + chosen)[..., None].expand(b, w, self.topk).flatten(1))
            parent_feature = out[:, :, None].expand(b, w, self.topk, h).flatten(1, 2)
            level_start += level_scores.shape[1]
        self.cache.rollback(upto)  # the drafted levels were scratch

        # 3. re-rank: the budget best paths; candidates are in level order, so ties keep parents first
        tokens, scores, parents = (torch.cat(x, 1) for x in (cand_tokens, cand_scores, cand_parents))
        n = min(self.budget, tokens.shape[1])
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]
        chosen = torch.sort(order, dim=1).values  # [B, n] global indices, topological order
        where = torch.full_like(tokens, -1).scatter_(1, chosen, torch.arange(n, device=device).expand(b, n))
        parent = parents.gather(1, chosen)
        tree_parents = torch.where(parent >= 0, where.gather(1, parent.clamp(min=0)), -1)
        # Valid by construction, at most `depth` levels and `topk` children a slot: nothing to read back.
        tree = TokenTree.build(tree_parents, [n] * b, max_depth=depth, max_children=self.topk, check=False)
        return TreeProposal(tokens.gather(1, chosen), [n] * b, None, tree=tree)

    def observe(self, state, outcome) -> None:
        pass

