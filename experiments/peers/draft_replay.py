"""Replay suffix drafters over known greedy outputs: steps and tau per drafting rule, no model run.

    python experiments/peers/draft_replay.py RESULTS.jsonl [--corpus FILE] [--k 8]

Why: under greedy decoding a lossless method writes the target's own greedy text, so how many tokens
each step accepts depends only on that text and on the drafter. Given plain decoding's outputs (a
specdec `results.jsonl`), each rule is replayed step by step: draft from the prompt and the
accepted tokens, accept the longest drafted path that equals the text, add the bonus token. Rules
compare in seconds this way, on the same text, where model runs take minutes and, in bfloat16,
drift into other text. A later turn of a conversation is replayed after the earlier turns' prompt and
answers, without its own user message (results.jsonl does not keep it): its own-text matches are
slightly fewer than in the run.

Rules: `chain` (method=suffix), `tree` (method=suffix_tree, `budget` nodes), at each draft-length
factor and probability floor given. Per rule: steps, tau (tokens the steps emit per step, as the engine counts it) and the mean scoring width (drafted tokens + 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from specdec.proposers.suffix import SuffixProposer, SuffixTreeProposer, TokenPositions


def accepted_chain(tokens: list[int], truth: list[int]) -> int:
    """Drafted tokens equal to the text, from the first on."""
    n = 0
    while n < len(tokens) and n < len(truth) and tokens[n] == truth[n]:
        n += 1
    return n


def accepted_tree(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Depth of the deepest node whose path from the root equals the text."""
    at, depth = -1, 0
    while depth < len(truth):
        nxt = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == at and t == truth[depth]), None)
        if nxt is None:
            break
        at, depth = nxt, depth + 1
    return depth


def replay(proposer: SuffixProposer, prompt: list[int], output: list[int], k: int) -> tuple[int, list[int]]:
    """Steps to write `output` after `prompt` (the prefill writes its first token), and the scoring
    width of each step."""
    own = TokenPositions()
    own.extend(prompt + output[:1])  # the prefill writes the first token
    done, steps, widths = 1, 0, []
    while done < len(output):
        context = own.seq[max(len(own.seq) - proposer.max_depth, 0):]
        room = len(output) - done - 1  # no step drafts past the token budget (the engine's caps)
        truth = output[done:]
        if room < 1:
            tokens, n = [], 0
        elif isinstance(proposer, SuffixTreeProposer):  # a tree: the step's depth is capped
            tokens, parents = proposer.tree_row(context, own, min(k, room))
            n = accepted_tree(tokens, parents, truth)
        else:  # a chain: drafted at k, then cut
            tokens = proposer.draft_row(context, own, k)[0][:room]
            n = accepted_chain(tokens, truth)
        own.extend(output[done:done + n + 1])
        done += n + 1
        steps += 1
        widths.append(len(tokens) + 1)
    return steps, widths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, help="a plain decoding run's results.jsonl")
    ap.add_argument("--corpus", default=None, help="a datastore (method.proposer.corpus)")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--budgets", default="8,16,24", help="tree budgets to replay")
    ap.add_argument("--min-probs", default="0.1", help="min_token_prob values to replay")
    ap.add_argument("--factors", default="1,2", help="max_spec_factor values to replay")
    args = ap.parse_args()
    rows = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("method", "autoregressive") == "autoregressive"]
    seen, texts = set(), []
    for r in rows:  # one per prompt (repeats write the same text)
        key = tuple(r["prompt_token_ids"])
        if key not in seen:
            seen.add(key)
            context = list(r["prompt_token_ids"])
            for turn in r.get("turn_outputs") or [{"output_token_ids": r["output_token_ids"]}]:
                texts.append((list(context), turn["output_token_ids"], r.get("category", "")))
                context += turn["output_token_ids"]
    common = dict(max_cached_requests=0, corpus=args.corpus)
    rules = {}
    for factor in map(float, args.factors.split(",")):
        for p in map(float, args.min_probs.split(",")):
            tag = f"f{factor:g} p{p:g}"
            rules[f"chain {tag}"] = SuffixProposer(max_spec_factor=factor, min_token_prob=p, **common)
            for budget in map(int, args.budgets.split(",")):
                rules[f"tree {budget} {tag}"] = SuffixTreeProposer(budget=budget, max_spec_factor=factor,
                                                                  min_token_prob=p, **common)
    print(f"{len(texts)} outputs, {sum(len(o) for _, o, _ in texts)} tokens, k = {args.k}")
    print(f"{'rule':<22} {'steps':>6} {'tau':>6} {'width':>6}  per category (tau)")
    for name, proposer in rules.items():
        steps, widths, per = 0, [], {}
        for prompt, output, category in texts:
            s, w = replay(proposer, prompt, output, args.k)
            steps += s
            widths += w
            per.setdefault(category, []).append((len(output) - 1) / s)
        # tokens the steps emitted over steps, as the engine counts tau: the prefill writes each first token
        tau = sum(len(o) - 1 for _, o, _ in texts) / steps
        cats = " ".join(f"{c[:5]} {statistics.mean(v):.2f}" for c, v in per.items())
        print(f"{name:<22} {steps:>6} {tau:>6.2f} {statistics.mean(widths):>6.2f}  {cats}")


if __name__ == "__main__":
    main()
