"""Where the EAGLE-style drafter loses on Spec-Bench: drafter quality against distribution shift, and
the cost of each part of a drafting + verification step.

    PYTHONPATH=. python experiments/trees/diagnose.py [--heads embedded] [--per-category 2] [--tokens 64]

1. quality: the drafter's teacher-forced top-1 agreement with the target (it reads the target's true
   features: the first tree level's acceptance) on the target's own continuations of (a) held-out
   training-style prompts and (b) Spec-Bench prompts per category, and the same two steps deep
   (the second token drafted from the drafter's own predicted feature, as at decode time).
2. cost: decode Spec-Bench prompts with method=eagle and time, per step, the drafter's passes (catch
   up and each level), the output head, the target's scoring pass at the tree's width against a pass
   one token wide, the cache compaction, and everything else in the step (host syncs, the verifier).
Results are printed as JSON. Spec-Bench text is only measured here, never trained on.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

from specdec.core.cache import RowCache
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import CachedModel, Engine
from specdec.models import ModelSpec, load_model
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.heads import OutputHead
from specdec.study.data import build_turn_input, load_spec_bench
from specdec.train.head_training import eagle_sequences, training_prompts, vocab_index
from specdec.train.training import Example, generate_continuations, teacher_targets, truncate


def _top1(drafter, embed, head: OutputHead, index, examples) -> dict:
    """Teacher-forced top-1 at depth 1, and depth 2 from the drafter's own predicted feature."""
    d1 = d2 = n1 = n2 = 0
    for e in examples:
        seq = eagle_sequences(e, e.start, index)
        t = len(seq["tokens"])
        pos = torch.arange(t)[None]
        with torch.inference_mode():
            pred = drafter(embed(seq["tokens"][None]), seq["features"][None].to(drafter.fc.weight.dtype), pos)[0]
            guess = head.logits(pred).argmax(-1)
            labels = seq["labels"]
            known = labels >= 0
            d1 += int((guess[known] == labels[known]).sum())
            n1 += int(known.sum())
            # depth 2: feed the drafter's own feature for position t+1 with the true token x_{t+2}
            # (the path where depth 1 was right), a second causal pass over the predicted features
            feats2 = torch.cat([seq["features"][:1].to(pred.dtype), pred[:-1]], 0)
            pred2 = drafter(embed(seq["tokens"][None]), feats2[None], pos)[0]
            g2 = head.logits(pred2).argmax(-1)
            ok = known.clone()
            ok[0] = False
            d2 += int((g2[ok] == labels[ok]).sum())
            n2 += int(ok.sum())
    return {"top1_depth1": d1 / max(n1, 1), "top1_depth2_own_feature": d2 / max(n2, 1), "positions": n1}


class _Clock:
    """Accumulates wall time of wrapped callables by name."""

    def __init__(self):
        self.s = collections.defaultdict(float)
        self.n = collections.Counter()

    def wrap(self, owner, attr: str, name, obj=None):
        fn = getattr(owner, attr)

        def timed(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            key = name(*a, **k) if callable(name) else name
            self.s[key] += time.perf_counter() - t
            self.n[key] += 1
            return out

        setattr(obj if obj is not None else owner, attr, timed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="embedded")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-cost", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(ModelSpec(path="embedded"))
    engine = Engine(model, dtype="auto")
    eos = tok.eos_token_id
    by_cat = collections.defaultdict(list)
    for p in load_spec_bench():
        by_cat[p.category].append(p)
    cats = {c: ps[: args.per_category] for c, ps in by_cat.items()}
    report: dict = {"dtype": str(engine.dtype), "heads": args.heads}
    proposer = EagleProposer(engine, args.heads)

    if not args.skip_quality:
        target = engine.target.model
        index = vocab_index(proposer.head.vocab_ids, target.config.vocab_size)
        sets = {"training-style (held out)": [build_turn_input(tok, [], t) for t in training_prompts(600, 0)[-12:]]}
        sets.update({c: [build_turn_input(tok, [], p.turns[0]) for p in ps] for c, ps in cats.items()})
        quality = {}
        for name, ids in sets.items():
            ex = generate_continuations(engine, ids, args.tokens, 8, eos, progress=False)
            cut = [truncate(e, 1024) for e in ex]
            ex = [Example(e.tokens, 1) for e in cut]  # hidden states at every position
            teacher_targets(target, ex, 4096, 0, progress=False)
            for e, c in zip(ex, cut):
                e.start = c.start
            quality[name] = _top1(proposer.drafter, target.get_input_embeddings(), proposer.head, index, ex)
            print(name, quality[name], flush=True)
        report["quality"] = quality

    if not args.skip_cost:
        clock = _Clock()
        depth_of = {"i": 0}
        orig_propose = EagleProposer.propose

        def propose(self, state, k):
            depth_of["i"] = 0
            t = time.perf_counter()
            out = orig_propose(self, state, k)
            clock.s["draft: whole propose"] += time.perf_counter() - t
            clock.n["draft: whole propose"] += 1
            return out

        EagleProposer.propose = propose

        def feed_name(*a, **k):
            depth_of["i"] += 1
            return f"draft: drafter pass {depth_of['i']} ({'catch up' if depth_of['i'] == 1 else 'level'})"

        clock.wrap(proposer, "_feed", feed_name, proposer)
        clock.wrap(proposer.head, "logits", "draft: output head", proposer.head)
        clock.wrap(CachedModel, "forward", lambda self, tokens, *a, **k: f"target: pass width {tokens.shape[1]}"
                   if tokens.shape[1] <= 64 else "target: prefill")
        clock.wrap(RowCache, "compact", "target: cache compaction")
        ids = [build_turn_input(tok, [], p.turns[0]) for ps in cats.values() for p in ps]
        eagle = SpeculativeDecoder(engine, proposer, num_speculative_tokens=5, eos_token_id=eos)
        plain = SpeculativeDecoder(engine, eos_token_id=eos)
        plain1 = SpeculativeDecoder(engine, eos_token_id=eos, exact_greedy=False)
        for d in (eagle, plain, plain1):
            d.generate(ids[:1], max_new_tokens=8)
        clock.s.clear()
        clock.n.clear()
        wall, steps, emitted = collections.Counter(), collections.Counter(), collections.Counter()
        for i in ids:
            for name, d in (("eagle", eagle), ("plain (exact_greedy width)", plain), ("plain (1 wide)", plain1)):
                out = d.generate([i], max_new_tokens=args.tokens)
                wall[name] += out.stats.wall_s
                steps[name] += out.stats.steps
                emitted[name] += sum(r.emitted for r in out.stats.rows)
        per_step = {k: {"ms_per_call": 1000 * clock.s[k] / clock.n[k], "calls_per_eagle_step": clock.n[k] / steps["eagle"]}
                    for k in sorted(clock.s)}
        report["cost"] = {"per_step": per_step,
                          "wall_ms_per_step": {k: 1000 * wall[k] / steps[k] for k in wall},
                          "tokens_per_step": {k: emitted[k] / steps[k] for k in wall},
                          "tokens_per_s": {k: emitted[k] / wall[k] for k in wall}}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
