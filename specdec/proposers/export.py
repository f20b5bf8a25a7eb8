"""EAGLE-3 drafters written in the field's formats, so a drafter trained or read by specdec serves
elsewhere: `export_speculators` (a `speculators` folder, which vLLM serves with `vllm serve <folder>`
and the `speculators` package loads) and `export_safeailab` (SafeAILab's `midlayer.*` layout, read by
the EAGLE repository, TensorRT-LLM and SGLang).

The source is anything with a canonical config and tensors (`formats.py`): a `DrafterFiles`, an
`Eagle3Drafter` (its `config` and `state_dict()`), or a `(config, tensors)` pair. Layer ids are
canonical `output_hidden_states` indices, which is vLLM's and the `speculators` package's
convention, so they are written as they are. Every norm flag is written out: readers disagree on
the default of a missing `norm_before_residual` (FORMATS.md 1.4).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdec.core.errors import InvalidInput
from specdec.core.files import write_whole

# The schema version written; the one the reference test checks against the package.
SPECULATORS_VERSION = "0.9.0"

CANONICAL_PREFIXES = ("fc.", "layers.", "norm.", "lm_head.", "embed_tokens.", "fc_norm.", "input_norm.")


def _config_and_tensors(source) -> tuple[dict, dict[str, torch.Tensor]]:
    """(canonical config, canonical tensors) of a DrafterFiles, an Eagle3Drafter or a pair."""
    if isinstance(source, tuple) and len(source) == 2:
        config, tensors = source
    elif isinstance(source, torch.nn.Module):
        config, tensors = source.config, dict(source.state_dict())
    elif hasattr(source, "config") and hasattr(source, "tensors"):
        if getattr(source, "kind", "eagle3") != "eagle3":
            raise InvalidInput(f"only EAGLE-3 drafters are exported; this one is {source.kind} ({source.path})")
        config, tensors = source.config, source.tensors
    else:
        raise InvalidInput(f"export takes a DrafterFiles, an Eagle3Drafter or a (config, tensors) pair, "
                           f"not a {type(source).__name__}")
    kept = {k: v.detach().contiguous().cpu() for k, v in tensors.items()
            if k.startswith(CANONICAL_PREFIXES) or k in ("d2t", "t2d")}
    if "d2t" in kept and config.get("draft_vocab_size") == config.get("vocab_size") and not bool(kept["d2t"].any()):
        del kept["d2t"]  # an identity map over the whole vocabulary: the files carry none
    return dict(config), kept


def _vocab_maps(config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """d2t and t2d where the draft vocabulary is reduced: t2d is made from d2t when absent."""
    vocab, draft = config["vocab_size"], config["draft_vocab_size"]
    if draft == vocab:
        return
    if "d2t" not in tensors:
        raise InvalidInput(f"a drafter with a draft vocabulary of {draft} of the target's {vocab} tokens needs d2t")
    if "t2d" not in tensors:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[torch.arange(draft) + tensors["d2t"].long()] = True
        tensors["t2d"] = t2d


def _write(out_dir: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_whole(out_dir / "model.safetensors", lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    write_whole(out_dir / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2) + "\n"))
    return out_dir


def _layer_config(config: dict, dtype: torch.dtype) -> dict:
    """The Llama fields of the drafter layer, as transformers writes a LlamaConfig."""
    rope = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    if config.get("rope_scaling"):
        rope = {**config["rope_scaling"], "rope_theta": config["rope_theta"]}
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": config["hidden_size"],
            "num_hidden_layers": config.get("num_layers", 1), "num_attention_heads": config["num_attention_heads"],
            "num_key_value_heads": config["num_key_value_heads"], "head_dim": config["head_dim"],
            "intermediate_size": config["intermediate_size"], "vocab_size": config["vocab_size"],
            "rms_norm_eps": config["rms_norm_eps"], "max_position_embeddings": config["max_position_embeddings"],
            "rope_parameters": rope, "hidden_act": "silu", "attention_bias": bool(config.get("attention_bias")),
            "mlp_bias": bool(config.get("mlp_bias")), "tie_word_embeddings": False,
            "dtype": str(dtype).removeprefix("torch.")}


def export_speculators(source, out_dir: str | Path, verifier_name: str | None = None, *,
                       verifier_architectures: list[str] | None = None, speculative_tokens: int = 3,
                       embed_tokens: torch.Tensor | None = None) -> Path:
    """Write `source` (an EAGLE-3 drafter, module docstring) as a `speculators` folder:
    config.json in the package's schema and model.safetensors with the canonical names.
    `verifier_name`: the target's hub id or path, which vLLM loads as the verifier;
    `speculative_tokens`: the default number of draft tokens vLLM reads; `embed_tokens`: [V, H]
    the target's embeddings, written when the drafter has none (the package reads them from the
    verifier otherwise). Returns the folder."""
    config, tensors = _config_and_tensors(source)
    if embed_tokens is not None and "embed_tokens.weight" not in tensors:
        tensors["embed_tokens.weight"] = embed_tokens.detach().contiguous().cpu()
    _vocab_maps(config, tensors)
    dtype = tensors["fc.weight"].dtype
    out = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": _layer_config(config, dtype),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name,
                         "architectures": list(verifier_architectures or ["LlamaForCausalLM"])}},
        "draft_vocab_size": config["draft_vocab_size"],
        "target_hidden_size": config.get("target_hidden_size"),
        "eagle_aux_hidden_state_layer_ids": config.get("layer_ids"),
        "norm_before_residual": bool(config.get("norm_before_residual")),
        "norm_before_fc": bool(config.get("norm_before_fc")),
        "fc_norm": bool(config.get("fc_norm")),
        "norm_output": bool(config.get("norm_output")),
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
    }
    return _write(Path(out_dir).expanduser(), out, tensors)


def export_safeailab(source, out_dir: str | Path) -> Path:
    """Write `source` (an EAGLE-3 drafter) in SafeAILab's layout: `midlayer.*` names, a flat
    LlamaConfig with draft_vocab_size and target_hidden_size. SafeAILab's files name no target
    layers and its forward keeps the un-normed residual, so a drafter with other layer ids, or
    with norm_before_residual or the EAGLE-3.1 norms, is refused: those files could not say it."""
    config, tensors = _config_and_tensors(source)
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if config.get(flag):
            raise InvalidInput(f"SafeAILab's EAGLE-3 files cannot express {flag}=true; export it with "
                               f"export_speculators instead")
    if config.get("layer_ids") is not None:
        raise InvalidInput(f"SafeAILab's EAGLE-3 files name no target layers, so layer_ids={config['layer_ids']} "
                           f"would be lost (readers use [2, N//2, N-3]); export it with export_speculators instead")
    _vocab_maps(config, tensors)
    tensors = {("midlayer." + k[len("layers.0."):]) if k.startswith("layers.0.") else k: v
               for k, v in tensors.items() if k != "embed_tokens.weight"}
    layer = _layer_config(config, tensors["fc.weight"].dtype)
    out = {**{k: v for k, v in layer.items() if k != "rope_parameters"}, "rope_theta": config["rope_theta"],
           "num_hidden_layers": 1, "draft_vocab_size": config["draft_vocab_size"],
           "target_hidden_size": config.get("target_hidden_size")}
    if config.get("rope_scaling"):
        out["rope_scaling"] = config["rope_scaling"]
    return _write(Path(out_dir).expanduser(), out, tensors)
