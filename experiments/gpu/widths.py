"""What one target pass of T tokens costs on this CPU, eager and compiled, relative to one token.

A speculative step scores its drafts in one pass of T = k + 1 tokens (or a tree's nodes). Where a
pass costs little more at T = 9 than at T = 1 (a memory-bound GPU), long drafts are nearly free to
score; where it does not, every rejected draft token costs. `compile=on` also pads T to a width
bucket (`specdec.accel.compiled.WIDTHS`, at least `NARROWEST`), and its kernels differ from the eager ones: this measures both
against the same eager passes, so that a method whose steps score wide passes (suffix decoding,
k = 8) can be told what compiling does to its step.

    python experiments/gpu/widths.py --out experiments/gpu/widths.json      # embedded SmolLM2, bfloat16
    python experiments/gpu/widths.py --model tiny_random --dtype float32 --repeats 2 --contexts 20
    python experiments/gpu/widths.py --widths 1,2,4 --narrowest 1   # compiled passes at their own width
    python experiments/gpu/widths.py --widths 1,2,4,8 --contexts 100 --modes off,on,autotune
    python experiments/gpu/widths.py --widths 1,2,4,6,8 --contexts 100 --modes off,autotune --cpp-gemm-rows 0
    python experiments/gpu/widths.py --widths 1,4,8 --contexts 100 --modes off,on,concat

One engine per mode on the same model; per context length, a prompt is prefilled once per engine,
then each pass of T tokens is run and rolled back. Passes alternate between the modes and rotate
over T, after one untimed round that compiles every graph; medians of the repeats, process CPU time
(one thread).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from unittest import mock

import torch

from specdec.accel import compiled as compiled_module
from specdec.accel.compiled import CompiledForward
from specdec.accel.passes import Accelerated
from specdec.core.engine import Engine
from specdec.models import ModelSpec, load_model

# `--modes`: off first, then compiled modes: compile= values, and `concat`: compile=on with the linear
# layers that read one input concatenated by inductor's freezing (q/k/v, gate/up; off by default on a CPU)
MODES = ("off", "on", "autotune", "concat")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--widths", default="1,2,3,4,5,6,7,8,9,10")
    ap.add_argument("--contexts", default="100,700", help="tokens in the cache before the pass")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--calls", type=int, default=3, help="passes timed together per repeat")
    ap.add_argument("--narrowest", type=int, default=None,
                    help="pad compiled passes to at least this width (default: the engine's rule, "
                         "specdec.accel.compiled.narrowest_width)")
    ap.add_argument("--modes", default="off,on", help="off, then one or more of on, autotune (compile=), concat")
    ap.add_argument("--cpp-gemm-rows", type=int, default=None,
                    help="autotune: graphs of at most this many rows tune among the C++ GEMMs only "
                         "(default specdec.accel.compiled.CPP_GEMM_ROWS; 0: inductor's default choices everywhere)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if modes[0] != "off" or len(modes) < 2 or not set(modes[1:]) <= set(MODES[1:]) or len(set(modes)) < len(modes):
        ap.error(f"--modes {args.modes}: off first, then one or more of {', '.join(MODES[1:])}")
    widths = [int(t) for t in args.widths.split(",")]
    if 1 not in widths:
        ap.error(f"--widths {args.widths}: include 1, the pass every other width is reported against")
    rows = compiled_module.CPP_GEMM_ROWS if args.cpp_gemm_rows is None else args.cpp_gemm_rows
    with mock.patch.object(compiled_module, "CPP_GEMM_ROWS", rows):  # this study's graphs only
        return measure(args, modes, widths)


def measure(args: argparse.Namespace, modes: list[str], widths: list[int]) -> dict:
    """The passes of `widths` tokens in every mode, timed as the module docstring says."""
    compiled = modes[1:]
    torch.set_num_threads(1)
    model, _ = load_model(ModelSpec(path=args.model))
    engines = {mode: Engine(model, None, dtype=args.dtype, passes=Accelerated(compile="on" if mode == "concat" else mode)) for mode in modes}
    for mode in compiled:  # `on` as inductor's default (nothing concatenated) beside `concat`
        engines[mode].target.compiled = CompiledForward(engines[mode].target, autotune=mode == "autotune",
                                                        concat_linear=mode == "concat")
    if args.narrowest is not None:
        for mode in compiled:
            engines[mode].target.compiled.narrowest = args.narrowest
    vocab = engines["off"].target.vocab_size
    gen = torch.Generator().manual_seed(0)
    result = {"model": args.model, "dtype": args.dtype, "torch": torch.__version__, "repeats": args.repeats,
              "calls": args.calls, "cpp_gemm_rows": compiled_module.CPP_GEMM_ROWS,
              "narrowest": {m: engines[m].target.compiled.narrowest for m in compiled}, "modes": modes, "contexts": {}}
    for context in (int(c) for c in args.contexts.split(",")):
        prompt = torch.randint(100, vocab, (1, context), generator=gen)
        passes = torch.randint(100, vocab, (1, max(widths)), generator=gen)
        ms = {mode: {t: [] for t in widths} for mode in modes}
        for engine in engines.values():
            with engine.exclusive():
                engine.target.reset(1, context + max(widths) + 1)
                engine.target.forward(prompt)
        start = time.perf_counter()
        for repeat in range(args.repeats + 1):  # round 0: untimed, compiles every graph
            order = widths[repeat % len(widths):] + widths[:repeat % len(widths)]
            for t in order:
                for mode in (modes if repeat % 2 == 0 else modes[::-1]):
                    engine = engines[mode]
                    with engine.exclusive():
                        cpu = time.process_time()
                        for _ in range(args.calls):
                            engine.target.forward(passes[:, :t])
                            engine.target.rollback([context])
                        if repeat:
                            ms[mode][t].append((time.process_time() - cpu) / args.calls * 1e3)
            if repeat == 0:
                print(f"context {context}: warm-up {time.perf_counter() - start:.0f} s", flush=True)
        med = {mode: {t: statistics.median(v) for t, v in ms[mode].items()} for mode in modes}
        rows = []
        for t in widths:
            r = {"tokens": t, "ms_off": med["off"][t], "off_over_t1": med["off"][t] / med["off"][1]}
            for mode in compiled:
                r |= {f"width_{mode}": engines[mode].target.compiled.width(t), f"ms_{mode}": med[mode][t],
                      f"{mode}_over_t1": med[mode][t] / med[mode][1], f"{mode}_over_off": med[mode][t] / med["off"][t]}
            rows.append(r)
            print(f"context {context:5d}  T {t:2d}  off {r['ms_off']:6.1f} ms ({r['off_over_t1']:.2f}x T=1)" + "".join(
                f"  {mode} (width {r[f'width_{mode}']:2d}) {r[f'ms_{mode}']:6.1f} ms ({r[f'{mode}_over_t1']:.2f}x T=1, "
                f"{r[f'{mode}_over_off']:.2f}x off)" for mode in compiled), flush=True)
        result["contexts"][context] = rows
    result["compile_report"] = {mode: engines[mode].compile_report() for mode in compiled}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
