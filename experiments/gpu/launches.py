"""Device work a compiled decoding step launches outside its compiled graphs.

Under `compile=on` a pass is one graph (one CUDA-graph replay on a GPU), but what the engine does
around it runs eagerly: building the pass's inputs (slots, positions, padding), the verifier, the
commit. On a GPU each of those operators is a kernel launch of a few microseconds of host time and
a few of device time, and a draft model pays them on each of its k passes, so they count in c. This
counts them on any device: every aten operator dispatched outside the compiled calls during one
generation, less views (no kernel) and the host-side tensors that `to_device` stages (no device
work), per decoding step and by source line.

    python experiments/gpu/launches.py        # plain decoding, draft k = 4, forced: serial and overlapped / pipelined
    python experiments/gpu/launches.py --where            # and the source lines

Tiny random models (the count does not depend on the model's size, only on the engine's code),
dynamo's quick backend (the same graphs and buckets as inductor's, without generating code).
"""

from __future__ import annotations

import argparse
import json
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily

import specdec.accel.compiled as compiled
import specdec.core.device as device
import specdec.core.verify as verify
from specdec.accel.compiled import CompiledForward
from specdec.accel.passes import Accelerated
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.models import tiny_random_model
from specdec.proposers.draft_model import DraftModelProposer

# Operators that make a view or alias: no kernel.
VIEWS = {"view", "expand", "slice", "unsqueeze", "select", "alias", "detach", "t", "transpose", "as_strided",
         "_unsafe_view", "squeeze", "permute", "lift_fresh"}


class _Launches(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.total = 0
        self.where: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/specdec/" in f.filename]
        staged = frames and frames[-1].filename.endswith("core/device.py") and "_TENSOR(" in (frames[-1].line or "")
        if func.overloadpacket.__name__ not in VIEWS and not staged:
            self.total += 1
            f = frames[-1] if frames else None
            self.where[f"{f.filename.rsplit('/specdec/', 1)[1]}:{f.lineno}  {f.line}" if f else "outside specdec"] += 1
        return func(*args, **(kwargs or {}))


def count(method: str, overlap: str, new_tokens: int) -> tuple[float, Counter, int]:
    """(launches per step, by source line, steps) of one generation after a warm-up."""
    target = tiny_random_model(seed=0, eos_token_id=None)
    draft = tiny_random_model(seed=1, num_layers=1, eos_token_id=None) if method in ("draft", "forced") else None
    engine = Engine(target, draft, dtype="float32", passes=Accelerated(compile="on"))
    for model in (engine.target, engine.draft):
        if model is not None:
            model.compiled = CompiledForward(model, backend="eager")
    proposer = DraftModelProposer(engine) if draft is not None else None
    extra = {"verifier": verify.ForcedVerifier(0.8)} if method == "forced" else {}  # the benchmark's case
    decoder = SpeculativeDecoder(engine, proposer, num_speculative_tokens=4, eos_token_id=[], overlap=overlap, **extra)
    decoder.generate([[5, 6, 7, 8, 9]], max_new_tokens=new_tokens)  # warm-up: every graph compiles
    mode = _Launches()
    run = compiled._BucketedPasses._run

    def outside(self, *args, **kwargs):  # the compiled call itself is not counted
        with _pop_mode_temporarily():
            return run(self, *args, **kwargs)

    compiled._BucketedPasses._run = outside
    device.COUNTING += 1  # the CPU answers `reads_are_free` as a GPU does: checks that read run only here
    try:
        with mode:
            out = decoder.generate([[5, 6, 7, 8, 9]], max_new_tokens=new_tokens)
    finally:
        compiled._BucketedPasses._run = run
        device.COUNTING -= 1
    return mode.total / out.stats.steps, mode.where, out.stats.steps


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--where", action="store_true", help="print the source lines")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    cases = [(m, o) for m in ("plain", "draft", "forced") for o in ("off", "on")]  # on: overlapped / pipelined
    for method, overlap in cases:
        per_step, where, steps = count(method, overlap, args.new_tokens)
        name = f"{method}" if method == "plain" else f"{method} k=4"
        name += " (acceptance 0.8)" if method == "forced" else ""
        name += f" overlap={overlap}"
        results[name] = round(per_step, 2)
        print(f"{name}: {per_step:.2f} launches a step outside compiled graphs ({steps} steps)")
        if args.where:
            for line, n in where.most_common(25):
                print(f"  {n / steps:6.2f}  {line}")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
