"""Device benchmark with random models of realistic shapes: what a step costs on this accelerator.

No weights are needed: a Llama-3.2-1B-shaped target and a small draft are built in-process with
random weights (speed does not depend on the values). It reports

- the target's cost of one forward pass over T = 1 .. k_max+1 new tokens at a given context,
  and the ratio to T = 1 (how much verifying k+1 tokens costs beyond plain decoding);
- the draft's cost per token, and c = draft token cost / target step cost;
- plain decoding tokens/s through specdec's engine, against the memory-bandwidth limit
  (weight bytes / bandwidth: every decoding step reads every weight once);
- the speedup the measured costs predict for a range of acceptance rates and k (Leviathan et al.,
  with the measured verification cost instead of assuming it equals one step).

Timings synchronize the device before reading the clock; medians of repeated runs after warm-up.

    python scripts/bench_gpu.py --device cuda --out gpu.json        # on a GPU
    python scripts/bench_gpu.py --device cpu --shape tiny            # plumbing check anywhere
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.decoding import SpeculativeDecoder
from specdec.engine import Engine, synchronize

SHAPES = {
    # Llama-3.2-1B: 1.24 B parameters (embeddings tied)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    # a draft of about 90 M parameters with the same vocabulary
    "draft": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=128256, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
}
# Peak memory bandwidth in GB/s by device name fragment; --bandwidth overrides.
BANDWIDTH_GBS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "A10G": 600, "T4": 320}


def build(shape: str, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval().requires_grad_(False)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def time_forward(cached, tokens: torch.Tensor, context: int, repeats: int) -> float:
    """Median seconds of one forward over `tokens: [1, T]` after `context` cached positions."""
    times = []
    for _ in range(repeats + 2):
        cached.rollback([context])
        synchronize(cached.device)
        t = time.perf_counter()
        cached.forward(tokens)
        synchronize(cached.device)
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def predicted_speedup(alpha: float, k: int, c: float, verify_ratio: float) -> float:
    """Expected tokens per step (1 - alpha^(k+1)) / (1 - alpha), over the step's cost in target
    steps: k draft tokens at c each plus one verification of k+1 tokens (verify_ratio)."""
    tokens = k + 1 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + verify_ratio)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--shape", default="1b", choices=["1b", "tiny"])
    ap.add_argument("--context", type=int, default=512, help="cached positions before the timed pass")
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens for the plain-decoding run")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--bandwidth", type=float, default=None, help="peak memory bandwidth, GB/s")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    target = build(args.shape, device, dtype)
    draft = build("draft" if args.shape == "1b" else "tiny", device, dtype)
    engine = Engine(target, draft, device=device, dtype=dtype)
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    context_ids = torch.randint(0, vocab, (1, args.context), generator=gen).to(device)

    costs = {}
    for model in (engine.target, engine.draft):
        model.reset(1, args.context + args.k_max + args.new_tokens + 8)
        model.forward(context_ids)
    for t in range(1, args.k_max + 2):
        costs[t] = time_forward(engine.target, context_ids[:, :t], args.context, args.repeats)
    draft_cost = time_forward(engine.draft, context_ids[:, :1], args.context, args.repeats)

    decoder = SpeculativeDecoder(engine, eos_token_id=[])
    prompt = [context_ids[0].tolist()]
    decoder.generate(prompt, max_new_tokens=8)  # warm-up
    runs = [decoder.generate(prompt, max_new_tokens=args.new_tokens).stats for _ in range(3)]
    decode_s = statistics.median((s.wall_s - s.ttft_s) / max(s.new_tokens - 1, 1) for s in runs)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bandwidth = args.bandwidth or next((v for k, v in BANDWIDTH_GBS.items() if k in name), None)
    wbytes = weight_bytes(target)
    limit = bandwidth * 1e9 / wbytes if bandwidth else None
    c = draft_cost / costs[1]
    result = {
        "device": name, "dtype": args.dtype, "shape": args.shape, "context": args.context,
        "target_params": sum(p.numel() for p in target.parameters()), "target_weight_bytes": wbytes,
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "target_forward_ms": {t: v * 1e3 for t, v in costs.items()},
        "verify_ratio": {t: v / costs[1] for t, v in costs.items()},
        "draft_token_ms": draft_cost * 1e3, "c": c,
        "decode_tokens_per_s": 1 / decode_s, "bandwidth_gbs": bandwidth,
        "bandwidth_limit_tokens_per_s": limit,
        "fraction_of_bandwidth_limit": (1 / decode_s) / limit if limit else None,
        "predicted_speedup": {
            f"alpha={a},k={k}": predicted_speedup(a, k, c, costs[k + 1] / costs[1])
            for a in (0.6, 0.8, 0.9) for k in (2, 4, 8) if k <= args.k_max
        },
    }
    print(f"device {name}, {args.dtype}, target {result['target_params'] / 1e9:.2f} B params, "
          f"context {args.context}")
    print("| new tokens T | target forward (ms) | cost vs T=1 |\n|---|---|---|")
    for t in costs:
        print(f"| {t} | {costs[t] * 1e3:.2f} | {costs[t] / costs[1]:.2f} |")
    print(f"draft token {draft_cost * 1e3:.2f} ms, c = {c:.3f}")
    lim = f"{limit:.0f}" if limit else "unknown (pass --bandwidth)"
    print(f"plain decoding {1 / decode_s:.1f} tokens/s; bandwidth limit {lim} tokens/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
