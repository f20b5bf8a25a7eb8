"""Host time per decoding step: what a step costs when the model costs almost nothing.

With tiny random models a pass's arithmetic takes microseconds, so a step's wall time is the host's
work: Python, dispatch, dynamo's call path, the verifier, the commit. On a GPU, where a compiled
pass is one CUDA-graph replay, that work is the floor under every serial step (speculative steps
wait for the host: the next step's drafts start from the count it reads), so it is measured here,
on any machine, eager and compiled (inductor: the same graphs a GPU would run, CPU kernels).

    python experiments/gpu/host_time.py --out experiments/gpu/host_time.json
    PYTHONPATH=/tmp/old python experiments/gpu/host_time.py     # another commit's specdec (a worktree)

Methods: plain decoding, a one-layer draft model at k = 4 (greedy), the same with forced acceptance
0.8 (`verifier=forced`, not lossless: the benchmark's speculative case), n-gram lookup at k = 4.
Modes: eager, compiled (the serial loop) and overlapped (compiled with `overlap=on`: plain decoding's
steps overlapped, a draft model's pipelined; on a CPU nothing runs ahead of the host, so this is
the host's cost of queueing ahead, not its gain). One prompt of 20 tokens, 64 new tokens, EOS
ignored; the modes interleaved, their order rotating; medians over repeats of the decoding phase's
seconds per step (prefill excluded), after two warm-up generations that compile every graph.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import specdec.core.verify as verify
from specdec.accel.passes import Accelerated
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.models import tiny_random_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer

METHODS = ("plain", "draft", "forced", "ngram")


def decoder(method: str, mode: str, target, draft) -> SpeculativeDecoder:
    """`mode`: eager, compiled (the serial loop) or overlapped (compiled, `overlap=on`: plain decoding
    overlapped, a draft model's steps pipelined, `specdec.accel.pipeline`; n-gram serial still)."""
    engine = Engine(target, draft, dtype="float32", passes=Accelerated(compile="off" if mode == "eager" else "on"))
    proposer = {"plain": lambda: None, "draft": lambda: DraftModelProposer(engine),
                "forced": lambda: DraftModelProposer(engine), "ngram": lambda: NgramProposer(engine)}[method]()
    extra = {"verifier": verify.ForcedVerifier(0.8)} if method == "forced" else {}
    d = SpeculativeDecoder(engine, proposer, num_speculative_tokens=4, eos_token_id=[],
                           overlap="on" if mode == "overlapped" else "off", **extra)
    d.exact_greedy = False  # one token wide, as a baseline runs alone (and as compile=on does anyway)
    return d


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--modes", default="eager,compiled,overlapped")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target = tiny_random_model(seed=0, eos_token_id=None)
    draft = tiny_random_model(seed=1, num_layers=1, eos_token_id=None)
    prompt = [[5, 6, 7, 8, 9] * 4]
    result = {"torch": torch.__version__, "new_tokens": args.new_tokens, "repeats": args.repeats, "ms_per_step": {}}
    for method in args.methods.split(","):
        modes = args.modes.split(",")
        decoders = {mode: decoder(method, mode, target, draft) for mode in modes}
        for d in decoders.values():
            for _ in range(2):  # warm-up: every graph compiles
                d.generate(prompt, max_new_tokens=args.new_tokens)
        per_step, steps = {mode: [] for mode in modes}, {}
        for r in range(args.repeats):  # the modes interleaved, their order rotating
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                start = time.perf_counter()
                out = decoders[mode].generate(prompt, max_new_tokens=args.new_tokens)
                per_step[mode].append((time.perf_counter() - start - out.stats.ttft_s) / out.stats.steps)
                steps[mode] = out.stats.steps
        for mode in modes:
            ms = statistics.median(per_step[mode]) * 1e3
            result["ms_per_step"][f"{method} {mode}"] = round(ms, 3)
            print(f"{method:6s} {mode:10s} {ms:7.3f} ms a step ({steps[mode]} steps)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
