"""Published drafters read into one canonical form: `read_drafter(path)`.

The field ships drafters in several layouts (docs/drafters.md; the sources are named there). The
same EAGLE-3 mid-layer is `midlayer.*` in SafeAILab's and SGLang's files and `layers.0.*` in the
`speculators` package's; the layers it reads from the target are named by three conventions; a
Medusa head is `{h}.{l}.linear.*` in FasterDecoding's files and `blocks.{h}.layers.{l}.*` in
vLLM's. A reader that guesses wrong still runs, at a lower acceptance, so the mistake never shows
as an error. This module reads each layout into one form, checks it against the tensors, and
refuses what it cannot read before any model loads, naming the format, the key and what it expected.

Canonical forms (`DrafterFiles.kind`):

* `eagle3`: the `speculators` package's tensor names (`fc`, `layers.0.*`, `norm`, `lm_head`, `d2t`,
  `t2d`, optional `embed_tokens`, `fc_norm.{i}`, `input_norm`), and a flat config of Llama fields plus
  the EAGLE-3 settings. `layer_ids` are indices into transformers' `output_hidden_states` (the
  residual stream entering decoder layer i), whatever the source's convention; the source's own ids
  are kept in `layer_ids_source`.
* `eagle` (EAGLE-1/2): SafeAILab's names as they are (`fc`, `layers.{i}.*`, optional `embed_tokens`).
* `medusa`: vLLM's names, `blocks.{h}.layers.{l}.weight` (and `.bias`), `lm_heads.{h}.weight`,
  optional `token_map`; FasterDecoding's `{h}.{l}.linear.*` and `{h}.{L}.weight` are renamed to them.
* specdec's own checkpoints (`heads.save_checkpoint`): kind and config from their metadata,
  tensors as they are.

Layer counts, biases and vocabulary sizes come from the tensors, never from `num_hidden_layers`:
published configs copy that field from the target (FORMATS.md 1.3). What was inferred or defaulted
is said in `notes`, one sentence each.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdec.core.errors import InvalidInput, MissingInput
from specdec.proposers.heads import is_checkpoint

FORMATS = ("specdec", "eagle-safeailab", "eagle3-safeailab", "eagle3-sglang", "eagle3-speculators",
           "eagle3-modelopt", "medusa-fasterdecoding", "medusa-vllm")

# The weight files looked for in a drafter's folder, in this order.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "medusa_lm_head.safetensors", "medusa_lm_head.pt")

# Settings only NVIDIA ModelOpt's nested eagle_config carries (SGLang's holds the layer ids alone).
MODELOPT_KEYS = ("use_input_layernorm_in_first_layer", "use_last_layernorm", "use_mtp_layernorm")

EAGLE3_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")
EAGLE_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
               "post_attention_layernorm.weight")


@dataclass
class DrafterFiles:
    """A drafter as read: its canonical config and tensors, and what the reader inferred."""

    path: Path                         # the folder (or file) read
    format: str                        # one of FORMATS
    kind: str                          # the architecture: "eagle", "eagle3" or "medusa"
    config: dict                       # canonical settings (the module docstring)
    tensors: dict[str, torch.Tensor]   # canonical names
    notes: list[str] = field(default_factory=list)  # what was inferred or defaulted, one sentence each


def vocab_map_to_d2t(ids: torch.Tensor) -> torch.Tensor:
    """An FR-Spec token map (a 1-D tensor of the kept target ids, any order) -> d2t [Vd] int64,
    the offsets of EAGLE-3's files: target id = i + d2t[i], with the ids sorted ascending."""
    if ids.dim() != 1 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise InvalidInput(f"a token map must be a 1-D tensor of integer target ids; got {ids.dim()}-D {ids.dtype}")
    ids = ids.long()
    if ids.numel() and int(ids.min()) < 0:
        raise InvalidInput(f"a token map holds target ids, which are >= 0; it holds {int(ids.min())}")
    sorted_ids = torch.sort(ids).values
    if sorted_ids.numel() > 1 and bool((sorted_ids[1:] == sorted_ids[:-1]).any()):
        raise InvalidInput("a token map must not repeat a target id; its entries are the distinct tokens kept")
    return sorted_ids - torch.arange(sorted_ids.numel())


def read_drafter(path: str | Path, token_map: str | Path | torch.Tensor | None = None) -> DrafterFiles:
    """The drafter at `path` (a folder with config.json and its weights, or a specdec checkpoint
    file), in canonical form. `token_map`: an FR-Spec token map (a `.pt` file or a tensor of kept
    target ids) that restricts an EAGLE drafter's output to those tokens, stored as `d2t`."""
    path = Path(path).expanduser()
    if not path.exists():
        raise MissingInput(f"drafter {path} does not exist; give a drafter's folder (config.json and its weights) "
                           f"or a specdec checkpoint")
    if path.is_file() and is_checkpoint(path):
        files = _read_specdec(path, path)
    elif path.is_dir() and (path / "model.safetensors").is_file() and is_checkpoint(path / "model.safetensors"):
        files = _read_specdec(path, path / "model.safetensors")
    else:
        folder, weights = (path.parent, path) if path.is_file() else (path, None)
        config = _read_config(folder)
        tensors, source = _read_tensors(folder, weights)
        files = _read_published(path, config, tensors, source)
    if token_map is not None:
        _apply_token_map(files, token_map)
    return files


# ---- files ----------------------------------------------------------------------------------------


def _read_config(folder: Path) -> dict:
    """config.json of `folder`, or {} where there is none (FasterDecoding's Medusa heads read without)."""
    file = folder / "config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InvalidInput(f"{file} is not JSON ({err}); a drafter's config.json is a JSON object") from None
    if not isinstance(config, dict):
        raise InvalidInput(f"{file} holds a {type(config).__name__}, not the JSON object of a config")
    return config


def _load_weights(file: Path) -> dict[str, torch.Tensor]:
    """One weight file: safetensors, or a torch state dict read with weights_only=True."""
    if file.suffix == ".safetensors":
        try:
            return load_file(str(file))
        except Exception as err:  # safetensors raises its own error types, and OSError for a short file
            raise InvalidInput(f"{file} is not a safetensors file ({err}); the download may be cut short") from None
    try:
        state = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as err:  # pickle's and torch's errors for a file that is not a plain state dict
        raise InvalidInput(f"{file} cannot be read as a state dict of tensors with weights_only=True ({err}); "
                           f"save the drafter's state_dict() alone, or convert it to safetensors") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise InvalidInput(f"{file} holds a {type(state).__name__}, not a state dict of tensors; save the "
                           f"drafter's state_dict() alone")
    return dict(state)


def _read_tensors(folder: Path, weights: Path | None) -> tuple[dict[str, torch.Tensor], Path]:
    """The tensors of the first weight file found (all shards of an index), and the file read."""
    if weights is None:
        found = [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]
        if not found:
            raise MissingInput(f"drafter folder {folder} holds no weights: expected one of {', '.join(WEIGHT_FILES)}")
        weights = found[0]
    if weights.name.endswith(".index.json"):
        try:
            shards = sorted(set(json.loads(weights.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as err:
            raise InvalidInput(f"{weights} has no weight_map ({err}); expected a transformers shard index") from None
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            if not (folder / shard).is_file():
                raise MissingInput(f"{weights} names the shard {shard}, which is not in {folder}")
            tensors.update(_load_weights(folder / shard))
        return tensors, weights
    return _load_weights(weights), weights


def _read_specdec(path: Path, file: Path) -> DrafterFiles:
    """A checkpoint of `heads.save_checkpoint`: kind and config from its metadata, tensors as they are."""
    from safetensors.torch import safe_open

    with safe_open(str(file), "pt") as f:
        info = f.metadata() or {}
    try:
        meta = json.loads(info.get("meta", "{}"))
    except json.JSONDecodeError as err:
        raise InvalidInput(f"{file}: a specdec checkpoint whose 'meta' metadata is not JSON ({err})") from None
    return DrafterFiles(path=path, format="specdec", kind=info["kind"], config=meta, tensors=load_file(str(file)),
                        notes=[f"specdec checkpoint of kind {info['kind']}, read from its metadata"])


# ---- detection ------------------------------------------------------------------------------------


def _read_published(path: Path, config: dict, tensors: dict[str, torch.Tensor], source: Path) -> DrafterFiles:
    """Detect the format from config.json and the tensor names, then read it."""
    names = set(tensors)
    if "speculators_model_type" in config:
        kind = config["speculators_model_type"]
        if kind != "eagle3":
            raise InvalidInput(f"{path}: a speculators {kind} drafter (speculators_model_type={kind!r}); this reader "
                               f"reads speculators_model_type 'eagle3' only")
        return _read_eagle3(path, "eagle3-speculators", config, tensors)
    if config.get("model_type") == "medusa" or any(n.startswith(("blocks.", "lm_heads.")) for n in names):
        return _read_medusa_vllm(path, config, tensors)
    if "medusa_num_heads" in config or (names and all(re.match(r"\d+\.\d+\.", n) for n in names)):
        return _read_medusa_fasterdecoding(path, config, tensors)
    names = {_strip_model_prefix(n) for n in names}
    if any(n.startswith("midlayer.") for n in names) or "layers.0.hidden_norm.weight" in names:
        eagle_config = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
        if any(k in eagle_config for k in MODELOPT_KEYS):
            return _read_eagle3(path, "eagle3-modelopt", config, tensors)
        if "LlamaForCausalLMEagle3" in (config.get("architectures") or []) or eagle_config:
            return _read_eagle3(path, "eagle3-sglang", config, tensors)
        return _read_eagle3(path, "eagle3-safeailab", config, tensors)
    if "fc.weight" in names:
        return _read_eagle(path, config, tensors)
    sample = ", ".join(sorted(tensors)[:6]) or "none"
    raise InvalidInput(f"{path}: not a drafter format this reader knows ({source.name} holds tensors {sample}; "
                       f"config architectures={config.get('architectures')}). Expected EAGLE's fc.weight, EAGLE-3's "
                       f"midlayer.* or layers.0.hidden_norm.weight, a speculators config (speculators_model_type), "
                       f"or Medusa's {{h}}.{{l}}.linear.weight or blocks.{{h}}.layers.{{l}}.weight")


def _strip_model_prefix(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _unprefixed(tensors: dict[str, torch.Tensor], notes: list[str]) -> dict[str, torch.Tensor]:
    """Tensors without a leading `model.` (some exports nest the drafter under `model`)."""
    if not any(n.startswith("model.") for n in tensors):
        return dict(tensors)
    notes.append("tensor names carried a leading 'model.', dropped")
    return {_strip_model_prefix(n): t for n, t in tensors.items()}


# ---- shared checks --------------------------------------------------------------------------------


def _need(tensors: dict[str, torch.Tensor], name: str, fmt: str, path: Path, expected: str) -> torch.Tensor:
    if name not in tensors:
        raise InvalidInput(f"{path}: {fmt} drafter without the tensor {name} (expected {expected})")
    return tensors[name]


def _shape(t: torch.Tensor, want: tuple, name: str, fmt: str, path: Path, why: str) -> None:
    if tuple(t.shape) != tuple(want):
        raise InvalidInput(f"{path}: {fmt} tensor {name} has shape {tuple(t.shape)}, expected {tuple(want)} ({why})")


def _layer_count(names: set[str]) -> int:
    ids = {int(m.group(1)) for n in names if (m := re.match(r"layers\.(\d+)\.", n))}
    return max(ids) + 1 if ids else 0


def _llama_fields(lc: dict, hidden: int, q_rows: int, k_rows: int, fmt: str, path: Path, where: str,
                  notes: list[str]) -> dict:
    """The Llama fields of a drafter layer from its config `lc` (named `where` in errors), checked
    against the tensors: hidden size `hidden`, q_proj and k_proj output rows."""
    if lc.get("hidden_size") not in (None, hidden):
        raise InvalidInput(f"{path}: {fmt} {where} says hidden_size={lc['hidden_size']} but the tensors are "
                           f"{hidden} wide (fc.weight rows); the config belongs to another model")
    heads = lc.get("num_attention_heads")
    if not isinstance(heads, int) or heads <= 0:
        raise InvalidInput(f"{path}: {fmt} {where} has no num_attention_heads (expected a positive integer, "
                           f"the drafter layer's attention heads)")
    head_dim = lc.get("head_dim") or hidden // heads
    kv_heads = lc.get("num_key_value_heads") or heads
    if q_rows != heads * head_dim:
        raise InvalidInput(f"{path}: {fmt} q_proj has {q_rows} rows but {where} num_attention_heads={heads} x "
                           f"head_dim={head_dim} makes {heads * head_dim}")
    if k_rows != kv_heads * head_dim:
        raise InvalidInput(f"{path}: {fmt} k_proj has {k_rows} rows but {where} num_key_value_heads={kv_heads} x "
                           f"head_dim={head_dim} makes {kv_heads * head_dim}")
    rope = lc.get("rope_parameters") if isinstance(lc.get("rope_parameters"), dict) else {}
    rope_theta = lc.get("rope_theta", rope.get("rope_theta"))
    if rope_theta is None:
        rope_theta = 10000.0
        notes.append(f"{where} gives no rope_theta: 10000 assumed")
    eps = lc.get("rms_norm_eps")
    if eps is None:
        eps = 1e-6
        notes.append(f"{where} gives no rms_norm_eps: 1e-6 assumed")
    scaling = lc.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"}
                                         if rope.get("rope_type", "default") != "default" else None)
    if scaling:
        notes.append(f"{where} scales RoPE ({scaling.get('rope_type') or scaling.get('type')}): kept as rope_scaling")
    return {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "rms_norm_eps": float(eps), "rope_theta": float(rope_theta),
            "rope_scaling": scaling or None,
            "max_position_embeddings": int(lc.get("max_position_embeddings") or 2048)}


# ---- EAGLE-3 --------------------------------------------------------------------------------------


def _eagle3_layer_ids(fmt: str, config: dict, notes: list[str]) -> tuple[list[int] | None, dict | None]:
    """(canonical ids as `output_hidden_states` indices, the source's ids and convention)."""
    if fmt == "eagle3-speculators":
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            notes.append("no eagle_aux_hidden_state_layer_ids: the target's [2, N//2, N-3] apply")
            return None, None
        return sorted(ids), {"ids": list(ids), "convention": "vllm: the residual stream entering layer i "
                                                            "(hidden_states[i]), used as they are"}
    eagle_config = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids"))
    if ids is None:
        if fmt != "eagle3-safeailab":
            notes.append("no eagle_aux_hidden_state_layer_ids: the target's [2, N//2, N-3] apply")
        return None, None
    if not ids or not all(isinstance(i, int) for i in ids):
        raise InvalidInput(f"{fmt} eagle_aux_hidden_state_layer_ids={ids}: expected a list of layer numbers")
    if fmt == "eagle3-safeailab":
        return sorted(ids), {"ids": list(ids), "convention": "hidden_states index, used as they are"}
    # SGLang (and ModelOpt, which SGLang reads the same way) name the output of layer X; SGLang adds 1,
    # but only where the first id is 1, the convention's default [1, N//2-1, N-4] (sglang#25454).
    shift = 1 if min(ids) == 1 else 0
    convention = ("sglang: the output of layer i, +1 applied since the first id is 1" if shift else
                  "sglang: the first id is not 1, so taken as hidden_states indices (no +1), as SGLang does")
    notes.append(f"layer ids {list(ids)} read as {sorted(i + shift for i in ids)} ({convention})")
    return sorted(i + shift for i in ids), {"ids": list(ids), "convention": convention}


def _read_eagle3(path: Path, fmt: str, config: dict, tensors: dict[str, torch.Tensor]) -> DrafterFiles:
    notes: list[str] = []
    tensors = _unprefixed(tensors, notes)
    if any(n.startswith("midlayer.") for n in tensors):
        tensors = {("layers.0." + n[len("midlayer."):]) if n.startswith("midlayer.") else n: t
                   for n, t in tensors.items()}
        notes.append("midlayer.* renamed layers.0.*")
    eagle_config = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    if fmt == "eagle3-modelopt":
        for key, ok in (("use_input_layernorm_in_first_layer", True), ("use_last_layernorm", True),
                        ("use_mtp_layernorm", False)):
            if key in eagle_config and bool(eagle_config[key]) != ok:
                raise InvalidInput(f"{path}: {fmt} eagle_config.{key}={eagle_config[key]} changes the mid-layer's "
                                   f"norms; this reader expects {key}={ok}, EAGLE-3's own forward")
    lc = config.get("transformer_layer_config") if fmt == "eagle3-speculators" else config
    if not isinstance(lc, dict) or not lc:
        raise InvalidInput(f"{path}: {fmt} drafter without a config (expected "
                           f"{'transformer_layer_config in ' if fmt == 'eagle3-speculators' else ''}config.json "
                           f"with the Llama fields hidden_size, num_attention_heads, vocab_size)")
    where = "transformer_layer_config" if fmt == "eagle3-speculators" else "config.json"
    fc = _need(tensors, "fc.weight", fmt, path, "[H, n*Ht], the projection of the target's layers")
    hidden = fc.shape[0]
    for part in EAGLE3_LAYER:
        _need(tensors, f"layers.0.{part}", fmt, path, "EAGLE-3's mid-layer" +
              (" (SafeAILab names it midlayer.*)" if fmt != "eagle3-speculators" else ""))
    q = tensors["layers.0.self_attn.q_proj.weight"]
    if q.shape[1] != 2 * hidden:
        raise InvalidInput(f"{path}: {fmt} tensor layers.0.self_attn.q_proj.weight reads {q.shape[1]} features, "
                           f"expected 2H = {2 * hidden} (the joined embedding and hidden state of EAGLE-3)")
    norm = _need(tensors, "norm.weight", fmt, path, f"[{hidden}], the norm before lm_head")
    _shape(norm, (hidden,), "norm.weight", fmt, path, "the draft hidden size")
    lm_head = _need(tensors, "lm_head.weight", fmt, path, "[Vd, H], the draft vocabulary's output head")
    draft_vocab = lm_head.shape[0]
    _shape(lm_head, (draft_vocab, hidden), "lm_head.weight", fmt, path, "the draft hidden size")
    fields = _llama_fields(lc, hidden, q.shape[0], tensors["layers.0.self_attn.k_proj.weight"].shape[0],
                           fmt, path, where, notes)
    said_draft = config.get("draft_vocab_size")
    if said_draft is not None and said_draft != draft_vocab:
        raise InvalidInput(f"{path}: {fmt} config.json says draft_vocab_size={said_draft} but lm_head.weight has "
                           f"{draft_vocab} rows; the weights and the config come from different drafters")
    t2d = tensors.get("t2d")
    vocab = lc.get("vocab_size") or (t2d.shape[0] if t2d is not None else None)
    if vocab is None:
        if "d2t" in tensors:
            raise InvalidInput(f"{path}: {fmt} {where} has no vocab_size (expected the target's vocabulary size)")
        vocab = draft_vocab
        notes.append("no vocab_size: the draft vocabulary taken as the target's")
    d2t = tensors.get("d2t")
    if d2t is None and draft_vocab != vocab:
        raise InvalidInput(f"{path}: {fmt} drafter without the tensor d2t (expected [{draft_vocab}] int64 offsets "
                           f"mapping its {draft_vocab} draft tokens into the target's {vocab})")
    if d2t is not None:
        _shape(d2t, (draft_vocab,), "d2t", fmt, path, "one offset per draft token")
        if d2t.is_floating_point() or d2t.dtype == torch.bool:
            raise InvalidInput(f"{path}: {fmt} tensor d2t is {d2t.dtype}, expected int64 offsets (target id = i + d2t[i])")
        target_ids = torch.arange(draft_vocab) + d2t.long()
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab:
            raise InvalidInput(f"{path}: {fmt} d2t maps draft tokens to target ids in [{int(target_ids.min())}, "
                               f"{int(target_ids.max())}], outside the target's vocabulary of {vocab}; d2t holds "
                               f"offsets (target id = i + d2t[i]), not ids")
        tensors["d2t"] = d2t.long()
    if t2d is not None:
        _shape(t2d, (vocab,), "t2d", fmt, path, "one flag per target token")
        tensors["t2d"] = t2d.bool()
    layer_ids, source_ids = _eagle3_layer_ids(fmt, config, notes)
    n_taps = len(layer_ids) if layer_ids else 3
    if fc.shape[1] % n_taps:
        raise InvalidInput(f"{path}: {fmt} fc.weight reads {fc.shape[1]} features, not a multiple of its "
                           f"{n_taps} target layers")
    target_hidden = config.get("target_hidden_size") or fc.shape[1] // n_taps
    if target_hidden * n_taps != fc.shape[1]:
        raise InvalidInput(f"{path}: {fmt} fc.weight reads {fc.shape[1]} features, expected {n_taps} layers x "
                           f"target_hidden_size={target_hidden}")
    if layer_ids is None and fmt == "eagle3-safeailab":
        notes.append("SafeAILab files name no layers: the target's [2, N//2, N-3] apply")
    flags = _eagle3_flags(path, fmt, config, tensors, n_taps, target_hidden, notes)
    num_layers = _layer_count(set(tensors))
    if lc.get("num_hidden_layers") not in (None, num_layers):
        notes.append(f"{where} says num_hidden_layers={lc['num_hidden_layers']}; the tensors hold {num_layers} "
                     f"layer(s), which is what counts")
    canonical = {**fields, "intermediate_size": tensors["layers.0.mlp.gate_proj.weight"].shape[0],
                 "vocab_size": int(vocab), "draft_vocab_size": int(draft_vocab), "target_hidden_size": int(target_hidden),
                 "layer_ids": layer_ids, "layer_ids_source": source_ids, "num_layers": num_layers, **flags,
                 "attention_bias": "layers.0.self_attn.q_proj.bias" in tensors,
                 "mlp_bias": "layers.0.mlp.gate_proj.bias" in tensors}
    embed = tensors.get("embed_tokens.weight")
    if embed is not None and bool(embed.isnan().any()):
        del tensors["embed_tokens.weight"]
        notes.append("embed_tokens holds NaN (the speculators package saves embeddings it never loaded so): "
                     "dropped, the target's are used")
    if "embed_tokens.weight" not in tensors:
        notes.append("no embed_tokens: the target's embeddings are used")
    if bool(lm_head.isnan().any()):
        raise InvalidInput(f"{path}: {fmt} tensor lm_head.weight holds NaN (expected trained weights; the speculators "
                           f"package saves an lm_head it never loaded from its verifier so)")
    return DrafterFiles(path=path, format=fmt, kind="eagle3", config=canonical, tensors=tensors, notes=notes)


def _eagle3_flags(path: Path, fmt: str, config: dict, tensors: dict[str, torch.Tensor], n_taps: int,
                  target_hidden: int, notes: list[str]) -> dict:
    """norm_before_residual, norm_before_fc, fc_norm and norm_output from the config, checked
    against the tensors they need."""
    if "norm_before_residual" in config:
        before_residual = bool(config["norm_before_residual"])
    else:
        before_residual = False
        notes.append("norm_before_residual absent: False applied (" +
                     ("the speculators package's default; vLLM's reader would apply True)"
                      if fmt == "eagle3-speculators" else "SafeAILab's forward keeps the un-normed residual)"))
    fc_norm_names = sorted(n for n in tensors if n.startswith("fc_norm."))
    fc_norm = bool(config.get("fc_norm", bool(fc_norm_names)))
    if fc_norm and "fc_norm" not in config:
        notes.append("fc_norm.* tensors without the fc_norm flag: fc_norm applied")
    if fc_norm:
        for i in range(n_taps):
            _shape(_need(tensors, f"fc_norm.{i}.weight", fmt, path, f"[{target_hidden}], the norm of target layer {i}"),
                   (target_hidden,), f"fc_norm.{i}.weight", fmt, path, "one norm per target layer")
    elif fc_norm_names:
        raise InvalidInput(f"{path}: {fmt} config.json sets fc_norm=false but the tensors hold {fc_norm_names[0]}")
    before_fc = bool(config.get("norm_before_fc", "input_norm.weight" in tensors))
    if before_fc and "norm_before_fc" not in config:
        notes.append("input_norm.weight without the norm_before_fc flag: norm_before_fc applied")
    if before_fc:
        _shape(_need(tensors, "input_norm.weight", fmt, path, f"[{n_taps * target_hidden}], the norm before fc"),
               (n_taps * target_hidden,), "input_norm.weight", fmt, path, "the joined target layers")
    elif "input_norm.weight" in tensors:
        raise InvalidInput(f"{path}: {fmt} config.json sets norm_before_fc=false but the tensors hold input_norm.weight")
    if before_fc and fc_norm:
        raise InvalidInput(f"{path}: {fmt} config.json sets both norm_before_fc and fc_norm; they exclude each other")
    return {"norm_before_residual": before_residual, "norm_before_fc": before_fc, "fc_norm": fc_norm,
            "norm_output": bool(config.get("norm_output", False))}


# ---- EAGLE-1/2 ------------------------------------------------------------------------------------


def _read_eagle(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> DrafterFiles:
    fmt, notes = "eagle-safeailab", []
    tensors = _unprefixed(tensors, notes)
    if not config:
        raise MissingInput(f"{path}: {fmt} drafter without config.json (expected the LlamaConfig fields "
                           f"hidden_size, num_attention_heads, vocab_size)")
    fc = tensors["fc.weight"]
    hidden = fc.shape[0]
    _shape(fc, (hidden, 2 * hidden), "fc.weight", fmt, path, "[H, 2H]: the joined embedding and feature")
    num_layers = _layer_count(set(tensors))
    if num_layers == 0:
        raise InvalidInput(f"{path}: {fmt} drafter without the tensors layers.0.* (expected at least one decoder "
                           f"layer after fc)")
    for i in range(num_layers):
        for part in EAGLE_LAYER + (("input_layernorm.weight",) if i else ()):
            _need(tensors, f"layers.{i}.{part}", fmt, path, "a Llama decoder layer" +
                  ("; layer 0 alone has no input_layernorm" if part == "input_layernorm.weight" else ""))
    if "layers.0.input_layernorm.weight" in tensors:
        notes.append("layer 0 carries input_layernorm.weight, which SafeAILab's forward skips")
    fields = _llama_fields(config, hidden, tensors["layers.0.self_attn.q_proj.weight"].shape[0],
                           tensors["layers.0.self_attn.k_proj.weight"].shape[0], fmt, path, "config.json", notes)
    if config.get("num_hidden_layers") not in (None, num_layers):
        notes.append(f"config.json says num_hidden_layers={config['num_hidden_layers']}; the tensors hold "
                     f"{num_layers} layer(s), which is what counts")
    fc_bias = "fc.bias" in tensors
    if "bias" in config and bool(config["bias"]) != fc_bias:
        notes.append(f"config.json says bias={config['bias']} but fc.bias is {'present' if fc_bias else 'absent'}: "
                     f"the tensors count")
    if fc_bias:
        _shape(tensors["fc.bias"], (hidden,), "fc.bias", fmt, path, "the draft hidden size")
    vocab = config.get("vocab_size")
    embed = tensors.get("embed_tokens.weight")
    if embed is not None:
        if vocab is not None and embed.shape[0] != vocab:
            raise InvalidInput(f"{path}: {fmt} embed_tokens.weight has {embed.shape[0]} rows but config.json says "
                               f"vocab_size={vocab}")
        vocab = vocab or embed.shape[0]
    else:
        notes.append("no embed_tokens: the target's embeddings are used")
    if vocab is None:
        raise InvalidInput(f"{path}: {fmt} config.json has no vocab_size (expected the target's vocabulary size)")
    attention_bias = "layers.0.self_attn.q_proj.bias" in tensors
    if "qkv_bias" in config and bool(config["qkv_bias"]) != attention_bias:
        notes.append(f"config.json says qkv_bias={config['qkv_bias']}; the tensors count")
    canonical = {**fields, "intermediate_size": tensors["layers.0.mlp.gate_proj.weight"].shape[0],
                 "vocab_size": int(vocab), "num_layers": num_layers, "fc_bias": fc_bias,
                 "attention_bias": attention_bias, "mlp_bias": "layers.0.mlp.gate_proj.bias" in tensors}
    return DrafterFiles(path=path, format=fmt, kind="eagle", config=canonical, tensors=tensors, notes=notes)


# ---- Medusa ---------------------------------------------------------------------------------------


def _medusa(path: Path, fmt: str, config: dict, blocks: dict[tuple[int, int], dict[str, torch.Tensor]],
            heads: dict[int, torch.Tensor], token_map: torch.Tensor | None, notes: list[str],
            said_heads: int | None, said_layers: int | None) -> DrafterFiles:
    """The canonical Medusa drafter from per-(head, layer) linear tensors and per-head output heads."""
    num_heads = max([h for h, _ in blocks] + list(heads)) + 1 if blocks or heads else 0
    if num_heads == 0:
        raise InvalidInput(f"{path}: {fmt} drafter without heads (expected at least one head's output head)")
    num_layers = max((ly for _, ly in blocks), default=-1) + 1
    tensors: dict[str, torch.Tensor] = {}
    hidden = None
    for h in range(num_heads):
        for ly in range(num_layers):
            if (h, ly) not in blocks or "weight" not in blocks[(h, ly)]:
                raise InvalidInput(f"{path}: {fmt} head {h} lacks layer {ly} of {num_layers} (expected every head "
                                   f"to hold the same number of residual blocks)")
            w = blocks[(h, ly)]["weight"]
            hidden = hidden or w.shape[0]
            _shape(w, (hidden, hidden), f"head {h} layer {ly} weight", fmt, path, "[H, H], a residual block")
            tensors[f"blocks.{h}.layers.{ly}.weight"] = w
            if "bias" in blocks[(h, ly)]:
                tensors[f"blocks.{h}.layers.{ly}.bias"] = blocks[(h, ly)]["bias"]
        if h not in heads:
            raise InvalidInput(f"{path}: {fmt} head {h} has no output head (expected its own [V, H] lm_head)")
        tensors[f"lm_heads.{h}.weight"] = heads[h]
    hidden = hidden or heads[0].shape[1]
    rows = heads[0].shape[0]
    for h in range(num_heads):
        _shape(heads[h], (rows, hidden), f"head {h}'s output head", fmt, path, "every head has the same [V, H]")
    biases = {("bias" in b) for b in blocks.values()}
    if len(biases) > 1:
        raise InvalidInput(f"{path}: {fmt} some residual blocks have a bias and some do not; expected all or none")
    if said_heads not in (None, num_heads):
        notes.append(f"config.json says {said_heads} heads; the tensors hold {num_heads}, which is what counts")
    if said_layers not in (None, num_layers):
        notes.append(f"config.json says {said_layers} layers per head; the tensors hold {num_layers}")
    if num_layers > 1 and all(torch.equal(tensors[f"blocks.{h}.layers.0.weight"], tensors[f"blocks.{h}.layers.{ly}.weight"])
                              for h in range(num_heads) for ly in range(1, num_layers)):
        notes.append("each head's layers are equal: FasterDecoding's [ResBlock] * L shares one block, kept per layer")
    truncated = None
    if token_map is not None:
        _shape(token_map, (rows,), "token_map", fmt, path, "one target id per output-head row")
        tensors["token_map"] = token_map.long()
        truncated = rows
    canonical = {"num_heads": num_heads, "num_layers": num_layers, "hidden_size": int(hidden),
                 "vocab_size": int(config.get("vocab_size") or rows) if truncated is None else config.get("vocab_size"),
                 "truncated_vocab_size": truncated, "bias": biases == {True},
                 "base_model": config.get("base_model_name_or_path") or config.get("name_or_path")}
    return DrafterFiles(path=path, format=fmt, kind="medusa", config=canonical, tensors=tensors, notes=notes)


def _read_medusa_fasterdecoding(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> DrafterFiles:
    fmt, notes = "medusa-fasterdecoding", []
    blocks: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    heads_l: dict[int, dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        if m := re.fullmatch(r"(\d+)\.(\d+)\.linear\.(weight|bias)", name):
            blocks.setdefault((int(m.group(1)), int(m.group(2))), {})[m.group(3)] = t
        elif m := re.fullmatch(r"(\d+)\.(\d+)\.weight", name):
            heads_l.setdefault(int(m.group(1)), {})[int(m.group(2))] = t
        else:
            raise InvalidInput(f"{path}: {fmt} tensor {name} is not a Medusa head's (expected "
                               f"{{h}}.{{l}}.linear.weight, {{h}}.{{l}}.linear.bias or {{h}}.{{L}}.weight)")
    heads: dict[int, torch.Tensor] = {}
    for h, by_index in heads_l.items():
        if len(by_index) != 1:
            raise InvalidInput(f"{path}: {fmt} head {h} has several output heads {sorted(by_index)} (expected one, "
                               f"{{h}}.{{L}}.weight after its L linear layers)")
        (index, weight), = by_index.items()
        layers = sorted(ly for hh, ly in blocks if hh == h)
        if layers != list(range(index)):
            raise InvalidInput(f"{path}: {fmt} head {h}'s output head is {h}.{index}.weight but its linear layers "
                               f"are {layers}; expected {h}.0 .. {h}.{index - 1}")
        heads[h] = weight
    if any(len(b) and "bias" not in b for b in blocks.values()):
        notes.append("FasterDecoding blocks without a bias (its ResBlock has one)")
    return _medusa(path, fmt, config, blocks, heads, None, notes, config.get("medusa_num_heads"),
                   config.get("medusa_num_layers"))


def _read_medusa_vllm(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> DrafterFiles:
    fmt, notes = "medusa-vllm", []
    blocks: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    heads: dict[int, torch.Tensor] = {}
    token_map = None
    for name, t in tensors.items():
        if m := re.fullmatch(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)", name):
            blocks.setdefault((int(m.group(1)), int(m.group(2))), {})[m.group(3)] = t
        elif m := re.fullmatch(r"lm_heads\.(\d+)\.weight", name):
            heads[int(m.group(1))] = t
        elif name == "token_map":
            token_map = t
        elif name != "lm_head.weight":
            raise InvalidInput(f"{path}: {fmt} tensor {name} is not a vLLM Medusa tensor (expected "
                               f"blocks.{{h}}.layers.{{l}}.weight, lm_heads.{{h}}.weight or token_map)")
    said_bias = config.get("medusa_fc_bias")
    has_bias = any("bias" in b for b in blocks.values())
    if said_bias is not None and bool(said_bias) != has_bias:
        notes.append(f"config.json says medusa_fc_bias={said_bias} but the blocks {'have' if has_bias else 'lack'} "
                     f"a bias: the tensors count")
    num_heads = config.get("num_heads")
    if config.get("original_lm_head") and not heads:
        shared = tensors.get("lm_head.weight")
        if shared is None:
            raise InvalidInput(f"{path}: {fmt} config.json sets original_lm_head but there is no lm_head.weight "
                               f"(expected the one output head all heads share)")
        count = num_heads or (max(h for h, _ in blocks) + 1)
        heads = dict.fromkeys(range(count), shared)
        notes.append("original_lm_head: every head shares lm_head.weight")
    if config.get("truncated_vocab_size") and token_map is None:
        notes.append(f"truncated_vocab_size={config['truncated_vocab_size']} without token_map: the heads' rows are "
                     f"the target's first ids")
    return _medusa(path, fmt, config, blocks, heads, token_map, notes, num_heads, config.get("num_hidden_layers"))


# ---- token maps -----------------------------------------------------------------------------------


def _apply_token_map(files: DrafterFiles, token_map: str | Path | torch.Tensor) -> None:
    """Restrict an EAGLE drafter to an FR-Spec token map: `d2t` from the sorted ids, and for an
    EAGLE-3 drafter whose head covers the whole vocabulary, those rows of its head."""
    if not isinstance(token_map, torch.Tensor):
        file = Path(token_map).expanduser()
        if not file.is_file():
            raise MissingInput(f"token map {file} does not exist; expected a .pt file of kept target ids")
        try:
            token_map = torch.load(str(file), map_location="cpu", weights_only=True)
        except Exception as err:  # pickle's and torch's errors
            raise InvalidInput(f"token map {file} cannot be read with weights_only=True ({err})") from None
        if not isinstance(token_map, torch.Tensor):
            raise InvalidInput(f"token map {file} holds a {type(token_map).__name__}, expected a 1-D tensor of ids")
    d2t = vocab_map_to_d2t(token_map)
    ids = torch.arange(d2t.numel()) + d2t
    vocab = files.config.get("vocab_size")
    if vocab is not None and d2t.numel() and int(ids.max()) >= vocab:
        raise InvalidInput(f"{files.path}: the token map holds id {int(ids.max())}, outside the vocabulary of {vocab}")
    if files.kind == "eagle":
        files.tensors["d2t"] = d2t
        files.config["draft_vocab_size"] = int(d2t.numel())
    elif files.kind == "eagle3" and files.config["draft_vocab_size"] == files.config["vocab_size"]:
        files.tensors["lm_head.weight"] = files.tensors["lm_head.weight"][ids]
        files.tensors["d2t"] = d2t
        files.config["draft_vocab_size"] = int(d2t.numel())
    else:
        raise InvalidInput(f"{files.path}: a token map applies to an EAGLE drafter whose head covers the whole "
                           f"vocabulary; this {files.format} drafter has its own vocabulary map")
    files.notes.append(f"token map of {d2t.numel()} ids applied as d2t")
