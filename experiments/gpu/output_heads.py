"""What an output head's matmul for a few rows costs on this CPU, eager against compiled.

Medusa's heads end in the target's whole output head (SmolLM2: 49,152 x 576) and EAGLE's drafter
in a reduced one (8,192 rows): each step multiplies 1-4 hidden states by it. Eagerly that is a
bfloat16 matmul that packs nothing; compiled with inductor's frozen weights (what `compile=on`
does on a CPU) oneDNN runs it on a weight packed once. A random weight of the shape, one linear
layer, `--rows` rows each; eager and compiled calls alternate after a warm-up, medians of
`--repeats` of the process's CPU time per call, in milliseconds.

    python experiments/gpu/output_heads.py --out experiments/gpu/output_heads.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", default="49152,8192", help="comma-separated output-head sizes (rows of the weight)")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--rows", default="1,2,4", help="comma-separated numbers of hidden states per call")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (eager: the tests' quick run)")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def cpu_ms(fn, x: torch.Tensor) -> float:
    """The process CPU time of one `fn(x)` call, in milliseconds."""
    start = time.process_time()
    fn(x)
    return 1000 * (time.process_time() - start)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    result = {"args": vars(args), "ms": {}}
    torch.manual_seed(0)
    for vocab in map(int, args.vocab.split(",")):
        head = torch.nn.Linear(args.hidden, vocab, bias=False, dtype=dtype).eval()
        import torch._inductor.config as inductor_config

        with inductor_config.patch(freezing=args.backend == "inductor"), torch.inference_mode():
            compiled = torch.compile(head, backend=args.backend, dynamic=False)
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(1, rows, args.hidden, dtype=dtype)
                for _ in range(3):  # warm-up; compiles the shape
                    head(x), compiled(x)
                torch.testing.assert_close(compiled(x), head(x), rtol=2e-2, atol=2e-2)
                times = {"eager": [], "compiled": []}
                for _ in range(args.repeats):
                    times["eager"].append(cpu_ms(head, x))
                    times["compiled"].append(cpu_ms(compiled, x))
                cell = {k: statistics.median(v) for k, v in times.items()}
                cell["compiled_over_eager"] = cell["compiled"] / cell["eager"]
                result["ms"][f"{vocab}x{args.hidden}, {rows} rows"] = cell
                print(f"{vocab} x {args.hidden}, {rows} rows: eager {cell['eager']:.2f} ms, compiled "
                      f"{cell['compiled']:.2f} ms ({cell['compiled_over_eager']:.2f}x)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
