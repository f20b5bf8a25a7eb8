"""What one plain-decoding token's matrix products cost on this CPU, by the path they take.

    python experiments/peers/linear_paths.py [--repeats 30]

Every linear layer of a SmolLM2-135M-shaped model (30 layers, hidden 576, 3 key heads of 64,
MLP 1,536, vocabulary 49,152) in bfloat16, random weights, one row each, in decoding's order:
`nn.Linear` as eager transformers runs it, oneDNN on weights packed once (`engine.packed_linear`),
and packed with q/k/v and gate/up concatenated (what compiled bfloat16 graphs do). Medians of
`--repeats` passes over all 211 products, one thread. Also the memory's read speed (one `sum` over
270 MB), the bound every path streams the weights against.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

LAYERS, HIDDEN, KV, MLP, VOCAB = 30, 576, 192, 1536, 49152


def _median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    def weight(out: int, inp: int) -> torch.Tensor:  # [out, in]
        return (torch.randn(out, inp) * 0.02).to(torch.bfloat16)

    layers = [dict(q=weight(HIDDEN, HIDDEN), k=weight(KV, HIDDEN), v=weight(KV, HIDDEN), o=weight(HIDDEN, HIDDEN),
                   g=weight(MLP, HIDDEN), u=weight(MLP, HIDDEN), d=weight(HIDDEN, MLP)) for _ in range(LAYERS)]
    head = weight(VOCAB, HIDDEN)
    pack = torch.ops.mkldnn._reorder_linear_weight

    def packed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    apart = [{name: pack(w) for name, w in layer.items()} for layer in layers]
    joined = [dict(qkv=pack(torch.cat([la["q"], la["k"], la["v"]])), o=pack(la["o"]),
                   gu=pack(torch.cat([la["g"], la["u"]])), d=pack(la["d"])) for la in layers]
    head_packed = pack(head)
    x, x_mlp = torch.randn(1, HIDDEN).to(torch.bfloat16), torch.randn(1, MLP).to(torch.bfloat16)

    def unpacked_pass():
        for la in layers:
            for name in "qkvogu":
                torch.nn.functional.linear(x, la[name])
            torch.nn.functional.linear(x_mlp, la["d"])
        torch.nn.functional.linear(x, head)

    def packed_pass():
        for la in apart:
            for name in "qkvogu":
                packed(x, la[name])
            packed(x_mlp, la["d"])
        packed(x, head_packed)

    def joined_pass():
        for la in joined:
            packed(x, la["qkv"]), packed(x, la["o"]), packed(x, la["gu"]), packed(x_mlp, la["d"])
        packed(x, head_packed)

    big = torch.randn(270 * 2**20 // 4)
    read_ms = _median_ms(big.sum, 10)
    print(f"memory read, one thread: {big.numel() * 4 / read_ms / 1e6:.1f} GB/s")
    weights_mb = sum(w.numel() for la in layers for w in la.values()) * 2 / 1e6 + head.numel() * 2 / 1e6
    for name, fn in (("nn.Linear (unpacked)", unpacked_pass), ("packed", packed_pass),
                     ("packed, q/k/v and gate/up concatenated", joined_pass)):
        ms = _median_ms(fn, args.repeats)
        print(f"{name:40s} {ms:6.1f} ms  ({weights_mb / ms:.1f} GB/s of weights)")


if __name__ == "__main__":
    main()
