"""Train drafting heads (Medusa, an EAGLE-style drafter, or an EAGLE-3 drafter) for a target on its own
continuations of prompts this project writes, and of conversations read from local files.

    python scripts/train_heads.py [key=value ...]        # config: conf/train_heads.yaml

The recipe is in `specdec/train/head_training.py`. The script logs each phase's time, the loss as it
trains and the heads' held-out agreement with the target after every epoch, then decodes held-out
prompts with the trained heads against plain decoding (interleaved) and writes:

- `out` (a safetensors file): the checkpoint, which `method=<medusa|eagle> method.heads_path=<out>` loads;
  with kind=eagle3, the folder `out` less its `.safetensors` suffix, in the `speculators` format
  (`method=eagle3 method.heads_path=<folder>`, or `vllm serve <folder>`);
- `out` with `.json`: the report (data sizes, seed, command, curves, timings, decoding check),
  also in the Hydra run folder; with `logger=wandb` the same numbers and curves go to W&B.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from specdec.core import metrics
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.core.errors import InvalidInput, reported
from specdec.core.files import write_whole
from specdec.models import ModelSpec, cache_dir, load_model
from specdec.proposers.eagle import EagleDrafter, EagleProposer
from specdec.proposers.eagle3 import Eagle3Proposer
from specdec.proposers.export import export_speculators
from specdec.proposers.heads import (
    OutputHead,
    frequent_tokens,
    is_checkpoint,
    save_checkpoint,
    target_signature,
)
from specdec.proposers.medusa import DEFAULT_TREE, MedusaHeads, MedusaProposer
from specdec.study.config import resolve_path
from specdec.study.data import build_turn_input, load_builtin, load_spec_bench
from specdec.study.tracking import TRACKER_SETTINGS, make_tracker
from specdec.train.eagle3_training import (
    TrainingTimeTest,
    conversation_requests,
    draft_vocab,
    make_drafter,
    read_conversations,
    tap_features,
    train_eagle3,
    ttt_accuracy,
    ttt_sequence,
)
from specdec.train.head_training import (
    FamilyPlan,
    check_disjoint,
    eagle_accuracy,
    eagle_sequences,
    head_accuracy,
    medusa_labels,
    target_written_prompts,
    train_eagle,
    train_medusa,
    training_prompts,
    vocab_index,
)
from specdec.train.script_checks import (
    check_at_least,
    check_cache_folder,
    check_choice,
    check_dtype,
    check_out_dir,
    check_out_file,
    check_out_spares_target,
    checked,
)
from specdec.train.training import (
    Example,
    PhaseTimer,
    generate_continuations,
    load_cache,
    save_cache,
    teacher_targets,
    truncate,
)

log = logging.getLogger("train_heads")
METHODS = ("medusa", "eagle", "eagle3")
KINDS = (*METHODS, "corpus")  # corpus: no training; the target's answers as suffix decoding's datastore
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the verifier a speculators folder names for target=embedded
DEFAULT_RANKS = 1 + max(rank for path in DEFAULT_TREE for rank in path)  # what the decoding check's tree reads of a head
FAMILIES = ("written", "math", "qa", "follow_ups", "passages", "code", "derived")


def check_config(cfg: DictConfig) -> None:
    """The values a run cannot work with, and an `out` it must not write, refused before the target
    loads (InvalidInput naming the key: `Error: <message>` on the command line)."""
    check_choice("kind", cfg.kind, KINDS)
    p = cfg.prompts
    check_at_least("prompts.held_out", p.held_out, 1)
    if p.families:
        unknown = sorted(set(p.families) - set(FAMILIES))
        if unknown:
            raise InvalidInput(f"prompts.families: unknown {', '.join(unknown)}; the families are {', '.join(FAMILIES)}")
        for name in FAMILIES:
            check_at_least(f"prompts.families.{name}", p.families.get(name), 0, optional=name == "derived")
    else:
        check_at_least("prompts.count", p.count, 1)
        check_at_least("prompts.target_written", p.target_written, 0)
        if p.held_out >= p.count + p.target_written:
            raise InvalidInput(f"prompts.held_out={p.held_out}: must be below the {p.count + p.target_written} "
                               "prompts (prompts.count + prompts.target_written), which training needs too")
    check_at_least("generation.max_new_tokens", cfg.generation.max_new_tokens, 1)
    check_at_least("generation.batch_size", cfg.generation.batch_size, 1)
    check_at_least("heads.num_heads", cfg.heads.num_heads, 1)
    check_at_least("heads.vocab", cfg.heads.vocab, 1, optional=True)
    # The decoding check after training drafts with these: refused now, not after the training they end.
    if cfg.kind == "eagle":
        for key in ("budget", "topk", "width", "depth"):
            check_at_least(f"eagle.{key}", cfg.eagle[key], 1)
        if cfg.heads.vocab is not None and cfg.eagle.topk > cfg.heads.vocab:
            raise InvalidInput(f"eagle.topk={cfg.eagle.topk}: the drafter proposes from its heads.vocab={cfg.heads.vocab} "
                               "tokens; at most that many")
    elif cfg.kind == "eagle3":
        e3 = cfg.eagle3
        for key in ("budget", "topk", "width", "depth", "steps", "draft_vocab_size"):
            check_at_least(f"eagle3.{key}", e3[key], 1)
        check_at_least("eagle3.decay", e3.decay, 0, integer=False, strict=True)
        if e3.topk > e3.draft_vocab_size:
            raise InvalidInput(f"eagle3.topk={e3.topk}: the drafter proposes from its eagle3.draft_vocab_size="
                               f"{e3.draft_vocab_size} tokens; at most that many")
        ids = e3.layer_ids
        if ids is not None and (not ids or list(ids) != sorted(set(ids)) or min(ids) < 0):
            raise InvalidInput(f"eagle3.layer_ids={list(ids)}: distinct ascending output_hidden_states indices "
                               "(0..N for an N-layer target), or null for [2, N//2, N-3]")
    elif cfg.heads.vocab is not None and cfg.heads.vocab < DEFAULT_RANKS:
        raise InvalidInput(f"heads.vocab={cfg.heads.vocab}: Medusa's default tree takes each head's {DEFAULT_RANKS} "
                           f"likeliest tokens; at least {DEFAULT_RANKS}")
    t = cfg.train
    shortest = cfg.heads.num_heads + 2 if cfg.kind == "medusa" else 3
    check_at_least("train.max_seq_len", t.max_seq_len, shortest)
    check_at_least("train.epochs", t.epochs, 1)
    check_at_least("train.lr", t.lr, 0, integer=False, strict=True)
    check_at_least("train.max_tokens", t.max_tokens, 1)
    check_at_least("train.decay", t.decay, 0, integer=False, strict=True)
    check_choice("train.autocast", t.autocast, (None, "bfloat16", "float16"))
    check_at_least("train.unroll", t.unroll, 1)
    check_at_least("train.noise", t.noise, 0, integer=False)
    check_at_least("prompts.conversation_turns", p.get("conversation_turns", 1), 1)
    check_at_least("prompts.max_conversations", p.get("max_conversations"), 1, optional=True)
    for file in _conversation_files(cfg):
        if not resolve_path(file).is_file():
            raise InvalidInput(f"prompts.conversations: {file} is not a file; give local .json or .jsonl files of "
                               "conversations (ShareGPT's `conversations` or the `messages` list)")
    check_at_least("eval.prompts", cfg.eval.prompts, 1)
    if cfg.eval.prompts > p.held_out and cfg.kind != "corpus":  # kind=corpus has no decoding check
        raise InvalidInput(f"eval.prompts={cfg.eval.prompts}: the decoding check uses held-out prompts only; "
                           f"at most prompts.held_out={p.held_out}")
    check_at_least("eval.max_new_tokens", cfg.eval.max_new_tokens, 1)
    check_dtype("dtype", cfg.dtype)
    check_at_least("threads", cfg.threads, 1, optional=True)
    out = resolve_path(cfg.out)
    target = cfg.target.path
    keep = resolve_path(target) if target and target not in ("embedded", "tiny_random") else None
    if cfg.kind == "eagle3":
        check_out_dir(_eagle3_folder(out), cfg.overwrite, keep)
    elif cfg.kind == "corpus":
        check_out_file(out, ".jsonl", cfg.overwrite)
        check_out_spares_target(out, keep)
    else:
        check_out_file(out, ".safetensors", cfg.overwrite, companion="report .json")
        check_out_spares_target(out, keep, (".json",), is_checkpoint)
    if cfg.generation.cache:
        check_cache_folder(cache_dir() / "train_heads")


def _conversation_files(cfg: DictConfig) -> list[str]:
    files = cfg.prompts.get("conversations")
    if not files:
        return []
    return [files] if isinstance(files, str) else list(files)


def _eagle3_folder(out: Path) -> Path:
    """kind=eagle3 writes a folder: `out` less a `.safetensors` suffix (the default out's)."""
    return out.with_suffix("") if out.suffix == ".safetensors" else out


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run(cfg: DictConfig) -> dict:
    """The whole recipe; returns the report (also written beside the checkpoint)."""
    checked(check_config, cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    phase = PhaseTimer(log)
    times = phase.times

    model, tokenizer = load_model(ModelSpec(path=cfg.target.path, gguf_file=cfg.target.gguf_file))
    engine = Engine(model, dtype=cfg.dtype)
    target = engine.target.model
    try:  # what the heads need of the target (a decoder the head reads; EAGLE's layout), before the slow part
        engine.target.hidden_source()
        if cfg.kind == "eagle":
            EagleDrafter(target)
    except ValueError as err:
        raise InvalidInput(f"target.path={cfg.target.path}: {err}") from err
    eos = tokenizer.eos_token_id
    phase("load")

    # 1. prompts: written here, optionally by the target too; never an evaluation prompt
    # 2. data: the target's continuations of them, and its final hidden states over them
    evaluation = [turn for p in load_spec_bench() + load_builtin() for turn in p.turns]
    if cfg.prompts.families:
        texts, raw = _family_data(cfg, engine, tokenizer, eos, evaluation)
    else:
        texts = training_prompts(cfg.prompts.count, cfg.seed)
        if cfg.prompts.target_written:
            texts += target_written_prompts(lambda asks: _answers(engine, tokenizer, asks, eos),
                                            cfg.prompts.target_written, cfg.seed)
        check_disjoint(texts, evaluation)
        random.Random(cfg.seed).shuffle(texts)
        raw = None
    conv_texts, conv_raw = _conversation_data(cfg, engine, tokenizer, eos, evaluation)
    held_n = cfg.prompts.held_out
    if not 0 < held_n < len(texts) and cfg.kind != "corpus":
        raise InvalidInput(f"prompts.held_out={held_n} must be in [1, {len(texts) - 1}] for {len(texts)} prompts")
    if raw is None:
        prompt_ids = [build_turn_input(tokenizer, [], t) for t in texts]
        phase("prompts")
        raw = _continuations(cfg, engine, prompt_ids, eos)
    else:
        prompt_ids = [e.tokens[: e.start].tolist() for e in raw]
    texts, raw = texts + conv_texts, raw + conv_raw  # conversations train only: held-out prompts come first
    prompt_ids += [e.tokens[: e.start].tolist() for e in conv_raw]
    if cfg.kind == "corpus":
        return _write_corpus(cfg, prompt_ids, raw, phase)
    examples = [truncate(e, cfg.train.max_seq_len) for e in raw]
    starts = [e.start for e in examples]
    examples = [Example(e.tokens, 1) for e in examples]  # hidden states at every position
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    autocast = cfg.train.autocast if target.dtype == torch.float32 else None
    if cfg.kind == "eagle3":
        layer_ids = list(cfg.eagle3.layer_ids) if cfg.eagle3.layer_ids is not None else None
        text = target.config.get_text_config(decoder=True)
        if layer_ids is not None and max(layer_ids) > text.num_hidden_layers:
            raise InvalidInput(f"eagle3.layer_ids={layer_ids}: the target has {text.num_hidden_layers} layers "
                               f"(taps 0..{text.num_hidden_layers})")
        from specdec.proposers.eagle3 import default_layer_ids

        layer_ids = layer_ids or default_layer_ids(text.num_hidden_layers)
        features = tap_features(target, examples, layer_ids, cfg.train.max_tokens, pad, cfg.progress, autocast)
    else:
        teacher_targets(target, examples, cfg.train.max_tokens, pad, cfg.progress, autocast)
    train = examples[held_n:]
    train_tokens = sum(len(e.tokens) - s for e, s in zip(train, starts[held_n:]))
    phase("data")
    if cfg.kind == "eagle3":
        return _run_eagle3(cfg, engine, texts, prompt_ids, examples, features, starts, held_n, layer_ids,
                           train_tokens, eos, phase)

    # 3. vocabulary, 4. training
    vocab_size = target.get_output_embeddings().out_features
    vocab_ids = None
    if cfg.heads.vocab:
        vocab_ids = frequent_tokens([e.tokens[s:] for e, s in zip(train, starts[held_n:])], cfg.heads.vocab, vocab_size)
    head = OutputHead.of(target, vocab_ids, dtype=torch.float32)
    index = vocab_index(vocab_ids, vocab_size)
    train_kind = _train_medusa if cfg.kind == "medusa" else _train_eagle
    tensors, shape, losses, curve = train_kind(cfg, target, examples, starts, held_n, head, index)
    per_epoch = max(len(losses) // cfg.train.epochs, 1)
    loss_by_epoch = [sum(losses[i : i + per_epoch]) / len(losses[i : i + per_epoch])
                     for i in range(0, per_epoch * cfg.train.epochs, per_epoch)]
    log.info("loss by epoch: %s", [round(x, 3) for x in loss_by_epoch])
    phase("train")

    out = resolve_path(cfg.out)
    meta = {"hidden_size": target.config.get_text_config(decoder=True).hidden_size, "vocab_size": vocab_size, **shape,
            "target": str(cfg.target.path), "seed": cfg.seed, "train_prompts": len(train),
            "train_tokens": train_tokens, "command": " ".join(sys.argv)}
    if vocab_ids is not None:
        tensors["vocab_ids"] = vocab_ids
    out.with_suffix(".json").unlink(missing_ok=True)  # overwrite=true: never an old report beside new heads
    save_checkpoint(out, cfg.kind, {n: t.to(torch.bfloat16) if t.is_floating_point() else t
                                      for n, t in tensors.items()}, {**meta, "target_signature": target_signature(target)})
    phase("save")

    # 5. the checkpoint as a method, on held-out prompts, against plain decoding
    if cfg.kind == "medusa":
        proposer, depth = MedusaProposer(engine, str(out)), cfg.heads.num_heads
    else:
        proposer, depth = EagleProposer(engine, str(out), **cfg.eagle), cfg.eagle.depth
    check = _decode_check(engine, proposer, depth, prompt_ids[: min(cfg.eval.prompts, held_n)],
                          cfg.eval.max_new_tokens, eos)
    log.info("decoding held-out prompts: %s", check)
    phase("decode_check")

    report = {**meta, "held_out_prompts": held_n, "prompts": texts, "vocab": len(vocab_ids) if vocab_ids is not None else vocab_size, "loss_by_epoch": loss_by_epoch,
              "loss_steps": losses, "held_out_curve": curve, "decode_check": check, "seconds": times,
              "total_s": round(sum(times.values()), 1), "config": OmegaConf.to_container(cfg, resolve=True)}
    text = json.dumps(report, indent=2)
    out.with_suffix(".json").write_text(text)
    run_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else out.parent
    (run_dir / "train_report.json").write_text(text)
    plots = _plots(losses, curve, run_dir)
    lg = cfg.logger
    settings = {k: lg.get(k) for k in TRACKER_SETTINGS}
    settings["tags"] = list(settings["tags"] or [])
    with make_tracker(lg.kind, **settings) as tracker:
        tracker.start(report["config"], f"train_heads-{cfg.kind}", "train_heads", run_dir)
        tracker.log_summary({k: v for k, v in report.items() if k not in ("loss_steps", "config")}, [], plots)
    log.info("heads saved to %s (use them with method=%s method.heads_path=%s); %.0f s in all",
             out, cfg.kind, cfg.out, report["total_s"])
    return report


def _run_eagle3(cfg, engine, texts, prompt_ids, examples, features, starts, held_n, layer_ids, train_tokens, eos,
                phase) -> dict:
    """kind=eagle3 from the taps on: the draft vocabulary, the training-time test, the speculators
    folder, the decoding check and the report (rank 0 alone writes under torchrun)."""
    target, times = engine.target.model, phase.times
    e3 = cfg.eagle3
    vocab_size = target.get_output_embeddings().out_features
    train_text = [e.tokens[s:] for e, s in zip(examples[held_n:], starts[held_n:])]
    vocab_ids, d2t, t2d = draft_vocab(train_text, e3.draft_vocab_size, vocab_size)
    covered = sum(int(t2d[x].sum()) for x in train_text) / max(sum(len(x) for x in train_text), 1)
    log.info("draft vocabulary: %d tokens, %.1f%% of the training answers' tokens", len(vocab_ids), 100 * covered)
    drafter = make_drafter(target, layer_ids, vocab_ids, d2t)
    sequences = [ttt_sequence(e, f, s, cfg.train.prompt_labels) if len(e.tokens) > 2 else None
                 for e, f, s in zip(examples, features, starts)]
    held = [x for x in sequences[:held_n] if x is not None]
    train = [x for x in sequences[held_n:] if x is not None]
    ttt = TrainingTimeTest(drafter, target.get_input_embeddings(), OutputHead.of(target, vocab_ids, torch.float32),
                           t2d, e3.steps, e3.decay)
    curve = [ttt_accuracy(ttt, held, cfg.train.max_tokens)]
    log.info("held out before training: top-1 per step %s", curve[-1]["top1_per_step"])

    def on_epoch(epoch: int) -> None:
        curve.append(ttt_accuracy(ttt, held, cfg.train.max_tokens))
        log.info("held out after epoch %d: top-1 per step %s", epoch + 1, curve[-1]["top1_per_step"])

    losses = train_eagle3(ttt, train, cfg.train.epochs, cfg.train.lr, cfg.train.max_tokens, cfg.seed, cfg.progress,
                          cfg.train.autocast, on_epoch)
    per_epoch = max(len(losses) // cfg.train.epochs, 1)
    loss_by_epoch = [sum(losses[i : i + per_epoch]) / len(losses[i : i + per_epoch])
                     for i in range(0, per_epoch * cfg.train.epochs, per_epoch)]
    log.info("loss by epoch: %s", [round(x, 3) for x in loss_by_epoch])
    phase("train")
    if _rank() != 0:
        return {"loss_steps": losses}

    folder = _eagle3_folder(resolve_path(cfg.out))
    path = str(cfg.target.path)
    verifier = EMBEDDED_HUB_ID if path == "embedded" else None if path == "tiny_random" else str(resolve_path(path))
    saved = (drafter.config, {n: t.to(torch.bfloat16) if t.is_floating_point() else t
                              for n, t in drafter.state_dict().items()})
    report_file = folder.with_suffix(".json")
    report_file.unlink(missing_ok=True)  # overwrite=true: never an old report beside a new drafter
    export_speculators(saved, folder, verifier, speculative_tokens=e3.depth)
    phase("save")

    proposer = Eagle3Proposer(engine, str(folder), e3.budget, e3.topk, e3.width, e3.depth, layer_ids)
    check = _decode_check(engine, proposer, e3.depth, prompt_ids[: min(cfg.eval.prompts, held_n)],
                          cfg.eval.max_new_tokens, eos)
    log.info("decoding held-out prompts: %s", check)
    phase("decode_check")
    report = {"kind": "eagle3", "folder": str(folder), "target": path, "seed": cfg.seed, "layer_ids": layer_ids,
              "draft_vocab_size": len(vocab_ids), "draft_vocab_coverage": round(covered, 4),
              "train_prompts": len(train), "train_tokens": train_tokens, "held_out_prompts": held_n,
              "command": " ".join(sys.argv), "prompts": texts, "loss_by_epoch": loss_by_epoch, "loss_steps": losses,
              "held_out_curve": curve, "decode_check": check, "seconds": times,
              "total_s": round(sum(times.values()), 1), "config": OmegaConf.to_container(cfg, resolve=True)}
    text = json.dumps(report, indent=2)
    report_file.write_text(text)
    run_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else folder.parent
    (run_dir / "train_report.json").write_text(text)
    log.info("drafter saved to %s (use it with method=eagle3 method.heads_path=%s); %.0f s in all",
             folder, folder, report["total_s"])
    return report


def _write_corpus(cfg: DictConfig, prompt_ids: list[list[int]], examples: list[Example], phase) -> dict:
    """kind=corpus: every prompt and the target's answer to it, one JSON object per line, as suffix
    decoding's datastore (`method.proposer.corpus`, `specdec.proposers.suffix.Corpus`). Held-out prompts
    included: none is an evaluation prompt (`check_disjoint`)."""
    out = resolve_path(cfg.out)
    lines = [json.dumps({"prompt_token_ids": ids, "output_token_ids": e.tokens[e.start :].tolist()})
             for ids, e in zip(prompt_ids, examples)]
    write_whole(out, lambda tmp: tmp.write_text("\n".join(lines) + "\n"))
    phase("save")
    tokens = sum(len(e.tokens) - e.start for e in examples)
    report = {"kind": "corpus", "out": str(out), "sequences": len(lines), "tokens": tokens,
              "times_s": dict(phase.times), "command": " ".join(sys.argv)}
    log.info("corpus of %d answers (%d tokens) saved to %s (use it with method=suffix method.proposer.corpus=%s)",
             len(lines), tokens, out, out)
    return report


def _conversation_data(cfg: DictConfig, engine, tokenizer, eos, evaluation: list[str]) -> tuple[list[str], list[Example]]:
    """The conversations of `prompts.conversations` (local JSON/JSONL files), each user turn among
    the first `prompts.conversation_turns` answered again by the target after the file's earlier
    turns: (user turns, examples)."""
    files = _conversation_files(cfg)
    if not files:
        return [], []
    limit = cfg.prompts.get("max_conversations")
    conversations = [c for f in files for c in read_conversations(resolve_path(f), limit)]
    requests = conversation_requests(conversations, cfg.prompts.get("conversation_turns", 1))
    check_disjoint([turn for _, history, user in requests for turn in [*(u for u, _ in history), user]], evaluation)
    ids = [build_turn_input(tokenizer, history, user, system) for system, history, user in requests]
    log.info("conversations: %d from %d files, %d turns for the target to answer", len(conversations), len(files),
             len(requests))
    return [user for _, _, user in requests], _continuations(cfg, engine, ids, eos)


def _train_medusa(cfg, target, examples, starts, held_n, head, index):
    """Medusa heads on the examples' hidden states -> (tensors, shape, losses, held-out curve)."""
    k = cfg.heads.num_heads
    labels = [medusa_labels(e, s, k, index) for e, s in zip(examples, starts)]
    heads = MedusaHeads(target.config.get_text_config(decoder=True).hidden_size, k)
    held, held_labels = examples[:held_n], labels[:held_n]
    curve = [head_accuracy(heads, head, held, held_labels)]
    log.info("held out before training: %s", _fmt(curve[-1]))

    def on_epoch(epoch: int) -> None:
        curve.append(head_accuracy(heads, head, held, held_labels))
        log.info("held out after epoch %d: %s", epoch + 1, _fmt(curve[-1]))

    losses = train_medusa(heads, head, examples[held_n:], labels[held_n:], cfg.train.epochs, cfg.train.lr,
                          cfg.train.max_tokens, cfg.train.decay, cfg.seed, cfg.progress, cfg.train.autocast, on_epoch)
    return dict(heads.state_dict()), {"num_heads": k}, losses, curve


def _train_eagle(cfg, target, examples, starts, held_n, head, index):
    """The EAGLE-style drafter on the examples' hidden states -> (tensors, shape, losses, held-out curve)."""
    full_head = OutputHead.of(target) if cfg.train.prompt_labels else None
    sequences = [eagle_sequences(e, s, index, full_head) if len(e.tokens) > 2 else None for e, s in zip(examples, starts)]
    held = [x for x in sequences[:held_n] if x is not None]
    train = [x for x in sequences[held_n:] if x is not None]
    drafter = EagleDrafter(target)
    embed = target.get_input_embeddings()
    curve = [eagle_accuracy(drafter, embed, head, held)]
    log.info("held out before training: %s", _fmt(curve[-1]))

    def on_epoch(epoch: int) -> None:
        curve.append(eagle_accuracy(drafter, embed, head, held))
        log.info("held out after epoch %d: %s", epoch + 1, _fmt(curve[-1]))

    losses = train_eagle(drafter, embed, head, train, cfg.train.epochs, cfg.train.lr,
                         cfg.train.max_tokens, cfg.seed, cfg.progress, cfg.train.autocast, on_epoch,
                         cfg.train.unroll, cfg.train.noise)
    return dict(drafter.state_dict()), {"num_layers": 1}, losses, curve


def _family_data(cfg: DictConfig, engine, tokenizer, eos, evaluation: list[str]) -> tuple[list[str], list[Example]]:
    """The staged task families (`FamilyPlan`): each stage's requests are checked against the
    evaluation prompts, answered by the target, and its answers make the next stage's requests.
    Returns the last user turns and the examples, shuffled with the seed (held-out ones first)."""
    fam = cfg.prompts.families
    plan = FamilyPlan(fam.written, fam.math, fam.qa, fam.follow_ups, fam.passages, fam.code, fam.get("derived"),
                      cfg.seed)
    texts, examples, answers = [], [], []
    while requests := plan.stage(answers):
        check_disjoint([turn for history, user in requests for turn in [*(u for u, _ in history), user]], evaluation)
        ids = [build_turn_input(tokenizer, history, user) for history, user in requests]
        new = _continuations(cfg, engine, ids, eos)
        answers = [tokenizer.decode(e.tokens[e.start :], skip_special_tokens=True) for e in new]
        texts += [user for _, user in requests]
        examples += new
        log.info("stage %d: %d requests (%s), %d new tokens", plan.step, len(requests),
                 ", ".join(f"{k} {plan.kinds.count(k)}" for k in dict.fromkeys(plan.kinds)),
                 sum(len(e.tokens) - e.start for e in new))
    order = list(range(len(texts)))
    random.Random(cfg.seed).shuffle(order)
    return [texts[i] for i in order], [examples[i] for i in order]


def _answers(engine, tokenizer, asks: list[str], eos, max_new_tokens: int = 40) -> list[str]:
    """The target's greedy answers to `asks` (used to let it write instructions)."""
    ids = [build_turn_input(tokenizer, [], a) for a in asks]
    out = SpeculativeDecoder(engine, tokenizer=tokenizer, eos_token_id=eos).generate(ids, max_new_tokens=max_new_tokens)
    return out.texts


def _continuations(cfg: DictConfig, engine, prompt_ids: list[list[int]], eos) -> list[Example]:
    """The target's greedy continuations. With `generation.cache` they are kept per prompt under
    $SPECDEC_CACHE/train_heads (one file per target, dtype and length), so a rerun, or a run with
    more prompts, generates only the prompts it has not seen."""
    key = hashlib.sha256(json.dumps([cfg.target.path, cfg.target.gguf_file, str(engine.dtype),
                                     cfg.generation.max_new_tokens]).encode()).hexdigest()[:16]
    path = cache_dir() / "train_heads" / f"continuations-{key}.pt"
    store: dict[str, list[int]] = (load_cache(path, log) if cfg.generation.cache and path.is_file() else None) or {}
    names = [hashlib.sha256(json.dumps(ids).encode()).hexdigest() for ids in prompt_ids]
    missing = [i for i, name in enumerate(names) if name not in store]
    log.info("continuations: %d cached, %d to generate", len(names) - len(missing), len(missing))
    if missing:
        new = generate_continuations(engine, [prompt_ids[i] for i in missing], cfg.generation.max_new_tokens,
                                     cfg.generation.batch_size, eos, cfg.progress)
        for i, example in zip(missing, new):
            store[names[i]] = example.tokens[example.start :].tolist()
        if cfg.generation.cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_cache(store, path)
    return [Example(torch.tensor(ids + store[name]), len(ids)) for ids, name in zip(prompt_ids, names)]


def _decode_check(engine, proposer, depth: int, prompt_ids: list[list[int]], max_new_tokens: int, eos) -> dict:
    """Plain decoding and the heads, interleaved prompt by prompt (order alternating), after a warm-up."""
    plain = SpeculativeDecoder(engine, eos_token_id=eos)
    heads = SpeculativeDecoder(engine, proposer, num_speculative_tokens=depth, eos_token_id=eos)
    plain.generate(prompt_ids[:1], max_new_tokens=8)
    heads.generate(prompt_ids[:1], max_new_tokens=8)
    wall = {"plain": 0.0, "heads": 0.0}
    tokens = {"plain": 0, "heads": 0}
    steps, emitted, equal = 0, 0, 0
    for i, ids in enumerate(prompt_ids):
        pair = {}
        for name in (("plain", "heads") if i % 2 == 0 else ("heads", "plain")):
            pair[name] = (plain if name == "plain" else heads).generate([ids], max_new_tokens=max_new_tokens)
            wall[name] += pair[name].stats.wall_s
            tokens[name] += len(pair[name].output_ids[0])
        steps += pair["heads"].stats.steps
        emitted += sum(r.emitted for r in pair["heads"].stats.rows)
        equal += pair["heads"].output_ids == pair["plain"].output_ids
    rate = {n: metrics.tokens_per_s(tokens[n], wall[n]) for n in wall}
    return {"prompts": len(prompt_ids), "mean_accepted_length": metrics.mean_accepted_length(emitted, steps),
            "speedup": metrics.speedup(rate["heads"], rate["plain"]), "tokens_per_s": rate["heads"],
            "baseline_tokens_per_s": rate["plain"], "equal_to_plain": equal / len(prompt_ids)}


def _plots(losses: list[float], curve: list[dict], run_dir: Path) -> dict[str, Path]:
    """The loss per step and the held-out chain acceptance per epoch, as PNG files in `run_dir`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.plot(losses)
    left.set(xlabel="step", ylabel="loss", title="training loss")
    if "top1" in curve[0]:
        right.plot([c["top1"] for c in curve], marker="o", label="depth 1")
    else:
        for d in range(len(curve[0]["chain_acceptance"])):
            right.plot([c["chain_acceptance"][d] for c in curve], marker="o", label=f"depth {d + 1}")
    right.set(xlabel="epoch", ylabel="held-out agreement", title="top-1 agreement with the target")
    right.legend()
    fig.tight_layout()
    path = run_dir / "train_curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return {"train_curves": path}


def _fmt(acc: dict) -> str:
    if "top1" in acc:
        return f"top-1 {acc['top1']:.3f}"
    return ("top-1 per head " + " ".join(f"{x:.2f}" for x in acc["top1_per_head"])
            + " | chain " + " ".join(f"{x:.2f}" for x in acc["chain_acceptance"]))


@hydra.main(config_path="../conf", config_name="train_heads", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with reported():  # bad input ends the command as `Error: <message>`, without a traceback
        run(cfg)


if __name__ == "__main__":
    main()
