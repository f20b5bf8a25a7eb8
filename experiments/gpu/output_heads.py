"""What an output head's matmul for a few rows costs on this CPU, eager against compiled.

Medusa's heads end in the target's whole output head (SmolLM2: 49,152 x 576) and EAGLE's drafter
in a reduced one (8,192 rows): each step multiplies 1-4 hidden states by it. Eagerly that is a
bfloat16 matmul that packs nothing; compiled with inductor's frozen weights (what `compile=on`
does on a CPU) oneDNN runs it on a weight packed once. A random weight of the shape, one linear
layer, `--rows` rows each; eager and compiled calls alternate after a warm-up, medians of
`--repeats` of the process's CPU time per call, in milliseconds.

`--variants` adds inductor's autotuning (`compile=autotune`): `autotune` with its default GEMM
choices, `autotune_cpp` among its C++ GEMM templates alone (what `specdec.accel.compiled.gemm_backends`
picks for graphs of at most `CPP_GEMM_ROWS` rows). Each variant compiles its own copy of the head.

    python experiments/gpu/output_heads.py --out experiments/gpu/output_heads.json
    python experiments/gpu/output_heads.py --vocab 49152 --variants compiled,autotune,autotune_cpp
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from specdec.accel.compiled import _compiling, allow_recompiles

VARIANTS = {"compiled": (None, None), "autotune": ("max-autotune-no-cudagraphs", None),
            "autotune_cpp": ("max-autotune-no-cudagraphs", "CPP")}  # name: (compile mode, GEMM backends)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", default="49152,8192", help="comma-separated output-head sizes (rows of the weight)")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--rows", default="1,2,4", help="comma-separated numbers of hidden states per call")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (eager: the tests' quick run)")
    ap.add_argument("--variants", default="compiled", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def cpu_ms(fn, x: torch.Tensor) -> float:
    """The process CPU time of one `fn(x)` call, in milliseconds."""
    start = time.process_time()
    fn(x)
    return 1000 * (time.process_time() - start)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    variants = args.variants.split(",")
    if not variants or not set(variants) <= set(VARIANTS):
        raise SystemExit(f"--variants {args.variants}: comma-separated, of {', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    result = {"args": vars(args), "ms": {}}
    torch.manual_seed(0)
    freezing = args.backend == "inductor"
    allow_recompiles()  # one graph per variant, head and row count, all of one code object
    for vocab in map(int, args.vocab.split(",")):
        head = torch.nn.Linear(args.hidden, vocab, bias=False, dtype=dtype).eval()
        compiled = {v: torch.compile(copy.deepcopy(head), backend=args.backend, dynamic=False,
                                     mode=VARIANTS[v][0] if freezing else None) for v in variants}
        with torch.inference_mode():
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(1, rows, args.hidden, dtype=dtype)
                for v, fn in compiled.items():  # warm-up: compiles the shape, with the variant's settings
                    mode, backends = VARIANTS[v]
                    with _compiling(freezing, mode is not None and freezing, backends):
                        for _ in range(3):
                            fn(x)
                    torch.testing.assert_close(fn(x), head(x), rtol=2e-2, atol=2e-2)
                times = {"eager": [], **{v: [] for v in variants}}
                for _ in range(args.repeats):
                    times["eager"].append(cpu_ms(head, x))
                    for v, fn in compiled.items():
                        times[v].append(cpu_ms(fn, x))
                cell = {k: statistics.median(t) for k, t in times.items()}
                cell |= {f"{v}_over_eager": cell[v] / cell["eager"] for v in variants}
                result["ms"][f"{vocab}x{args.hidden}, {rows} rows"] = cell
                print(f"{vocab} x {args.hidden}, {rows} rows: eager {cell['eager']:.2f} ms" + "".join(
                    f", {v} {cell[v]:.2f} ms ({cell[f'{v}_over_eager']:.2f}x)" for v in variants), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
