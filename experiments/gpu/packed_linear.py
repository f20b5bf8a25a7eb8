"""What a model's linear layers cost for T input rows, through MKL (`nn.Linear`) and packed for oneDNN.

`packed_linear=` (specdec/accel/packed_linear.py) rests on one claim: on a CPU, eagerly, MKL serves one row
at the memory's pace but two or more far slower, while oneDNN's kernels on weights packed once serve a
few rows at little more than one. This measures it for every linear layer of a model (the embedded
SmolLM2: 211 projections and the output head, float32, weights read from memory, not cache), run
in sequence as a pass would, for T = 1, 2, 4, 8 rows.

    python experiments/gpu/packed_linear.py --out experiments/gpu/packed_linear.json
    python experiments/gpu/packed_linear.py --model tiny_random --repeats 2       # plumbing

One thread, process CPU time; the two paths alternate per repeat and rotate over T after an untimed
round (which packs every weight); medians of the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec.accel.packed_linear import PackedLinears, available
from specdec.models import ModelSpec, load_model


def linear_layers(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


@torch.no_grad()
def run_layers(layers: list[torch.nn.Linear], inputs: dict[int, torch.Tensor], rows: int) -> None:
    """Every layer once on `rows` rows of its input width: `inputs[in_features]: [1, rows_max, in]`."""
    for layer in layers:
        layer(inputs[layer.in_features][:, :rows])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not available():
        raise SystemExit("this torch build has no oneDNN packed linear kernels: nothing to compare")
    torch.set_num_threads(1)
    model, _ = load_model(ModelSpec(path=args.model))
    model = model.float().eval()
    layers = linear_layers(model)
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(1, max(rows), n, generator=gen) for n in {layer.in_features for layer in layers}}
    ms = {path: {r: [] for r in rows} for path in ("mkl", "packed")}
    for repeat in range(args.repeats + 1):  # round 0: untimed, packs every weight
        order = rows[repeat % len(rows):] + rows[:repeat % len(rows)]
        for r in order:
            for path in (("mkl", "packed") if repeat % 2 == 0 else ("packed", "mkl")):
                with PackedLinears(model) if path == "packed" else torch.no_grad():
                    cpu = time.process_time()
                    run_layers(layers, inputs, r)
                    if repeat:
                        ms[path][r].append((time.process_time() - cpu) * 1e3)
    med = {path: {r: statistics.median(v) for r, v in by_rows.items()} for path, by_rows in ms.items()}
    result = {"model": args.model, "torch": torch.__version__, "layers": len(layers), "repeats": args.repeats,
              "weight_bytes": sum(layer.weight.numel() * 4 for layer in layers), "ms": med}
    print(f"{len(layers)} linear layers, {result['weight_bytes'] / 1e6:.0f} MB of float32 weights, one thread, "
          f"medians of {args.repeats}")
    print("| rows | MKL ms | packed ms | packed / MKL |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r} | {med['mkl'][r]:.1f} | {med['packed'][r]:.1f} | {med['packed'][r] / med['mkl'][r]:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
