"""Train a draft for a target by distillation on the target's own greedy continuations.

    python scripts/train_draft.py [key=value ...]        # config: conf/train_draft.yaml

The recipe and the draft's shape are described in `specdec/train/training.py`. The script prints each
phase's progress and time, the KL loss as it trains, and finally the trained draft's acceptance and speedup
on held-out Spec-Bench prompts (with `eval.init=true` the untrained draft's too); it writes the draft to `out` (a directory
that `draft.path=` loads) with `train_report.json` beside the weights. Weights are never committed:
`outputs/` is git-ignored.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from specdec.core.engine import Engine
from specdec.core.errors import InvalidInput, MissingInput, reported
from specdec.models import ModelSpec, cache_dir, load_model
from specdec.study.config import resolve_path
from specdec.study.data import load_builtin, load_spec_bench
from specdec.train.script_checks import (
    check_at_least,
    check_cache_folder,
    check_choice,
    check_dtype,
    check_out_dir,
    checked,
)
from specdec.train.training import (
    Example,
    PhaseTimer,
    distill,
    evaluate_draft,
    first_turn_ids,
    generate_continuations,
    load_cache,
    make_draft,
    save_cache,
    save_draft,
    split_prompts,
    take_per_category,
    teacher_targets,
    truncate,
)

log = logging.getLogger("train_draft")


def check_config(cfg: DictConfig) -> None:
    """The values a run cannot work with, and an `out` it must not write, refused before the target
    loads (InvalidInput naming the key: `Error: <message>` on the command line)."""
    p = cfg.prompts
    if isinstance(p.spec_bench, str) and not resolve_path(p.spec_bench).is_file():
        raise MissingInput(f"prompts.spec_bench={p.spec_bench}: file not found (true reads the questions "
                           "shipped in the package; a path, another file in Spec-Bench's question.jsonl format)")
    check_at_least("prompts.holdout_per_category", p.holdout_per_category, 0)
    check_at_least("prompts.train_per_category", p.train_per_category, 1, optional=True)
    check_at_least("prompts.eval_per_category", p.eval_per_category, 0, optional=True)
    check_at_least("generation.max_new_tokens", cfg.generation.max_new_tokens, 1)
    check_at_least("generation.batch_size", cfg.generation.batch_size, 1)
    check_dtype("generation.dtype", cfg.generation.dtype)
    check_at_least("draft.num_layers", cfg.draft.num_layers, 1)
    t = cfg.train
    check_at_least("train.max_seq_len", t.max_seq_len, 2)
    check_choice("train.loss_on", t.loss_on, ("all", "continuation"))
    check_at_least("train.epochs", t.epochs, 1)
    check_at_least("train.lr", t.lr, 0, integer=False, strict=True)
    check_at_least("train.max_tokens", t.max_tokens, 1)
    check_choice("train.autocast", t.autocast, (None, "bfloat16", "float16"))
    check_at_least("eval.k", cfg.eval.k, 1)
    check_at_least("eval.max_new_tokens", cfg.eval.max_new_tokens, 1)
    check_dtype("dtype", cfg.dtype)
    check_at_least("threads", cfg.threads, 1, optional=True)
    target = cfg.target.path
    keep = resolve_path(target) if target and target not in ("embedded", "tiny_random") else None
    check_out_dir(resolve_path(cfg.out), cfg.overwrite, keep)
    if cfg.generation.cache:
        check_cache_folder(cache_dir() / "train_draft")


def run(cfg: DictConfig) -> dict:
    """The whole recipe; returns the report (also written next to the draft)."""
    checked(check_config, cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    phase = PhaseTimer(log)
    times = phase.times

    p = cfg.prompts
    cmap = dict(p.category_map or {})
    train, held = [], []
    if p.spec_bench:  # true: the questions shipped in the package; a string: another question.jsonl
        spec_bench = load_spec_bench(None if p.spec_bench is True else resolve_path(p.spec_bench))
        train, held = split_prompts(spec_bench, p.holdout_per_category, cmap)
        train = take_per_category(train, p.train_per_category, cmap, cfg.seed)
    if p.builtin:
        train += load_builtin()
    if not train:
        raise InvalidInput("prompts: no training prompts (set prompts.builtin=true or prompts.spec_bench)")
    evaluation = take_per_category(held, p.eval_per_category, cmap, cfg.seed) if p.eval_per_category else []
    target, tokenizer = load_model(ModelSpec(path=cfg.target.path, gguf_file=cfg.target.gguf_file))
    target = Engine(target, dtype=cfg.dtype).target.model
    # The draft is cut from the target before generating (the slow part), so that a layout or depth it
    # cannot have is refused first; it costs a fraction of the target.
    draft = make_draft(target, cfg.draft.num_layers)
    # The training text may come from a lower-precision copy of the target (twice as fast here);
    # evaluation always uses the target in `dtype`.
    writer = target
    if cfg.generation.dtype != cfg.dtype:
        writer = Engine(copy.deepcopy(target), dtype=cfg.generation.dtype).target.model
    eos = tokenizer.eos_token_id
    log.info("%d training prompts, %d held-out evaluation prompts", len(train), len(evaluation))
    phase("load")

    train_ids = first_turn_ids(tokenizer, train)
    examples = cached_continuations(cfg, writer, train_ids, eos)
    examples = [truncate(e, cfg.train.max_seq_len) for e in examples]
    if cfg.train.loss_on == "all":  # the teacher's distribution at prompt positions too: more signal, same pass
        examples = [Example(e.tokens, 1) for e in examples]
    n_tokens = sum(len(e.tokens) - e.start for e in examples)
    phase("generate")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    autocast = cfg.train.autocast if writer.dtype == torch.float32 else None
    teacher_targets(writer, examples, cfg.train.max_tokens, pad, cfg.progress, autocast)
    del writer
    phase("teacher")

    report: dict = {"train_prompts": len(train), "train_tokens": n_tokens, "eval_prompts": len(evaluation),
                    "num_layers": cfg.draft.num_layers,
                    "trainable_params": sum(q.numel() for q in draft.parameters() if q.requires_grad)}
    if evaluation and cfg.eval.init:
        report["init"] = evaluate_draft(target, draft, tokenizer, evaluation, cfg.eval.k, cfg.eval.max_new_tokens,
                                        cfg.dtype, cfg.progress)
        log.info("untrained draft: %s", _fmt(report["init"]))
        phase("eval_init")

    losses = distill(draft, target.get_output_embeddings(), examples, cfg.train.epochs, cfg.train.lr,
                     cfg.train.max_tokens, seed=cfg.seed, pad_id=pad, progress=cfg.progress,
                     autocast=cfg.train.autocast)
    per_epoch = len(losses) // cfg.train.epochs
    report["loss_first_steps"] = sum(losses[:5]) / len(losses[:5])
    report["loss_by_epoch"] = [sum(losses[i:i + per_epoch]) / per_epoch for i in range(0, per_epoch * cfg.train.epochs, per_epoch)]
    log.info("KL by epoch: %s (first steps %.3f)", [round(x, 3) for x in report["loss_by_epoch"]],
             report["loss_first_steps"])
    phase("train")

    out = resolve_path(cfg.out)
    save_draft(draft, tokenizer, out)
    phase("save")
    if evaluation:
        report["trained"] = evaluate_draft(target, draft, tokenizer, evaluation, cfg.eval.k, cfg.eval.max_new_tokens,
                                           cfg.dtype, cfg.progress)
        log.info("trained draft: %s", _fmt(report["trained"]))
        phase("eval_trained")
    report["seconds"] = times
    report["total_s"] = round(sum(times.values()), 1)
    report["config"] = OmegaConf.to_container(cfg, resolve=True)
    text = json.dumps(report, indent=2)
    (out / "train_report.json").write_text(text)
    if HydraConfig.initialized():
        (Path(HydraConfig.get().runtime.output_dir) / "train_report.json").write_text(text)
    log.info("draft saved to %s (load it with draft.path=%s); %.0f s in all", out, cfg.out, report["total_s"])
    return report


def cached_continuations(cfg: DictConfig, writer, prompt_ids: list[list[int]], eos) -> list[Example]:
    """The writer's greedy continuations, cached under $SPECDEC_CACHE/train_draft (the slow part of
    the recipe: a rerun with other training settings reuses it). `generation.cache=false` regenerates."""
    key = hashlib.sha256(json.dumps([cfg.target.path, cfg.target.gguf_file, str(writer.dtype),
                                     cfg.generation.max_new_tokens, prompt_ids]).encode()).hexdigest()[:16]
    path = cache_dir() / "train_draft" / f"continuations-{key}.pt"
    if cfg.generation.cache and path.is_file():
        # Lists of ints only: weights_only refuses anything that would run code, whatever torch's default;
        # a file that is not plain data, or is cut short, is generated again.
        cached = load_cache(path, log)
        if cached is not None:
            log.info("continuations from %s", path)
            return [Example(torch.tensor(t), s) for t, s in cached]
    engine = Engine(writer, dtype=writer.dtype)
    examples = generate_continuations(engine, prompt_ids, cfg.generation.max_new_tokens,
                                      cfg.generation.batch_size, eos, cfg.progress)
    if cfg.generation.cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_cache([(e.tokens.tolist(), e.start) for e in examples], path)
    return examples


def _fmt(m: dict) -> str:
    return (f"acceptance {m['acceptance_rate']:.3f}, mean accepted length {m['mean_accepted_length']:.2f}, "
            f"speedup {m['speedup']:.2f}x ({m['tokens_per_s']:.1f} vs {m['baseline_tokens_per_s']:.1f} tok/s)")


@hydra.main(version_base="1.3", config_path="../conf", config_name="train_draft")
def main(cfg: DictConfig) -> None:
    with reported():  # bad input ends the command as `Error: <message>`, without a traceback
        run(cfg)


if __name__ == "__main__":
    main()
