"""Which Hugging Face causal LMs specdec decodes token-identically to transformers, and which it refuses.

Each model type in transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, and each config variant in
VARIANTS, is built tiny and random (seed 0): its default config's sizes shrunk by name (for a
multimodal wrapper, its text config; the other sub-configs get one small layer), with 3 layers, else
4, 6 or the default count when `layer_types` has more kinds or a build fails. transformers' greedy
`generate()` gives the reference: 12 new tokens for each of 3 prompts (13, 2 and 7 tokens), each
alone. specdec decodes them with plain decoding and with self-drafting (`DraftModelProposer` on the
target, k = 3), at batch 1 and as one ragged batch of 3. Classes: MATCH (all four runs give the
reference), REFUSED (`Engine` raised an `InvalidInput` such as `UnsupportedModelError`), CRASH (any
other error in specdec), MISMATCH (other tokens), SKIP (not built at that size, or transformers' own
`generate()` failed; `AttentionLayout.of` is then asked about the default config on a meta-device
skeleton). Types run in a worker subprocess, replaced after a hard crash, each stopped after
--timeout-s. `TYPE:key=json,...` adds config overrides.

`--paths` runs each type through other decoding paths too (default `eager`, the four runs above):
`compiled`, the same four runs under `compile=on` through dynamo's `eager` backend (graph capture,
guards and static shapes without kernels, as tests/accel/test_compile.py compiles), each also required to
have run its passes compiled (else UNCOMPILED); `medusa`, two untrained Medusa heads; `eagle`, an
EAGLE drafter copied from the target (budget 4, top-2, width 2, depth 2); both ragged, k = 2;
`medusa_compiled`, `eagle_compiled`, the same under `compile=on` (the target's tree passes, Medusa's
guesses, EAGLE's drafter), each compiled caller required to have run compiled; `medusa_trained`,
`eagle_trained`, the heads or drafter first trained briefly on the target's own text as
scripts/train_heads.py trains them (`train_briefly`: its loss must fall); `layer_skip` and `cut_draft`,
the target's first layer drafting (k = 3, ragged) as a layer-skip view and as the draft train_draft
starts from; `bf16`, exact greedy in
bfloat16: the type built again 8x as wide (WIDE), self-drafting against plain decoding of the same
batches, 32 tokens, batch 1 and ragged. A clean refusal as the proposer is built (`InvalidInput`,
`ValueError`) is REFUSED. Each path's class is in
the record's `classes`, its runs under `paths`; `--from-results` takes the types an earlier sweep
found MATCH.

    python experiments/architectures/sweep.py --out experiments/architectures/results.jsonl \\
        --table experiments/architectures/table.md --timeout-s 200
    python experiments/architectures/sweep.py --from-results experiments/architectures/results.jsonl \\
        --paths compiled,medusa,eagle --out experiments/architectures/paths.jsonl \\
        --table experiments/architectures/paths_table.md --timeout-s 300
    python experiments/architectures/sweep.py --from-results experiments/architectures/results.jsonl \\
        --paths medusa_compiled,eagle_compiled --out experiments/architectures/trees_compiled.jsonl \\
        --table experiments/architectures/trees_compiled_table.md --timeout-s 300
    python experiments/architectures/sweep.py --from-results experiments/architectures/results.jsonl \\
        --paths medusa_trained,eagle_trained --out experiments/architectures/trained.jsonl \\
        --table experiments/architectures/trained_table.md --timeout-s 300
    python experiments/architectures/sweep.py --from-results experiments/architectures/results.jsonl \\
        --paths layer_skip,cut_draft --out experiments/architectures/layer_skip.jsonl \\
        --table experiments/architectures/layer_skip_table.md --timeout-s 300
    python experiments/architectures/sweep.py --from-results experiments/architectures/results.jsonl \\
        --paths bf16 --out experiments/architectures/bf16.jsonl --table experiments/architectures/bf16_table.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging as hf_logging

from specdec.accel.compiled import CompiledForward
from specdec.accel.passes import Accelerated
from specdec.core.attention import AttentionLayout
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.core.errors import InvalidInput
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.eagle import EagleDrafter, EagleProposer
from specdec.proposers.heads import OutputHead, save_checkpoint
from specdec.proposers.layer_skip import LayerSkipProposer
from specdec.proposers.medusa import MedusaHeads, MedusaProposer
from specdec.train.head_training import eagle_sequences, medusa_labels, train_eagle, train_medusa, vocab_index
from specdec.train.training import Example, generate_continuations, make_draft, teacher_targets

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3, 4], [20, 21, 22, 23, 24, 25, 26]]
NEW_TOKENS = 12
VOCAB = 128
CLASSES = ("MATCH", "REFUSED", "CRASH", "MISMATCH", "UNCOMPILED", "SKIP")
# The decoding paths a type can be run through (--paths): `eager` is the four runs above; `compiled` the
# same four under compile=on (dynamo's eager backend: graph capture, guards and static shapes, no
# kernels); `medusa` and `eagle` the token-tree methods (untrained heads, a drafter copied from the
# target), ragged, k = 2; `_compiled` under compile=on, `_trained` after brief training; `layer_skip` and
# `cut_draft` the target's first layer as its draft (a view; train_draft's starting draft); `bf16` exact greedy.
PATHS = ("eager", "compiled", "medusa", "eagle", "medusa_compiled", "eagle_compiled", "medusa_trained",
         "eagle_trained", "layer_skip", "cut_draft", "bf16")
VARIANTS = [
    *(f"{t}:is_decoder=true" for t in ("bert", "roberta", "xmod", "electra", "big_bird")),  # encoders as decoders
    "xlm:causal=true",  # XLM's own causal mode
    "moshi:sliding_window=256",  # a window as long as the context
    "deepseek_v2:num_key_value_heads=2",  # latent attention with fewer key heads than query heads
]
# The bf16 path's models: 8x as wide (512, heads of 64), where bfloat16's rounding depends on the shape
# of the pass that scored a token (at width 64 a pass of 1 and one of 8 round alike, and the check
# would pass with exact greedy off), and 32 new tokens a prompt.
WIDE = {
    **{k: 512 for k in ("hidden_size", "n_embd", "d_model", "dim", "embed_dim")},
    **{k: 1024 for k in ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "inner_hidden_size")},
    **{k: 8 for k in ("num_attention_heads", "n_head", "n_heads", "num_heads")},
    **{k: 64 for k in ("head_dim", "kv_channels", "attention_head_dim")},
}
BF16_NEW_TOKENS = 32
BF16_EXACT_GREEDY = True  # --exact-greedy off: the ablation, each pass scored at its own width
NOT_BUILT = {"blt": "not built: its full-size default sub-configs run out of memory (the worker is killed)"}
# Set wherever the (text) config has the field: common sizes, encoder-decoder stacks, per-layer inputs
# (Gemma-3n), mixture of experts, latent attention (MLA), state-space, recurrent and local attention.
SIZES = {
    "vocab_size": VOCAB, "hidden_size": 64, "n_embd": 64, "d_model": 64, "dim": 64, "embed_dim": 64,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "intermediate_size": 128,
    "ffn_dim": 128, "n_inner": 128, "ffn_hidden_size": 128, "inner_hidden_size": 128, "head_dim": 16,
    "kv_channels": 16, "attention_head_dim": 16, "max_position_embeddings": 256, "n_positions": 256,
    "n_ctx": 256, "seq_length": 256, "max_seq_len": 256, "initializer_range": 0.1, "init_std": 0.1,
    "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None, "decoder_start_token_id": None,
    "tie_word_embeddings": False, "rotary_dim": 8,
    "decoder_layers": 3, "encoder_layers": 2, "decoder_attention_heads": 4, "encoder_attention_heads": 4,
    "decoder_ffn_dim": 128, "encoder_ffn_dim": 128, "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
    "moe_num_experts": 4, "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "moe_k": 2,
    "num_selected_experts": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32, "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16, "qk_head_dim": 16, "state_size": 8, "mamba_d_state": 8,
    "ssm_state_size": 8, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_head_dim": 16, "mamba_expand": 2,
    "n_mamba_heads": 2, "time_step_rank": 8, "conv_kernel": 4, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "lru_width": 64,
    "attention_window_size": 4, "sliding_window": 4,
}
SUB_SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "depth": 1,
             "num_attention_heads": 2, "num_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "embed_dim": 32}
KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num")
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
# A field the config's validation rejects is dropped (back to its default) and the build retried.
REJECTED_FIELD = (r"Validation error for field '(\w+)'", r"property '(\w+)' of '\w+' object has no setter")


class Skip(Exception):
    """The model could not be built, or transformers could not decode it: the type is a SKIP."""


class Timeout(BaseException):
    """A type ran past --timeout-s (not an Exception, so that no `except Exception` swallows it)."""


def parse_type(spec: str) -> tuple[str, dict]:
    """`bert:is_decoder=true,x=2` -> ("bert", {"is_decoder": True, "x": 2})."""
    model_type, _, extra = spec.partition(":")
    return model_type, {k: json.loads(v) for k, v in (item.split("=", 1) for item in extra.split(",") if item)}


def has(obj, name: str) -> bool:
    """hasattr that takes a property raising anything (some per-layer ones do) as absent."""
    try:
        return hasattr(obj, name)
    except Exception:  # noqa: BLE001
        return False


def first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:300] if lines else ''}"


def where(err: BaseException) -> str:
    """The innermost three frames of the traceback, innermost first."""
    frames = reversed(traceback.extract_tb(err.__traceback__)[-3:])
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames)


def shrink_kwargs(text, n_layers: int | None, overrides: dict, wide: bool = False) -> dict | None:
    """Fields that make the config `text` tiny with `n_layers` layers (None: the default count), or None
    when its `layer_types` has more distinct kinds than `n_layers`; `wide`: at WIDE's sizes."""
    kw = {k: v for k, v in (SIZES | WIDE if wide else SIZES).items() if has(text, k)}
    mla = has(text, "kv_lora_rank")  # latent attention: one key per head, as in the released checkpoints
    kw.update({k: 4 if mla else 2 for k in KV_HEADS if has(text, k)})
    if mla:
        kw["head_dim"] = kw["qk_rope_head_dim"]
    kw.update({k: n_layers for k in LAYERS if has(text, k) and n_layers is not None})
    kw.update(overrides)
    kinds = getattr(text, "layer_types", None) if has(text, "layer_types") else None
    if n_layers is not None and isinstance(kinds, (list, tuple)) and kinds:
        distinct, head = list(dict.fromkeys(kinds)), list(kinds[:n_layers])
        if len(distinct) > n_layers:
            return None
        # the pattern's first layers if they hold every kind, else each kind once and then the pattern's start
        kw["layer_types"] = head if set(head) == set(distinct) else distinct + head[:n_layers - len(distinct)]
    return kw


def make_config(model_type: str, default, text, kw: dict):
    """`model_type`'s config with `kw` set on its text config (`text`, found in `default`)."""
    if text is default:
        return AutoConfig.for_model(model_type, **kw)
    text_key = next(k for k in default.sub_configs if getattr(default, k, None) is text)
    subs = {text_key: type(text)(**{**text.to_dict(), **kw})}
    for key in default.sub_configs:  # a wrapper's other parts (vision, audio, ...): small
        other = getattr(default, key, None)
        if key != text_key and other is not None and hasattr(other, "to_dict"):
            subs[key] = type(other)(**{**other.to_dict(), **{k: v for k, v in SUB_SIZES.items() if has(other, k)}})
    config = AutoConfig.for_model(model_type, **subs)
    for key in ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings"):
        if hasattr(config, key) and key in kw:
            setattr(config, key, kw[key])
    return config


def build(model_type: str, overrides: dict, max_params: int, wide: bool = False):
    """A tiny random model (seed 0), its attention implementation (SDPA, else eager) and notes;
    `wide`: at WIDE's sizes."""
    default = AutoConfig.for_model(model_type)
    text = default.get_text_config()
    errors = []
    for n_layers in (3, 4, 6, None):
        kw = shrink_kwargs(text, n_layers, overrides, wide)
        for _ in range(6 if kw is not None else 0):  # each try may drop one rejected field
            model = None
            try:
                config = make_config(model_type, default, text, kw)
                for impl in ("sdpa", "eager"):
                    try:
                        torch.manual_seed(0)
                        model = AutoModelForCausalLM.from_config(config, attn_implementation=impl)
                        break
                    except (ValueError, ImportError, NotImplementedError) as err:
                        errors.append(f"{impl}: {first_line(err)[:150]}")
            except Exception as err:  # noqa: BLE001
                found = [m.group(1) for p in REJECTED_FIELD if (m := re.search(p, str(err)))]
                if found and found[0] in kw and found[0] not in overrides:
                    kw.pop(found[0])
                    continue
                errors.append(f"L={n_layers}: {first_line(err)[:200]}")
            if model is None:
                break
            n_params = sum(p.numel() for p in model.parameters())
            if n_params > max_params:
                raise Skip(f"build: too big after shrinking ({n_params / 1e6:.0f}M params)")
            return model, impl, ["default layer count kept"] if n_layers is None else []
    raise Skip("build: " + "; ".join(errors[-2:]))


def prepare(model):
    """float32 eval mode, an output head wide enough for varied greedy tokens, no special tokens."""
    model = model.eval().requires_grad_(False).float()
    head = model.get_output_embeddings()
    if head is not None and hasattr(head, "weight"):
        head.weight.normal_(0.0, 3.0 / head.weight.shape[1] ** 0.5)
    for key in ("eos_token_id", "bos_token_id", "forced_eos_token_id", "forced_bos_token_id"):
        if hasattr(model.generation_config, key):
            setattr(model.generation_config, key, None)
    model.generation_config.pad_token_id = 0
    if hasattr(model, "set_default_language"):  # X-MOD: adapters per language
        model.set_default_language("en_XX")
    return model


def reference(model) -> list[list[int]]:
    """transformers' greedy tokens for each prompt alone."""
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, pad_token_id=0)
        out.append(gen[0, len(prompt):].tolist())
    return out


def probe(model_type: str) -> str:
    """What AttentionLayout.of says about the default config, on a meta-device skeleton (no weights)."""
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type), attn_implementation="eager")
    except Exception as err:  # noqa: BLE001
        return "probe could not build: " + first_line(err)[:150]
    try:
        return f"default config accepted: {sorted(set(AttentionLayout.of(model).layer_types))}"
    except InvalidInput as err:
        return "default config refused: " + str(err).split(": ", 1)[-1][:160]
    except Exception as err:  # noqa: BLE001
        return "default config crashes AttentionLayout.of: " + first_line(err)


def _engine(model, draft, compiled: bool) -> Engine:
    """An engine in float32; `compiled`: compile=on through dynamo's `eager` backend (as
    tests/accel/test_compile.py compiles), with dynamo's caches emptied first, so that graphs of an earlier
    type count toward no recompilation limit."""
    engine = Engine(model, draft, dtype="float32", passes=Accelerated(compile="on" if compiled else "off"))
    if compiled:
        torch._dynamo.reset()
        for m in (engine.target, engine.draft):
            if m is not None:
                m.compiled = CompiledForward(m, backend="eager")
    return engine


def _uncompiled(engine: Engine) -> dict | None:
    """The run entry for a compile=on engine whose callers (some of them) ran no pass compiled, or
    compiled no graph (then the run did not test the compiled path); None when all did."""
    report = engine.compile_report() or {}
    eager_only = [name for name, r in report.items() if r["compiled_calls"] == 0 or r["graphs"] == 0]
    return {"uncompiled": f"no pass ran compiled: {', '.join(eager_only)}", "report": report} if eager_only else None


def _failure(err: Exception, stage: str, refusals: tuple[type, ...] = (InvalidInput,)) -> dict:
    """The record of `stage` (`Engine()`, the proposer) raising `err`: REFUSED for a clean refusal
    (`refusals`), CRASH for anything else."""
    if isinstance(err, refusals):
        return {"cls": "REFUSED", "why": f"{type(err).__name__}: {err}"}
    return {"cls": "CRASH", "why": f"{stage}: " + first_line(err), "where": where(err)}


def _decode(decoder: SpeculativeDecoder, mode: str, new_tokens: int) -> list[list[int]]:
    """Each prompt's new tokens, the prompts decoded one at a time (`b1`) or as one ragged batch."""
    batches = [[p] for p in PROMPTS] if mode == "b1" else [PROMPTS]
    return [ids for b in batches for ids in decoder.generate(b, max_new_tokens=new_tokens).output_ids]


def decode_runs(model, ref, compiled: bool = False) -> dict:
    """Plain decoding and self-drafting, at batch 1 and ragged, against `ref`: the class and outcomes
    (`compiled`: under compile=on, each run also checked to have run its passes compiled)."""
    runs = {}
    for drafter in ("plain", "self"):
        try:
            engine = _engine(model, model if drafter == "self" else None, compiled)
        except Exception as err:  # noqa: BLE001
            return _failure(err, "Engine()")
        decoder = (SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=3)
                   if drafter == "self" else SpeculativeDecoder(engine))
        for mode in ("b1", "ragged"):
            try:
                got = _decode(decoder, mode, NEW_TOKENS)
                runs[f"{drafter}/{mode}"] = "ok" if got == ref else {"got": got}
            except Exception as err:  # noqa: BLE001
                runs[f"{drafter}/{mode}"] = {"crash": first_line(err), "where": where(err)}
        if compiled and (entry := _uncompiled(engine)):
            runs[f"{drafter}/compiled"] = entry
    return {"runs": runs, "cls": classify(runs)}


def classify(runs: dict) -> str:
    """MISMATCH (a run gave other tokens), CRASH (one raised), UNCOMPILED (the reference tokens, but a
    compile=on engine ran every pass of a model eagerly), else MATCH."""
    bad = [v for v in runs.values() if v != "ok"]
    if any("got" in v for v in bad):
        return "MISMATCH"
    return "CRASH" if any("crash" in v for v in bad) else "UNCOMPILED" if bad else "MATCH"


def tree_run(model, ref, method: str, workdir: str, compiled: bool = False, trained: bool = False) -> dict:
    """Medusa (untrained heads, 2 of them) or EAGLE (a drafter copied from the target's last layer) on
    the ragged batch, k = 2, against `ref`; `compiled`: under compile=on (the target's tree passes, Medusa's
    guesses, EAGLE's drafter), each compiled caller required to have run compiled; `trained`: the heads
    or drafter trained first (`train_briefly`), whose loss must fall. A clean refusal as the engine or
    the proposer is built (`InvalidInput`, `ValueError`) is REFUSED."""
    try:
        engine = _engine(model, None, compiled)
    except Exception as err:  # noqa: BLE001
        return _failure(err, "Engine()")
    path = os.path.join(workdir, f"{method}.safetensors")
    hidden = model.config.get_text_config(decoder=True).hidden_size
    runs = {}
    try:
        engine.target.hidden_source()  # a model without one is refused before anything is trained
        module, meta = (MedusaHeads(hidden, 2), {"num_heads": 2}) if method == "medusa" else (EagleDrafter(model), {})
    except Exception as err:  # noqa: BLE001
        return _failure(err, "proposer", refusals=(InvalidInput, ValueError))
    if trained:
        try:
            losses = train_briefly(engine, module, method)
            runs[f"{method}/training"] = "ok" if losses[-1] < losses[0] else {"crash": f"the loss did not fall: {losses}"}
        except Exception as err:  # noqa: BLE001
            runs[f"{method}/training"] = {"crash": first_line(err), "where": where(err)}
            return {"runs": runs, "cls": classify(runs)}
    try:
        save_checkpoint(path, method, module.state_dict(), {"hidden_size": hidden, "vocab_size": VOCAB, **meta})
        proposer = (MedusaProposer(engine, path) if method == "medusa"
                    else EagleProposer(engine, path, budget=4, topk=2, width=2, depth=2))
    except Exception as err:  # noqa: BLE001
        return _failure(err, "proposer", refusals=(InvalidInput, ValueError))
    try:
        got = SpeculativeDecoder(engine, proposer, num_speculative_tokens=2).generate(
            PROMPTS, max_new_tokens=NEW_TOKENS).output_ids
        runs[f"{method}/ragged"] = "ok" if got == ref else {"got": got}
    except Exception as err:  # noqa: BLE001
        runs[f"{method}/ragged"] = {"crash": first_line(err), "where": where(err)}
    if compiled and (entry := _uncompiled(engine)):
        runs[f"{method}/compiled"] = entry
    return {"runs": runs, "cls": classify(runs)}


def train_briefly(engine: Engine, module: torch.nn.Module, method: str, epochs: int = 3) -> list[float]:
    """Train Medusa heads or an EAGLE drafter `module` as scripts/train_heads.py does, briefly: on the
    target's greedy continuations (16 tokens) of 12 random prompts, its hidden states from the teacher
    pass, the whole vocabulary, the output head with its bias; returns the loss of every step."""
    model = engine.target.model
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=rng).tolist()
               for n in torch.randint(4, 12, (12,), generator=rng)]
    examples = [Example(e.tokens, 1) for e in generate_continuations(engine, prompts, 16, 6, None, progress=False)]
    teacher_targets(model, examples, 512, 0, progress=False)
    head = OutputHead.of(model, None, dtype=torch.float32)
    index = vocab_index(None, head.weight.shape[0])
    starts = [len(p) for p in prompts]
    with torch.enable_grad():
        if method == "medusa":
            labels = [medusa_labels(e, s, module.num_heads, index) for e, s in zip(examples, starts)]
            return train_medusa(module, head, examples, labels, epochs, 3e-3, 256, progress=False)
        sequences = [eagle_sequences(e, s, index, head) for e, s in zip(examples, starts)]
        return train_eagle(module, model.get_input_embeddings(), head, sequences, epochs, 3e-3, 256, progress=False)


def first_layer_run(model, ref, path: str) -> dict:
    """The target's first layer as its draft, k = 3, ragged, against `ref`: `layer_skip`, the
    layer-skip view (`early_exit_view`, sharing the target's weights); `cut_draft`, the draft
    train_draft starts from (`make_draft`, a one-layer model of the target's class, untrained). A
    layout they cannot cut is REFUSED as the proposer or the draft is built."""
    try:
        if path == "layer_skip":
            engine = _engine(model, None, False)
            proposer = LayerSkipProposer(engine, exit_layer=1)
        else:
            engine = _engine(model, make_draft(model, 1).eval().requires_grad_(False), False)
            proposer = DraftModelProposer(engine)
    except Exception as err:  # noqa: BLE001
        return _failure(err, "proposer")
    try:
        got = SpeculativeDecoder(engine, proposer, num_speculative_tokens=3).generate(
            PROMPTS, max_new_tokens=NEW_TOKENS).output_ids
        runs = {f"{path}/ragged": "ok" if got == ref else {"got": got}}
    except Exception as err:  # noqa: BLE001
        runs = {f"{path}/ragged": {"crash": first_line(err), "where": where(err)}}
    return {"runs": runs, "cls": classify(runs)}


def bf16_runs(spec: str, max_params: int) -> dict:
    """Exact greedy in bfloat16: on the type built again at WIDE's sizes, in bfloat16, self-drafting
    (k = 3) must give plain decoding's tokens, at batch 1 and ragged (each against plain decoding of the
    same batches). Both score every pass at one width over the whole cache buffer (`exact_greedy`, on
    by default), so a token's logits do not depend on the pass that scored it; transformers' float32
    reference does not apply (bfloat16 rounds otherwise)."""
    model_type, overrides = parse_type(spec)
    try:
        model = prepare(build(model_type, overrides, max_params, wide=True)[0])
    except Skip as skip:
        return {"cls": "SKIP", "why": f"wide model: {skip}"}
    except Exception as err:  # noqa: BLE001
        return {"cls": "SKIP", "why": "wide model: " + first_line(err)}
    try:
        engine = Engine(model, model, dtype="bfloat16")
    except Exception as err:  # noqa: BLE001
        return _failure(err, "Engine()")
    plain = SpeculativeDecoder(engine, exact_greedy=BF16_EXACT_GREEDY)
    spec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=3,
                              exact_greedy=BF16_EXACT_GREEDY)
    runs = {}
    for mode in ("b1", "ragged"):
        try:
            want, got = _decode(plain, mode, BF16_NEW_TOKENS), _decode(spec, mode, BF16_NEW_TOKENS)
            runs[f"self/{mode}"] = "ok" if got == want else {"got": got, "want": want}
        except Exception as err:  # noqa: BLE001
            runs[f"self/{mode}"] = {"crash": first_line(err), "where": where(err)}
    return {"runs": runs, "cls": classify(runs)}


def run_path(spec: str, model, ref, path: str, max_params: int) -> dict:
    """One decoding path's record: its class and runs (or why it was refused or crashed)."""
    if path in ("eager", "compiled"):
        return decode_runs(model, ref, compiled=path == "compiled")
    if path == "bf16":
        return bf16_runs(spec, max_params)
    if path in ("layer_skip", "cut_draft"):
        return first_layer_run(model, ref, path)
    method, _, variant = path.partition("_")
    with tempfile.TemporaryDirectory() as workdir:
        return tree_run(model, ref, method, workdir, compiled=variant == "compiled", trained=variant == "trained")


def check_type(spec: str, max_params: int = 100_000_000, paths: tuple[str, ...] = ("eager",)) -> dict:
    """The record of one `TYPE[:key=json,...]`, checked in this process on each of `paths`. The eager
    path's class, runs and reason are the record's `cls`, `runs`, `why` (and `where`); every path's,
    the eager one's too, are under `paths` (its class in `classes`). Without the eager path `cls` is
    the worst class of the paths run (`overall`)."""
    start = time.time()
    model_type, overrides = parse_type(spec)
    res = {"type": spec}
    try:
        if model_type in NOT_BUILT:
            raise Skip(NOT_BUILT[model_type])
        try:
            model, impl, notes = build(model_type, overrides, max_params)
        except Skip:
            raise
        except Exception as err:  # noqa: BLE001
            raise Skip("config: " + first_line(err)) from err
        res.update(impl=impl, model_class=type(model).__name__, notes=notes)
        model = prepare(model)
        try:
            ref = reference(model)
        except Exception as err:  # noqa: BLE001
            res["where"] = where(err)
            raise Skip("reference generate failed: " + first_line(err)) from err
    except Skip as skip:
        return {**res, "cls": "SKIP", "why": str(skip), "probe": probe(model_type)}
    res.update(ref=ref, degenerate=[len(set(r)) == 1 for r in ref])
    try:
        layout = AttentionLayout.of(model)
        res["layout"] = [layout.layer_types, layout.sliding_window, layout.cache_kwarg]
    except Exception as err:  # noqa: BLE001
        res["layout"] = first_line(err)
    per_path = {}
    for path in paths:
        try:
            per_path[path] = run_path(spec, model, ref, path, max_params)
        except Exception as err:  # noqa: BLE001
            per_path[path] = {"cls": "CRASH", "why": "sweep: " + first_line(err), "where": where(err)}
    res.update(per_path.get("eager", {"cls": overall(per_path)}))
    res["classes"] = {path: r["cls"] for path, r in per_path.items()}
    if paths != ("eager",):
        res["paths"] = per_path
    return {**res, "secs": round(time.time() - start, 1)}


def overall(per_path: dict) -> str:
    """The worst class among paths: MISMATCH, then CRASH, UNCOMPILED, MATCH, REFUSED, then SKIP (all skipped)."""
    classes = {r["cls"] for r in per_path.values()}
    return next((c for c in ("MISMATCH", "CRASH", "UNCOMPILED", "MATCH", "REFUSED") if c in classes), "SKIP")


def worker(types: list[str], timeout_s: int, max_params: int, paths: tuple[str, ...] = ("eager",)) -> None:
    """Check `types` in turn, printing {"start": type} and then its record, one JSON line each."""
    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)

    def on_alarm(*_):
        raise Timeout(f"over {timeout_s}s")

    signal.signal(signal.SIGALRM, on_alarm)
    for spec in types:
        print(json.dumps({"start": spec}), flush=True)
        signal.alarm(timeout_s)
        try:
            res = check_type(spec, max_params, paths)
        except Timeout as err:
            res = {"type": spec, "cls": "SKIP", "why": f"timeout {err}"}
        except Exception as err:  # noqa: BLE001
            res = {"type": spec, "cls": "CRASH", "why": "sweep: " + first_line(err), "where": where(err)}
        finally:
            signal.alarm(0)
        print(json.dumps(res), flush=True)


def sweep(types: list[str], out: str, timeout_s: int, max_params: int,
          paths: tuple[str, ...] = ("eager",)) -> list[dict]:
    """Check `types` in worker subprocesses, appending each record to `out` and printing a line for it; a
    worker that dies is replaced, and the type it was on is a SKIP."""
    rows, todo = [], list(types)

    def record(res: dict) -> None:
        with open(out, "a") as f:
            f.write(json.dumps(res) + "\n")
        todo.remove(res["type"])
        rows.append(res)
        if paths == ("eager",):
            print(f"{res['type']:34s} {res['cls']:9s} {reason(res)[:110]}", flush=True)
        else:
            classes = " ".join(f"{p}={c}" for p, c in path_classes(res, paths).items())
            print(f"{res['type']:34s} {classes} {path_reasons(res)[:110]}", flush=True)

    while todo:
        cmd = [sys.executable, __file__, "--worker", f"--timeout-s={timeout_s}", f"--max-params={max_params}",
               f"--paths={','.join(paths)}", f"--exact-greedy={'on' if BF16_EXACT_GREEDY else 'off'}", *todo]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        current, left = None, len(todo)
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:  # anything else a model printed
                continue
            if "start" in msg:
                current = msg["start"]
            elif "cls" in msg:
                current = None
                record(msg)
        rc = proc.wait()
        if current is not None:
            record({"type": current, "cls": "SKIP", "why": f"worker died (rc {rc})"})
        elif len(todo) == left:
            raise SystemExit(f"the worker exited with {rc} before checking any type")
    return rows


def reason(res: dict) -> str:
    """A record's (or one path's record's) class in one short line."""
    why = res.get("why", "")
    if res["cls"] == "REFUSED":  # "...Error: specdec cannot run model type 'x' (Class): REASON; use/set ..."
        why = why.split("): ", 1)[-1].split("; use a model", 1)[0].split("; set is_decoder", 1)[0]
    elif res["cls"] == "SKIP" and res.get("probe"):
        why = f"{why} [{res['probe']}]"
    elif res["cls"] in ("CRASH", "MISMATCH", "UNCOMPILED") and "runs" in res:
        bad = {k: v for k, v in res["runs"].items() if v != "ok"}
        kinds = sorted({"crash: " + v["crash"] if "crash" in v else v["uncompiled"] if "uncompiled" in v
                        else "other tokens" for v in bad.values()})
        why = f"{', '.join(bad)}: {'; '.join(kinds)}"
    elif res["cls"] == "MATCH" and any(res.get("degenerate", ())):
        why = f"{sum(res['degenerate'])} reference row(s) a single repeated token"
    return why.replace("|", "/").replace("\n", " ")


def path_classes(res: dict, paths: tuple[str, ...]) -> dict[str, str]:
    """Each path's class in a record (a SKIP, or a type refused by the engine, has it for every path)."""
    return {p: res.get("classes", {}).get(p, res["cls"]) for p in paths}


def path_reasons(res: dict) -> str:
    """The reasons of the paths that did not MATCH, each named, or the record's own reason."""
    if "paths" not in res:
        return reason(res)
    parts = [f"{p}: {reason(r)}" for p, r in res["paths"].items() if r["cls"] != "MATCH"]
    return "; ".join(parts) if parts else reason(res)


def write_table(rows: list[dict], path: str, paths: tuple[str, ...] = ("eager",)) -> None:
    """Markdown: the counts per class (per path), then model type -> class (per path) and reason."""
    if paths == ("eager",):
        counts = Counter(r["cls"] for r in rows)
        lines = ["| class | types |", "|---|---:|", *(f"| {c} | {counts[c]} |" for c in CLASSES if counts[c]),
                 f"| total | {len(rows)} |", "", "| model type | class | reason |", "|---|---|---|"]
        lines += [f"| `{r['type']}` | {r['cls']} | {reason(r)} |" for r in rows]
    else:
        counts = {p: Counter(path_classes(r, paths)[p] for r in rows) for p in paths}
        lines = ["| class | " + " | ".join(paths) + " |", "|---|" + "---:|" * len(paths),
                 *(f"| {c} | " + " | ".join(str(counts[p][c]) for p in paths) + " |"
                   for c in CLASSES if any(counts[p][c] for p in paths)),
                 "| total | " + " | ".join(str(len(rows)) for _ in paths) + " |", "",
                 "| model type | " + " | ".join(paths) + " | reason |", "|---|" + "---|" * (len(paths) + 1)]
        lines += [f"| `{r['type']}` | " + " | ".join(path_classes(r, paths).values()) + f" | {path_reasons(r)} |"
                  for r in rows]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def parse_paths(text: str) -> tuple[str, ...]:
    paths = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise argparse.ArgumentTypeError(f"--paths: {', '.join(unknown) or 'none given'}; choose from {', '.join(PATHS)}")
    return paths


def main(argv: list[str] | None = None) -> list[dict] | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("types", nargs="*", help="TYPE or TYPE:key=json,... (default: every causal LM type and VARIANTS)")
    ap.add_argument("--out", default="results.jsonl", help="JSON lines, one record per type (overwritten)")
    ap.add_argument("--table", default=None, help="markdown table of model type -> class and reason")
    ap.add_argument("--timeout-s", type=int, default=200, help="per type")
    ap.add_argument("--max-params", type=int, default=100_000_000, help="a larger shrunk model is a SKIP")
    ap.add_argument("--paths", type=parse_paths, default=("eager",),
                    help=f"comma-separated decoding paths to run each type through, of {', '.join(PATHS)}")
    ap.add_argument("--from-results", default=None,
                    help="check the types whose eager class is MATCH in this results.jsonl (instead of every type)")
    ap.add_argument("--update", action="store_true",
                    help="keep --out's records and replace (or add) those of the types checked now; the counts "
                         "and --table then cover the whole file (rerun a few types after a fix)")
    ap.add_argument("--exact-greedy", choices=("on", "off"), default="on",
                    help="the bf16 path's decoders: off is the ablation (each pass scored at its own width)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.update and not args.types:
        ap.error("--update needs the types to check again")
    global BF16_EXACT_GREEDY
    BF16_EXACT_GREEDY = args.exact_greedy == "on"
    if args.worker:
        return worker(args.types, args.timeout_s, args.max_params, args.paths)
    if args.from_results:
        with open(args.from_results) as f:
            matched = [r["type"] for r in map(json.loads, f) if r.get("classes", {}).get("eager", r["cls"]) == "MATCH"]
        types = [t for t in args.types if t in matched] if args.types else matched
    else:
        types = args.types or [*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *VARIANTS]
    kept = []
    if args.update and os.path.exists(args.out):
        with open(args.out) as f:
            kept = [json.loads(line) for line in f if line.strip()]
    # With --update the records stream to a file beside --out, which keeps its records until the merge:
    # a sweep stopped midway loses none of them.
    stream = args.out + ".new" if args.update else args.out
    open(stream, "w").close()
    start = time.time()
    rows = sorted(sweep(types, stream, args.timeout_s, args.max_params, args.paths),
                  key=lambda r: types.index(r["type"]))
    print(f"{len(rows)} types in {time.time() - start:.0f} s")
    if args.update:  # the earlier records in their order, those checked now in their places or after them
        fresh = {r["type"]: r for r in rows}
        rows = [fresh.pop(r["type"], r) for r in kept] + list(fresh.values())
        with open(args.out + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(args.out + ".tmp", args.out)
        os.remove(stream)
    for p in args.paths:
        counts = Counter(path_classes(r, args.paths)[p] for r in rows)
        print(f"  {p}:", ", ".join(f"{c} {counts[c]}" for c in CLASSES))
    if args.table:
        write_table(rows, args.table, args.paths)
    return rows


if __name__ == "__main__":
    main()
