"""Where the time of one decoding step goes, on the embedded target.

Wraps the phases of the loop (propose, score, verify, commit, observe) and every model forward
with timers, runs a few generations after a warm-up, and prints milliseconds per step for:
model forwards (target and draft), the framework around them (Python, mask and position
tensors, cache bookkeeping), the verifier (sampling / argmax), and the host syncs that read the
accepted counts back. Nothing in the library is changed: the timers are installed from outside.

    python scripts/profile_step.py --method draft --draft self --k 4 --dtype bfloat16
    python scripts/profile_step.py --method autoregressive
    python scripts/profile_step.py --method eagle --k 2 --dtype bfloat16 --threads 1 --compile autotune
    python scripts/profile_step.py --method suffix_tree --k 8 --dtype bfloat16 --threads 1 --compile on

Under `--compile on|autotune` a target pass is timed around `CachedModel.forward` (the compiled
graph holds the masks and the cache writes too), never inside what dynamo traces: a timer there
would be traced, and its changing totals would recompile the graph every call. Every prompt is
generated once untimed first, so that no graph compiles while timed.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch

from specdec import Engine, ModelSpec, SpeculativeDecoder, load_model
from specdec.accel.passes import Accelerated
from specdec.core.engine import synchronize
from specdec.study.data import build_turn_input, load_prompts

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    """Accumulated seconds per label; `wrap(obj, attr, label)` times a method in place."""

    def __init__(self, device):
        self.device = device
        self.total = defaultdict(float)

    def wrap(self, obj, attr: str, label: str) -> None:
        inner = getattr(obj, attr)

        def timed(*args, **kwargs):
            synchronize(self.device)
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                synchronize(self.device)
                self.total[label] += time.perf_counter() - t

        setattr(obj, attr, timed)


def build_proposer(name: str, engine: Engine):
    if name == "autoregressive":
        return None
    if name == "draft":
        from specdec.proposers.draft_model import DraftModelProposer

        return DraftModelProposer(engine)
    if name == "ngram":
        from specdec.proposers.ngram import NgramProposer

        return NgramProposer(engine)
    if name == "layer_skip":
        from specdec.proposers.layer_skip import LayerSkipProposer

        return LayerSkipProposer(engine)
    if name == "eagle":  # the shipped drafter, in conf/method/eagle.yaml's tree shape
        from omegaconf import OmegaConf

        from specdec.proposers.eagle import EagleProposer
        from specdec.proposers.heads import resolve_heads_path

        conf = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "method" / "eagle.yaml"), resolve=True)
        shape = {k: v for k, v in conf["proposer"].items() if k not in ("_target_", "heads_path")}
        return EagleProposer(engine, str(resolve_heads_path("embedded", "eagle")), **shape)
    if name in ("suffix", "suffix_tree"):  # drafts from the prompt and the output so far (no datastore)
        from specdec.proposers.suffix import SuffixProposer, SuffixTreeProposer

        return (SuffixTreeProposer if name == "suffix_tree" else SuffixProposer)(
            engine, max_spec_factor=3.0, min_token_prob=0.03, max_cached_requests=0)
    raise SystemExit(f"unknown method {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="draft", choices=["autoregressive", "draft", "ngram", "layer_skip", "eagle", "suffix",
                                                         "suffix_tree"])
    ap.add_argument("--draft", default="self", help="'self' or a path loadable by specdec.models")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--compile", default="off", choices=["off", "on", "autotune"])
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target, tok = load_model(ModelSpec(path="embedded"))
    draft = None
    if args.method == "draft":
        draft = target if args.draft == "self" else load_model(ModelSpec(path=args.draft))[0]
    engine = Engine(target, draft, dtype=args.dtype, passes=Accelerated(compile=args.compile))
    proposer = build_proposer(args.method, engine)
    decoder = SpeculativeDecoder(engine, proposer, num_speculative_tokens=args.k, tokenizer=tok)
    prompts = [build_turn_input(tok, [], p.turns[0]) for p in load_prompts("builtin", limit=1)][: args.prompts]
    compiled = args.compile != "off"
    for ids in prompts if compiled else prompts[:1]:  # warm-up (compiled: every graph of the run)
        decoder.generate([ids], max_new_tokens=args.max_new_tokens if compiled else 8)

    clock = Clock(engine.device)

    def timed_part(cached):  # eager: the model alone; compiled: the pass around the graph
        return cached if compiled else cached.model

    clock.wrap(timed_part(engine.target), "forward", "model: target")
    if engine.draft is not None and engine.draft.model is not engine.target.model:
        clock.wrap(timed_part(engine.draft), "forward", "model: draft")
    if args.method == "eagle":  # the drafter's own passes are inside "1 propose"; its head runs eagerly
        clock.wrap(decoder.proposer.head, "logits", "eagle: output head")
    clock.wrap(decoder.proposer, "propose", "1 propose")
    clock.wrap(decoder, "score", "2 score")
    clock.wrap(decoder, "commit_step", "4 commit")
    clock.wrap(decoder.proposer, "observe", "5 observe")
    steps = 0
    for ids in prompts:
        out = decoder.generate([ids], max_new_tokens=args.max_new_tokens)
        steps += out.stats.steps
        clock.total["generate (all)"] += out.stats.wall_s
        clock.total["prefill"] += out.stats.ttft_s
        clock.total["2+3 score and verify"] += out.stats.verify_s

    t = clock.total
    # The prefill is one long target forward with negligible overhead: take it out of the model
    # time, so that every row below is per decoding step.
    model = t["model: target"] + t["model: draft"] - t["prefill"]
    decode = t["generate (all)"] - t["prefill"]
    rows = {
        "model forwards (target + draft)": model,
        "  of which target": t["model: target"] - t["prefill"],
        "  of which draft": t["model: draft"],
        "verify (sampling/argmax, sync)": t["2+3 score and verify"] - t["2 score"],
        "commit (tokens, EOS, cache rollback)": t["4 commit"],
        "observe (draft cache rollback)": t["5 observe"],
        **({"propose (all drafting)": t["1 propose"], "  of which the drafter's output head": t["eagle: output head"]}
           if args.method == "eagle" else {}),
        "framework outside the model": decode - model,
    }
    print(f"method={args.method} k={args.k} compile={args.compile} dtype={engine.dtype} threads={torch.get_num_threads()} "
          f"prompts={len(prompts)} steps={steps}")
    print("| part (prefill excluded) | ms per step | share of decoding time |\n|---|---|---|")
    for name, secs in rows.items():
        print(f"| {name} | {secs / steps * 1e3:.2f} | {secs / decode:.1%} |")


if __name__ == "__main__":
    main()
