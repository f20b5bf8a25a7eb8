"""Plain decoding of the embedded SmolLM2 in bfloat16 on one CPU thread, by engine setting.

    python experiments/peers/plain_speed.py MODE [--repeats 5] [--tokens 128]

MODE: `eager-unpacked` (nn.Linear as it is), `eager` (the default: packed linear layers), `on`
(compile=on, q/k/v and gate/up concatenated), `on-apart` (compile=on, nothing concatenated),
`on-cpp` (compile=on with cpp_wrapper), `autotune`, `autotune-cpp`. One process per mode: the first
generation compiles (its seconds are printed), then the median tokens/s of `--repeats` generations of
one Spec-Bench-like prompt, greedy, `--tokens` new tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import Engine, ModelSpec, SpeculativeDecoder, load_model
from specdec.accel.compiled import CompiledForward
from specdec.accel.passes import Accelerated

MODES = ("eager-unpacked", "eager", "on", "on-apart", "on-cpp", "autotune", "autotune-cpp")
PROMPT = "Write a long story about a dragon who learns to code in Python."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=MODES)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    target, tokenizer = load_model(ModelSpec(path="embedded"))
    compile = "off" if args.mode.startswith("eager") else "autotune" if args.mode.startswith("autotune") else "on"
    passes = Accelerated(compile=compile, packed_linear="off" if args.mode == "eager-unpacked" else "auto",
                         cpp_wrapper=args.mode.endswith("-cpp"))
    engine = Engine(target, None, device="cpu", dtype="bfloat16", passes=passes)
    if args.mode == "on-apart":
        engine.target.compiled = CompiledForward(engine.target, concat_linear=False)
    decoder = SpeculativeDecoder(engine, tokenizer=tokenizer, exact_greedy=False)  # one token wide, as the baseline
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    start = time.perf_counter()
    decoder.generate([ids], max_new_tokens=args.tokens)
    print(f"{args.mode}: first generation (compiling) {time.perf_counter() - start:.1f} s")
    speeds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = decoder.generate([ids], max_new_tokens=args.tokens)
        speeds.append(len(out.output_ids[0]) / (time.perf_counter() - start))
    print(f"{args.mode}: {statistics.median(speeds):.2f} tok/s median of {args.repeats} "
          f"({', '.join(f'{s:.1f}' for s in sorted(speeds))})")


if __name__ == "__main__":
    main()
