"""Where a plain decoding step of the embedded SmolLM2 goes on this CPU (eager, one thread).

Measures the memory-bandwidth floor of one token (the weight bytes a pass reads / the copy bandwidth
measured here), the wall time per token of specdec's plain decoding, and a torch.profiler breakdown
of the decode steps by operator: matrix products (the 30 layers' projections and the output head),
attention, and everything else (norms, rotary, elementwise, cache writes, framework overhead).

    python experiments/gpu/cpu_profile.py --tokens 48 --out experiments/gpu/cpu_profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from specdec import Engine, ModelSpec, SpeculativeDecoder, load_model
from specdec.accel.passes import Accelerated

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
ATTENTION = ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_attention_math")


def copy_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy (read + write counted once each), median of repeats."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model, tok = load_model(ModelSpec(path="embedded"))
    engine = Engine(model, device="cpu", dtype=args.dtype, passes=Accelerated(compile="off"))
    plain = SpeculativeDecoder(engine, tokenizer=tok, eos_token_id=[])
    prompt = "Explain how a refrigerator keeps food cold, step by step."
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.target.model.parameters())
    head = engine.target.model.get_output_embeddings().weight
    bandwidth = copy_bandwidth()
    floor_s = weight_bytes / bandwidth

    plain.generate([prompt], max_new_tokens=8)  # warm-up
    per_token = []
    for _ in range(args.repeats):
        gen = plain.generate([prompt], max_new_tokens=args.tokens)
        per_token.append((gen.stats.wall_s - gen.stats.ttft_s) / (args.tokens - 1))
    step_s = statistics.median(per_token)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        gen = plain.generate([prompt], max_new_tokens=args.tokens)
    decode_s = gen.stats.wall_s - gen.stats.ttft_s
    buckets: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        # self time only, so that a parent (aten::linear) and its child (aten::mm) are not both counted
        name = "matmul" if ev.key in MATMUL else "attention" if ev.key in ATTENTION else None
        if name:
            buckets[name] += ev.self_cpu_time_total / 1e6
    profiled_s = gen.stats.wall_s
    buckets["other (norms, rotary, elementwise, cache writes, Python)"] = profiled_s - sum(buckets.values())

    result = {
        "args": vars(args), "weight_bytes": weight_bytes, "output_head_bytes": head.numel() * head.element_size(),
        "copy_bandwidth_gb_s": bandwidth / 1e9, "bandwidth_floor_ms": floor_s * 1e3,
        "per_token_ms": step_s * 1e3, "share_of_bandwidth_limit": floor_s / step_s,
        "profiled_wall_s": profiled_s, "profiled_decode_s": decode_s,
        "breakdown_s": dict(buckets), "breakdown_share": {k: v / profiled_s for k, v in buckets.items()},
        "torch": torch.__version__,
    }
    print(f"weights {weight_bytes / 1e6:.0f} MB (output head {result['output_head_bytes'] / 1e6:.0f} MB), "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s -> floor {floor_s * 1e3:.1f} ms/token")
    print(f"plain decoding {step_s * 1e3:.1f} ms/token (median of {args.repeats}): "
          f"{floor_s / step_s:.0%} of the bandwidth limit")
    for k, v in buckets.items():
        print(f"  {k:60s} {v:7.3f} s  {v / profiled_s:5.1%}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
