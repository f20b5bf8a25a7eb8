"""Device benchmark with random models of realistic shapes: the judge of the engine's speed.

No weights are needed: a Llama-3.2-1B-shaped target and a ~80 M draft are built in-process with
random weights (speed does not depend on the values). Every variant runs the same models; variants
compared with each other run interleaved (the order rotates each repeat) after a warm-up that also
compiles every graph the timed runs need, and medians of the repeats are reported. It measures

- the target's cost of one forward pass over T = 1 .. k_max+1 new tokens, eager and compiled
  (`compile=on`), and the ratio to T = 1 (how much verifying k+1 tokens costs beyond one token);
- the draft's cost per token, and c = draft token cost / target one-token cost, both ways: for one
  pass alone and per draft of a step of k as decoding runs it (`time_draft_step`); the compiled
  passes of 1 and k_max+1 tokens profiled (which operators the wider pass spends more on);
- plain decoding tokens/s at batch sizes 1, 8 and 32: specdec eager and compiled (on a GPU with its
  steps overlapped: `overlap=auto`), and at batch 1 the compiled serial loop (`overlap=off`) and
  transformers' `generate()` with its dynamic cache and with `cache_implementation="static"`
  (which transformers compiles itself on a GPU), against the memory-bandwidth limit (weight bytes /
  bandwidth: every decoding step reads every weight once; bandwidth measured by a device copy and
  from the device's name);
- speculative decoding with forced acceptance (draft i accepted with probability a given drafts
  1..i-1 were: `verifier=forced`, not lossless, marked so), k = 4, eager and compiled (on a GPU with
  its steps pipelined: `overlap=auto`, `specdec.accel.pipeline`) and the compiled serial loop
  (`overlap=off`), against compiled plain decoding;
- on CUDA, compile=on with specdec's own CUDA graphs (`cuda_graphs="explicit"`, a replay a call
  without dynamo) against inductor's (`trees`), interleaved: plain decoding at the first batch size,
  forced acceptance, the one-token pass and c (`--explicit-graphs`; a stage of its own, after the
  batch sizes, so that it never delays the other rows);
- specdec's explicit CUDA graphs with frozen weights against compile=on's defaults (`combined`):
  plain decoding, forced acceptance (its steps captured whole), the passes of 1 and k+1 tokens, c;
- compile=on with frozen weights against compile=on (`frozen`): the same rows; on a GPU both stages
  also give the device memory their engine added (built, compiled and run: frozen constants, graph
  pools, caches), what keeps frozen weights from being the default;
- with `--autotune`, compile=autotune (inductor's GEMM autotuning) against compile=on, interleaved:
  plain decoding and forced acceptance at the first batch size (the last stage: it compiles longest);
- the speedup the measured costs predict (Leviathan et al., with the measured verification cost);
- host synchronisations per decoding step: specdec's counter (eager decoders) and, on a GPU,
  CUDA's own detector (`torch.cuda.set_sync_debug_mode`, every decoder);
- a profile per decoder at batch 1 (torch.profiler, 32 tokens): per token the wall time, the
  device's busy time and share, kernels, kernel launches and CUDA-graph launches, and the
  operators that take the most device time: what stands in the way of a goal it misses;
- the host's time per step under cProfile (plain decoding, forced acceptance pipelined and serial):
  its waits for the device apart from its busy time, and the functions that take the most of it.

By default the stages run most important first (plain decoding at the first batch size, scoring
costs and c, forced acceptance, the other batch sizes, explicit graphs, then what reuses the graphs
compiled so far, then what compiles its own); `--stages` picks stages and their order. The JSON is
written after each, so a run cut short keeps what it measured, and no stage starts past `--budget-s`.

It imports torch, transformers and specdec's core only (a GPU box may lack hydra, wandb, gguf).

    python scripts/bench_gpu.py --out gpu.json                           # on a GPU: <= 8 minutes
    python scripts/bench_gpu.py --device cpu --tiny --dtype float32       # plumbing check anywhere
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout without `pip install` (a bare GPU box)

import specdec.core.verify as verify  # noqa: E402
from specdec.accel.compiled import CompiledForward  # noqa: E402
from specdec.accel.passes import Accelerated
from specdec.accel.syncs import count_host_syncs, detect_cuda_syncs  # noqa: E402
from specdec.core.decoding import SpeculativeDecoder  # noqa: E402
from specdec.core.engine import Engine, synchronize  # noqa: E402
from specdec.core.metrics import (  # noqa: E402
    draft_token_cost,
    expected_tokens_per_step,
    predicted_speedup,
    tokens_per_s,
)
from specdec.core.sampling import greedy_tokens  # noqa: E402
from specdec.proposers.draft_model import DraftModelProposer  # noqa: E402

SHAPES = {
    # Llama-3.2-1B: 1.24 B parameters (embeddings tied)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    # a draft of about 80 M parameters with the same vocabulary (66 M of them the tied embeddings)
    "draft": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
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


def time_draft_step(cached, tokens: torch.Tensor, context: int, k: int, repeats: int) -> float:
    """Median seconds of a greedy draft model's step of k drafts as the decoder runs it, after
    `context` cached positions: the catch-up on `tokens[:, context]` (`tokens: [1, > context]`) and
    k - 1 greedy passes after it; under compile=on one compiled call (`catch_up_chain`, a greedy draft
    with a fixed k), eagerly the passes one by one. Divided by k it is the draft's cost per drafted
    token as decoding pays it (`c_in_step`), where `time_forward` times one pass alone."""
    times = []
    for _ in range(repeats + 2):
        cached.rollback([context])
        synchronize(cached.device)
        t = time.perf_counter()
        if cached.catch_up_chain(tokens, [context + 1], k - 1) is None:
            logits = cached.catch_up(tokens, [context + 1])
            for _ in range(k - 1):
                logits = cached.forward(greedy_tokens(logits)[:, None])[:, 0]
            greedy_tokens(logits)
        synchronize(cached.device)
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def device_memory_gb(device: torch.device) -> float | None:
    """GB of device memory the process's tensors hold now (CUDA graphs' pools included); None on a CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device) / 1e9


def memory_added(before: float | None, device: torch.device) -> float | None:
    """GB of device memory held now beyond `before` (`device_memory_gb`): what an engine built, warmed
    and run since then keeps (frozen graphs' constants, graph pools, caches); None on a CPU."""
    now = device_memory_gb(device)
    return None if before is None or now is None else now - before


def measure_bandwidth(device: torch.device, gib: float = 1.0, repeats: int = 5) -> float | None:
    """GB/s of a device-to-device copy of `gib` GiB (read + write), median of repeats; None on a CPU,
    where the name-based table has no entry and a copy measures caches as much as memory."""
    if device.type != "cuda":
        return None
    x = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        t = time.perf_counter()
        y.copy_(x)
        synchronize(device)
        times.append(time.perf_counter() - t)
    del x, y
    return 2 * gib * 2**30 / statistics.median(times[1:]) / 1e9


def interleaved(variants: dict, repeats: int) -> dict[str, list[float]]:
    """Run every variant (a callable returning a number) once untimed (the warm-up, which compiles
    every graph the timed runs reach), then `repeats` times, the order rotating each repeat; returns
    each variant's numbers."""
    for run in variants.values():
        run()
    names = list(variants)
    out = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names):] + names[: r % len(names)]:
            out[n].append(variants[n]())
    return out


def decode_rate(decoder: SpeculativeDecoder, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens per second of the decoding phase (prefill excluded), all rows together."""
    s = decoder.generate(prompts, max_new_tokens=new_tokens).stats
    return tokens_per_s(s.new_tokens - len(prompts), s.wall_s - s.ttft_s)


# --stages' names, in the order the stages run by default: most important first.
STAGES = ("plain", "scoring", "forced", "batches", "explicit", "syncs", "profiles", "host", "combined", "frozen",
          "autotune")

# CUDA runtime and driver calls that start device work: each is a launch the host pays for
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
GRAPH_CALLS = ("cudaGraphLaunch", "cuGraphLaunch")


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by the union of (start, end) intervals (kernels on several streams may overlap)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _profiled(decoder: SpeculativeDecoder, prompts: list[list[int]], new_tokens: int) -> dict:
    """One generation under torch.profiler: its wall microseconds, the device's busy microseconds (the
    union of its kernels' intervals), kernels, kernel and CUDA-graph launches, and each operator's own
    time (device time on a GPU, host time on a CPU), by name."""
    from torch.profiler import ProfilerActivity, profile

    device = decoder.engine.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    t = time.perf_counter()
    with profile(activities=activities) as prof:
        decoder.generate(prompts, max_new_tokens=new_tokens)
        synchronize(device)
    return {"wall_us": (time.perf_counter() - t) * 1e6, **_profile_summary(prof, device)}


def _profile_summary(prof, device: torch.device) -> dict:
    """What a torch.profiler trace holds: the device's busy microseconds (the union of its kernels'
    intervals), kernels, kernel and CUDA-graph launches, and each operator's calls and own time
    (device time on a GPU, host time on a CPU), by name."""
    from torch.autograd import DeviceType

    events = prof.events()
    kernels = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    ops = {a.key: (a.count, getattr(a, key)) for a in prof.key_averages() if a.key not in LAUNCH_CALLS + GRAPH_CALLS}
    return {"busy_us": _busy_us(kernels), "kernels": len(kernels),
            "launches": sum(e.name in LAUNCH_CALLS for e in events),
            "graph_launches": sum(e.name in GRAPH_CALLS for e in events), "ops": ops}


def profile_pass(cached, tokens: torch.Tensor, context: int, repeats: int, top: int = 8) -> dict:
    """One pass over `tokens: [1, T]` after `context` cached positions, `repeats` times under
    torch.profiler after a warm-up: per pass the device's busy milliseconds, kernels, and the `top`
    operators by their own device time (on a CPU, host time). Side by side for T = 1 and a wider T it
    says which kernels make the wider pass cost more (the scoring goal)."""
    from torch.profiler import ProfilerActivity, profile

    cached.rollback([context])
    cached.forward(tokens)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cached.device.type == "cuda" else [])
    synchronize(cached.device)
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            cached.rollback([context])
            cached.forward(tokens)
        synchronize(cached.device)
    summary = _profile_summary(prof, cached.device)
    ranked = sorted(summary["ops"].items(), key=lambda kv: kv[1][1], reverse=True)[:top]
    return {"device_busy_ms": summary["busy_us"] / 1e3 / repeats, "kernels": summary["kernels"] / repeats,
            "top": [{"name": name, "calls": calls / repeats, "self_ms": us / 1e3 / repeats}
                    for name, (calls, us) in ranked]}


def profile_run(decoder: SpeculativeDecoder, prompts: list[list[int]], new_tokens: int, top: int = 12) -> dict:
    """What stands between a decoder and the bandwidth limit, per token of the decoding phase: one
    generation of `new_tokens` under torch.profiler, after a warm-up, less one of a single token (the
    prefill, which runs eagerly, and the first token), so that the prompt's passes are not spread over
    the decoded tokens. Per decoded token: wall time, the device's busy time and its share of the wall
    time, kernels, kernel launches and CUDA-graph launches; the `top` operators by their own device
    time in the decoding phase (on a CPU, by their own host time)."""
    decoder.generate(prompts, max_new_tokens=new_tokens)
    full, first = _profiled(decoder, prompts, new_tokens), _profiled(decoder, prompts, 1)
    n = new_tokens - 1
    per = {k: (full[k] - first[k]) / n for k in ("wall_us", "busy_us", "kernels", "launches", "graph_launches")}
    ops = {name: (calls - first["ops"].get(name, (0, 0))[0], us - first["ops"].get(name, (0, 0))[1])
           for name, (calls, us) in full["ops"].items()}
    ranked = sorted(ops.items(), key=lambda kv: kv[1][1], reverse=True)[:top]
    return {
        "tokens": n, "wall_ms_per_token": per["wall_us"] / 1e3,
        "device_busy_ms_per_token": per["busy_us"] / 1e3,
        "device_busy_share": per["busy_us"] / per["wall_us"] if per["wall_us"] > 0 else 0.0,
        "kernels_per_token": per["kernels"], "launches_per_token": per["launches"],
        "graph_launches_per_token": per["graph_launches"],
        "top": [{"name": name, "calls": calls, "self_ms": us / 1e3} for name, (calls, us) in ranked],
        "ranked_by": "device time" if decoder.engine.device.type == "cuda" else "host time (no device)",
        "excludes": "the prefill and the first token (a one-token generation, profiled and subtracted)",
    }


# Host calls that wait for the device (or for a copy from it): their time is the host idle, not busy.
WAITS = {"synchronize", "tolist", "item", "_local_scalar_dense", "cpu"}


def _waits(name: str) -> bool:
    """Whether a cProfile entry (`file:line(name)`, a builtin as `<method 'tolist' of ...>` or
    `<built-in method tolist>`) is one of `WAITS`, by its own name, not a name that contains one."""
    own = name.rsplit("(", 1)[-1].rstrip(")")
    own = own.split("'")[1] if own.startswith("<method '") else own.removeprefix("<built-in method ").rstrip(">")
    return own.rsplit(".", 1)[-1] in WAITS


def _host_calls(decoder: SpeculativeDecoder, prompts: list[list[int]], new_tokens: int) -> tuple[dict, int]:
    """One generation under cProfile: per function (`file:line(name)`) its calls and own seconds, and
    the generation's decoding steps."""
    profiler = cProfile.Profile()
    profiler.enable()
    out = decoder.generate(prompts, max_new_tokens=new_tokens)
    profiler.disable()
    calls = {f"{Path(f).name}:{line}({name})": (cc, tt)
             for (f, line, name), (cc, _, tt, _, _) in pstats.Stats(profiler).stats.items()}
    return calls, out.stats.steps


def host_profile(decoder: SpeculativeDecoder, prompts: list[list[int]], new_tokens: int, top: int = 15) -> dict:
    """Where the host's time goes in a decoding step (what a device that waits for the host waits
    for): one generation under cProfile, less one of a single token (the prefill), after a warm-up.
    Per step: the profiled wall time, the time spent waiting for the device (`WAITS`: the reads), the
    rest (the host busy), and the `top` functions by their own time outside the waits. cProfile's
    own cost inflates Python-heavy code, so the shares matter more than the milliseconds."""
    decoder.generate(prompts, max_new_tokens=new_tokens)
    synchronize(decoder.engine.device)
    t = time.perf_counter()
    full, steps = _host_calls(decoder, prompts, new_tokens)
    synchronize(decoder.engine.device)
    wall = time.perf_counter() - t
    t = time.perf_counter()
    first, first_steps = _host_calls(decoder, prompts, 1)
    synchronize(decoder.engine.device)
    wall -= time.perf_counter() - t
    n = max(steps - first_steps, 1)
    # Each function's calls and own time in the decoding phase: the difference of two measured runs,
    # which noise can take below zero where the decoding phase spent next to nothing (a CPU's waits).
    own = {name: (max(cc - first.get(name, (0, 0))[0], 0), max(tt - first.get(name, (0, 0))[1], 0.0))
           for name, (cc, tt) in full.items()}
    waiting = sum(tt for name, (_, tt) in own.items() if _waits(name))
    ranked = sorted(((name, cc, tt) for name, (cc, tt) in own.items() if not _waits(name)),
                    key=lambda x: x[2], reverse=True)
    return {"steps": n, "wall_ms_per_step": wall / n * 1e3, "wait_ms_per_step": waiting / n * 1e3,
            "host_ms_per_step": (wall - waiting) / n * 1e3,
            "top": [{"name": name, "calls_per_step": cc / n, "own_ms_per_step": tt / n * 1e3}
                    for name, cc, tt in ranked[:top]]}


def hf_rate(model, prompt: torch.Tensor, new_tokens: int, **kwargs) -> float:
    """Decoding-phase tokens/s of transformers' generate(): (N - 1) tokens over the time of generating
    N minus the time of generating 1 (the prefill), EOS ignored."""
    def run(n):
        synchronize(prompt.device)
        t = time.perf_counter()
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, **kwargs)
        synchronize(prompt.device)
        return time.perf_counter() - t
    return (new_tokens - 1) / max(run(new_tokens) - run(1), 1e-9)


def make_engine(target, draft, device, dtype, compiled: bool, backend: str, cuda_graphs: str = "trees",
                autotune: bool = False, freezing: bool | None = None) -> Engine:
    """An engine over the shared models; `freezing` True or False overrides where inductor freezes the
    weights (by default: on a CPU only, `specdec.accel.compiled.freezes`)."""
    engine = Engine(target, draft, device=device, dtype=dtype, passes=Accelerated(compile=("autotune" if autotune else "on") if compiled else "off", cuda_graphs=cuda_graphs))
    if compiled and (backend != "inductor" or freezing is not None):  # the tests' quick graphs: dynamo's eager backend
        for m in (engine.target, engine.draft):
            m.compiled = CompiledForward(m, backend=backend, cuda_graphs=cuda_graphs, autotune=autotune,
                                         freezing=freezing)
    return engine


def plain(engine: Engine, overlap: str = "auto") -> SpeculativeDecoder:
    """Plain decoding one token wide (the fastest plain decoding; exact greedy's fixed width is a
    numerics choice, not a speed one); `overlap` as the decoder takes it (auto: on a GPU, step n+1
    is queued before step n's token is read)."""
    decoder = SpeculativeDecoder(engine, eos_token_id=[], overlap=overlap)
    decoder.exact_greedy = False
    return decoder


def forced(engine: Engine, k: int, acceptance: float, overlap: str = "auto") -> SpeculativeDecoder | None:
    """Speculative decoding with forced acceptance, or None where this specdec has no forced verifier;
    `overlap` as the decoder takes it (auto: on a GPU, compiled, step n+1 is queued before step n's
    outcome is read: `specdec.accel.pipeline`)."""
    if not hasattr(verify, "ForcedVerifier"):
        return None
    decoder = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=k, eos_token_id=[],
                                 verifier=verify.ForcedVerifier(acceptance), overlap=overlap)
    decoder.exact_greedy = False
    return decoder


def syncs_per_step(decoder: SpeculativeDecoder, prompt: list[int], new_tokens: int, count: bool) -> dict:
    """One generation's host synchronisations per step (the prefill's first token included):
    `counted` by specdec's counter (`count`: eager decoders only; inside it compiled calls run as
    their Python, so a compiled decoder would be counted on its eager path) and, on a GPU, `cuda` as
    CUDA's detector reports them."""
    out: dict[str, float] = {}
    if count:
        with count_host_syncs() as syncs:
            steps = decoder.generate([prompt], max_new_tokens=new_tokens).stats.steps
        out["counted"] = syncs.total / steps
    if decoder.engine.device.type == "cuda":
        with detect_cuda_syncs() as detected:
            steps = decoder.generate([prompt], max_new_tokens=new_tokens).stats.steps
        out["cuda"] = len(detected) / steps
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--shape", default="1b", choices=["1b", "tiny"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (same as --shape tiny): a plumbing check")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens (and cached positions for the costs)")
    ap.add_argument("--k-max", type=int, default=8, help="scoring costs for T = 1 .. k_max + 1")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens per decoding run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--k", type=int, default=4, help="drafts per step for forced acceptance")
    ap.add_argument("--acceptance", type=float, default=0.8, help="forced acceptance per position")
    ap.add_argument("--skip-hf", action="store_true", help="leave out transformers' generate()")
    ap.add_argument("--compile-backend", default="inductor", help=argparse.SUPPRESS)
    ap.add_argument("--explicit-graphs", choices=("auto", "on", "off"), default="auto",
                    help="also run compile=on with specdec's own CUDA graphs (cuda_graphs=explicit) beside "
                         "inductor's: plain decoding at the first batch size, c, forced acceptance; auto: on CUDA")
    ap.add_argument("--autotune", action="store_true",
                    help="also run compile=autotune (inductor's GEMM autotuning) against compile=on, interleaved: "
                         "plain decoding and forced acceptance at the first batch size, a stage of its own, last "
                         "(its compiling takes longer)")
    ap.add_argument("--bandwidth", type=float, default=None, help="peak memory bandwidth, GB/s")
    ap.add_argument("--budget-s", type=float, default=450,
                    help="seconds after which no further stage starts (the stages run most important first)")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help="the stages to run, in the order given, comma-separated (the default: all, most "
                         "important first): " + ", ".join(STAGES)
                         + " (a rerun can leave out what an earlier run measured, and put first what it lacks)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    stages = list(dict.fromkeys(s.strip() for s in args.stages.split(",") if s.strip()))  # in order, once each
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        ap.error(f"--stages: unknown {', '.join(unknown)}; the stages are {', '.join(STAGES)}")
    shape = "tiny" if args.tiny else args.shape
    began = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - began:6.1f} s] {msg}", flush=True)

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    target = build(shape, device, dtype)
    draft = build("draft" if shape == "1b" else "tiny", device, dtype)
    engines = {"eager": make_engine(target, draft, device, dtype, False, args.compile_backend),
               "compiled": make_engine(target, draft, device, dtype, True, args.compile_backend)}
    # compile=on with specdec's own CUDA graphs: where host time per call counts most (batch 1)
    explicit = args.explicit_graphs == "on" or (args.explicit_graphs == "auto" and device.type == "cuda")
    others = {"compiled explicit": make_engine(target, draft, device, dtype, True, args.compile_backend,
                                               "explicit")} if explicit else {}
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    context_ids = torch.randint(0, vocab, (1, args.context), generator=gen).to(device)
    prompt = context_ids[0].tolist()
    next_ids = torch.cat([context_ids, context_ids[:, :1]], dim=1)  # [1, context + 1]: a token to catch up on
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    measured_bw = measure_bandwidth(device)
    nominal_bw = next((v for k, v in BANDWIDTH_GBS.items() if k in name), None)
    bandwidth = args.bandwidth or measured_bw or nominal_bw
    wbytes = weight_bytes(target)
    limit = bandwidth * 1e9 / wbytes if bandwidth else None
    med = statistics.median
    result = {
        "device": name, "dtype": args.dtype, "shape": shape, "context": args.context, "new_tokens": args.new_tokens,
        "repeats": args.repeats, "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "target_params": sum(p.numel() for p in target.parameters()), "target_weight_bytes": wbytes,
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "bandwidth_gbs": bandwidth, "bandwidth_measured_gbs": measured_bw, "bandwidth_nominal_gbs": nominal_bw,
        "bandwidth_limit_tokens_per_s": limit, "plain_tokens_per_s": {}, "plain_runs": {}, "forced": None,
        "stages_s": {}, "skipped": [], "errors": {},
    }
    log(f"models built: target {wbytes / 1e9:.2f} GB, draft {weight_bytes(draft) / 1e9:.2f} GB")

    def save() -> None:
        """The JSON as it stands: written after every stage, so that a run cut short keeps what it measured."""
        result["compile_report"] = engines["compiled"].compile_report()
        result["compile_report_explicit"] = others["compiled explicit"].compile_report() if others else None
        result["seconds"] = time.perf_counter() - began
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)

    def stage(title: str, run, name: str) -> None:
        """Run one stage unless the time budget is spent (then it is listed in `skipped`)."""
        if time.perf_counter() - began > args.budget_s:
            result["skipped"].append(title)
            log(f"{title}: skipped, past the {args.budget_s:.0f} s budget")
            return
        t = time.perf_counter()
        try:
            run()
        except Exception:  # a stage that fails on a device keeps the others' numbers: record it, go on
            result["errors"][title] = traceback.format_exc()
            log(f"{title}: FAILED\n{result['errors'][title]}")
        result["stages_s"][title] = round(time.perf_counter() - t, 1)
        save()
        log(title)

    def prefill(engine: Engine) -> None:
        """Both models' caches hold the context, one row, before `time_forward` (the prefill runs
        eagerly: wider than a compiled pass)."""
        for model in (engine.target, engine.draft):
            model.reset(1, args.context + args.k_max + args.new_tokens + 16)
            model.forward(context_ids)

    def plain_decoding(b: int) -> None:
        """Plain decoding, eager and compiled, at batch size b; at batch 1 also the compiled serial loop
        (what overlapping the steps is worth) and transformers' generate()."""
        prompts = [prompt] * b
        decoders = {n: plain(e) for n, e in engines.items()}
        variants = {f"specdec {n}": (lambda d=d, p=prompts: decode_rate(d, p, args.new_tokens))
                    for n, d in decoders.items()}
        if b == 1:
            serial = plain(engines["compiled"], "off")
            variants["specdec compiled serial"] = lambda d=serial: decode_rate(d, [prompt], args.new_tokens)
        if b == 1 and not args.skip_hf:
            hf = engines["eager"].target.model
            variants["transformers dynamic"] = lambda hf=hf: hf_rate(hf, context_ids, args.new_tokens)
            variants["transformers static"] = lambda hf=hf: hf_rate(hf, context_ids, args.new_tokens,
                                                                    cache_implementation="static")
        runs = interleaved(variants, args.repeats)
        result["plain_runs"][b] = runs
        rates = result["plain_tokens_per_s"][b] = {v: med(x) for v, x in runs.items()}
        if b == batch_sizes[0]:
            result["decode_tokens_per_s"] = rates["specdec eager"]
            result["fraction_of_bandwidth_limit"] = {v: r / limit for v, r in rates.items()} if limit else None

    def scoring_costs() -> None:
        """The target's pass over T = 1 .. k_max+1 tokens and the draft's token cost, eager and compiled."""
        costs, draft_cost, step_cost = {}, {}, {}
        for n, engine in engines.items():
            prefill(engine)
            costs[n] = {t: time_forward(engine.target, context_ids[:, :t], args.context, args.repeats)
                        for t in range(1, args.k_max + 2)}
            draft_cost[n] = time_forward(engine.draft, context_ids[:, :1], args.context, args.repeats)
            step_cost[n] = time_draft_step(engine.draft, next_ids, args.context, args.k, args.repeats)
        c = {n: draft_token_cost(draft_cost[n], 1, costs[n][1]) for n in engines}
        c_step = {n: draft_token_cost(step_cost[n], args.k, costs[n][1]) for n in engines}
        widest = args.k_max + 1  # what a compiled pass of 1 and of the widest T spend their device time on
        result["compiled_pass_profiles"] = {
            t: profile_pass(engines["compiled"].target, context_ids[:, :t], args.context, args.repeats)
            for t in (1, widest)}
        result.update({
            "target_forward_ms": {t: v * 1e3 for t, v in costs["eager"].items()},
            "verify_ratio": {t: v / costs["eager"][1] for t, v in costs["eager"].items()},
            "compiled_target_forward_ms": {t: v * 1e3 for t, v in costs["compiled"].items()},
            "compiled_verify_ratio": {t: v / costs["compiled"][1] for t, v in costs["compiled"].items()},
            "draft_token_ms": draft_cost["eager"] * 1e3, "c": c["eager"],
            "compiled_draft_token_ms": draft_cost["compiled"] * 1e3, "compiled_c": c["compiled"],
            # the draft's step of k drafts as decoding runs it (one compiled call under compile=on), per draft
            "draft_step_ms": {n: v * 1e3 for n, v in step_cost.items()}, "c_in_step": c_step,
            # specdec.core.metrics' cost model in units of one target step: E tokens per step of k draft
            # tokens at c each plus one scoring pass of k+1 tokens (Leviathan et al., measured costs)
            "predicted_speedup": {
                f"alpha={a},k={k}": predicted_speedup(expected_tokens_per_step([a] * k), 1.0,
                                                      k * c["compiled"] + costs["compiled"][k + 1] / costs["compiled"][1])
                for a in (0.6, 0.8, 0.9) for k in (2, 4, 8) if k <= args.k_max},
        })

    def forced_acceptance() -> None:
        """Speculative decoding with forced acceptance, batch 1, against compiled plain decoding."""
        if forced(engines["eager"], args.k, args.acceptance) is None:
            result["forced_note"] = "skipped: this specdec has no verifier=forced (specdec/core/verify.py)"
            return
        base = plain(engines["compiled"])
        variants = {"plain compiled": lambda: decode_rate(base, [prompt], args.new_tokens)}
        for n, engine in engines.items():
            d = forced(engine, args.k, args.acceptance)
            variants[f"forced {n}"] = lambda d=d: decode_rate(d, [prompt], args.new_tokens)
        serial = forced(engines["compiled"], args.k, args.acceptance, "off")  # what pipelining the steps is worth
        variants["forced compiled serial"] = lambda: decode_rate(serial, [prompt], args.new_tokens)
        runs = interleaved(variants, args.repeats)
        result["forced"] = {
            "k": args.k, "acceptance": args.acceptance, "lossless": False,
            "tokens_per_s": {v: med(x) for v, x in runs.items()}, "runs": runs,
            "speedup_over_compiled_plain": {v: med(x) / med(runs["plain compiled"])
                                            for v, x in runs.items() if v != "plain compiled"}}

    def side_by_side(base: str, other: str, engine: Engine, b: int) -> dict:
        """Plain decoding and forced acceptance on compile=on's engine (`base`) and on `engine`
        (`other`), interleaved, at batch b: the runs, their median rates and other / base per kind."""
        decoders = {f"plain {base}": plain(engines["compiled"]), f"plain {other}": plain(engine)}
        if forced(engine, args.k, args.acceptance) is not None:
            decoders |= {f"forced {base}": forced(engines["compiled"], args.k, args.acceptance),
                         f"forced {other}": forced(engine, args.k, args.acceptance)}
        variants = {v: (lambda d=d: decode_rate(d, [prompt] * b, args.new_tokens)) for v, d in decoders.items()}
        runs = interleaved(variants, args.repeats)
        rates = {v: med(x) for v, x in runs.items()}
        return {"batch": b, "tokens_per_s": rates, "runs": runs,
                f"{other}_over_{base}": {kind: rates[f"{kind} {other}"] / rates[f"{kind} {base}"]
                                         for kind in ("plain", "forced") if f"{kind} {base}" in rates}}

    def pipeline_report(engine: Engine) -> dict | None:
        """How forced acceptance's steps ran on `engine` (pipelined? captured whole?), from a short
        generation's report; None where they did not pipeline or there is no forced verifier."""
        steps = forced(engine, args.k, args.acceptance)
        return None if steps is None else steps.generate([prompt], max_new_tokens=16).reports.get("pipeline")

    def explicit_graphs() -> None:
        """compile=on with specdec's own CUDA graphs against inductor's, interleaved, at the first batch
        size: plain decoding and forced acceptance; then the one-token passes and c."""
        engine = others["compiled explicit"]
        compared = side_by_side("trees", "explicit", engine, batch_sizes[0])
        prefill(engine)
        target_s = time_forward(engine.target, context_ids[:, :1], args.context, args.repeats)
        draft_s = time_forward(engine.draft, context_ids[:, :1], args.context, args.repeats)
        step_s = time_draft_step(engine.draft, next_ids, args.context, args.k, args.repeats)
        result["explicit_graphs"] = compared | {
            "target_forward_ms": target_s * 1e3, "draft_token_ms": draft_s * 1e3,
            "c": draft_token_cost(draft_s, 1, target_s), "draft_step_ms": step_s * 1e3,
            "c_in_step": draft_token_cost(step_s, args.k, target_s), "forced_pipeline": pipeline_report(engine)}

    def frozen() -> None:
        """compile=on with the weights frozen into the graphs (inductor's freezing, which also
        concatenates the linear layers that read one input) against compile=on as it is, interleaved,
        at the first batch size: plain decoding and forced acceptance; then the passes of 1 and k + 1
        tokens, both ways. On a CPU compile=on freezes already: there the two are the same graphs."""
        before = device_memory_gb(device)
        engine = make_engine(target, draft, device, dtype, True, args.compile_backend, freezing=True)
        compared = side_by_side("on", "frozen", engine, batch_sizes[0])
        added = memory_added(before, device)
        passes = {}
        for name, e in (("on", engines["compiled"]), ("frozen", engine)):
            prefill(e)
            passes[name] = {t: time_forward(e.target, context_ids[:, :t], args.context, args.repeats) * 1e3
                            for t in (1, args.k + 1)}
        result["frozen"] = compared | {"target_forward_ms": passes, "compile_report": engine.compile_report(),
                                       "device_memory_added_gb": added}

    def combined() -> None:
        """specdec's explicit CUDA graphs with the weights frozen, the two options that each took
        device or host time off a step in run 3, together against compile=on's defaults (inductor's
        graphs, weights not frozen), interleaved at the first batch size: plain decoding and forced
        acceptance (its steps captured whole); then the passes of 1 and k + 1 tokens and c."""
        before = device_memory_gb(device)
        engine = make_engine(target, draft, device, dtype, True, args.compile_backend, "explicit", freezing=True)
        compared = side_by_side("on", "explicit_frozen", engine, batch_sizes[0])
        added = memory_added(before, device)
        prefill(engine)
        target_s = {t: time_forward(engine.target, context_ids[:, :t], args.context, args.repeats)
                    for t in (1, args.k + 1)}
        step_s = time_draft_step(engine.draft, next_ids, args.context, args.k, args.repeats)
        result["combined"] = compared | {
            "target_forward_ms": {t: v * 1e3 for t, v in target_s.items()}, "draft_step_ms": step_s * 1e3,
            "c_in_step": draft_token_cost(step_s, args.k, target_s[1]), "forced_pipeline": pipeline_report(engine),
            "compile_report": engine.compile_report(), "device_memory_added_gb": added}

    def autotuned() -> None:
        """compile=autotune against compile=on, interleaved, at the first batch size: plain decoding
        and forced acceptance; then the one-token pass."""
        engine = make_engine(target, draft, device, dtype, True, args.compile_backend, autotune=True)
        compared = side_by_side("on", "autotune", engine, batch_sizes[0])
        prefill(engine)
        result["autotune"] = compared | {
            "target_forward_ms": time_forward(engine.target, context_ids[:, :1], args.context, args.repeats) * 1e3,
            "compile_report": engine.compile_report()}

    def profiles() -> None:
        """torch.profiler over one generation per decoder at batch 1 (a shorter one: the trace grows
        with every launch): where a goal is missed, what is in the way."""
        n = min(args.new_tokens, 32)
        decoders = {"plain eager": plain(engines["eager"]), "plain compiled": plain(engines["compiled"])}
        if forced(engines["compiled"], args.k, args.acceptance) is not None:
            decoders["forced compiled"] = forced(engines["compiled"], args.k, args.acceptance)
            # the serial loop beside it: how much device idle time pipelining the steps takes away
            decoders["forced compiled serial"] = forced(engines["compiled"], args.k, args.acceptance, "off")
        for name, engine in others.items():
            decoders[f"plain {name}"] = plain(engine)
            if forced(engine, args.k, args.acceptance) is not None:
                decoders[f"forced {name}"] = forced(engine, args.k, args.acceptance)
        result["profiles"] = {v: profile_run(d, [prompt], n) for v, d in decoders.items()}

    def host_time() -> None:
        """The host's time per step under cProfile, batch 1: plain decoding, forced acceptance
        pipelined and serial (and on specdec's explicit CUDA graphs): what a host-bound step spends."""
        decoders = {"plain compiled": plain(engines["compiled"])}
        if forced(engines["compiled"], args.k, args.acceptance) is not None:
            decoders["forced compiled"] = forced(engines["compiled"], args.k, args.acceptance)
            decoders["forced compiled serial"] = forced(engines["compiled"], args.k, args.acceptance, "off")
            for name, engine in others.items():
                decoders[f"forced {name}"] = forced(engine, args.k, args.acceptance)
        result["host"] = {v: host_profile(d, [prompt], args.new_tokens) for v, d in decoders.items()}

    def host_syncs() -> None:
        """Host synchronisations per step, after every timed run."""
        syncs = {f"plain {n}": syncs_per_step(plain(e), prompt, args.new_tokens, n == "eager")
                 for n, e in (engines | others).items()}
        if result["forced"] is not None:
            syncs.update({f"forced {n}": syncs_per_step(forced(e, args.k, args.acceptance), prompt,
                                                        args.new_tokens, n == "eager")
                          for n, e in (engines | others).items()})
        result["host_syncs_per_step"] = syncs

    # The stages by name, most important first: the headline (plain decoding at batch 1 against
    # transformers), then what the speculative goals rest on (scoring costs, c, forced acceptance),
    # then larger batches and explicit graphs; then what reuses the graphs compiled so far (syncs,
    # profiles, host time), before what compiles its own. --stages picks them and their order.
    plan = [("plain", f"plain decoding, batch {batch_sizes[0]}", lambda: plain_decoding(batch_sizes[0])),
            ("scoring", "scoring costs", scoring_costs), ("forced", "forced acceptance", forced_acceptance)]
    plan += [("batches", f"plain decoding, batch {b}", lambda b=b: plain_decoding(b)) for b in batch_sizes[1:]]
    if others:
        plan.append(("explicit", "explicit CUDA graphs", explicit_graphs))
    plan += [("syncs", "host synchronisations", host_syncs), ("profiles", "profiles", profiles),
             ("host", "host time", host_time)]
    if others:  # explicit graphs and frozen weights together: what the forced goal's profile asks for
        plan.append(("combined", "explicit graphs and frozen weights", combined))
    plan.append(("frozen", "frozen weights", frozen))
    if args.autotune:
        plan.append(("autotune", "autotune", autotuned))
    for name in stages:
        for step, title, run in plan:
            if step == name:
                stage(title, run, name)
    save()
    print_tables(result, args)
    return result


def print_side_by_side(title: str, x: dict, base: str, other: str, detail: str) -> None:
    """A `side_by_side` stage's rates, its other / base ratios and what else the stage measured."""
    print(f"\n{title}, batch {x['batch']}:")
    for v, r in x["tokens_per_s"].items():
        print(f"| {v} | {r:.1f} tokens/s |")
    print(f"{other} / {base}: {x[f'{other}_over_{base}']}; {detail}")


def print_tables(result: dict, args) -> None:
    """The measured stages as markdown tables (the stages skipped for time are named)."""
    limit = result["bandwidth_limit_tokens_per_s"]
    print(f"\ndevice {result['device']}, {args.dtype}, torch {result['torch']}, target "
          f"{result['target_params'] / 1e9:.2f} B params, draft {result['draft_params'] / 1e6:.0f} M, context "
          f"{args.context}, {args.new_tokens} new tokens, medians of {args.repeats}")
    if "target_forward_ms" in result:
        e, k = result["target_forward_ms"], result["compiled_target_forward_ms"]
        print("\n| new tokens T | eager ms | eager vs T=1 | compiled ms | compiled vs T=1 |\n|---:|---:|---:|---:|---:|")
        for t in e:
            print(f"| {t} | {e[t]:.2f} | {e[t] / e[1]:.2f} | {k[t]:.2f} | {k[t] / k[1]:.2f} |")
        print(f"\ndraft token: eager {result['draft_token_ms']:.2f} ms (c = {result['c']:.3f}), "
              f"compiled {result['compiled_draft_token_ms']:.2f} ms (c = {result['compiled_c']:.3f}); "
              f"a step of k = {args.k} drafts as decoding runs it: "
              + ", ".join(f"{n} {ms:.2f} ms (c = {result['c_in_step'][n]:.3f} a draft)"
                          for n, ms in result["draft_step_ms"].items()))
        for t, p in result["compiled_pass_profiles"].items():
            ops = "; ".join(f"{op['name'][:48]} {op['self_ms']:.3f} ms x{op['calls']:g}" for op in p["top"][:5])
            print(f"compiled pass over {t} token(s), profiled: device busy {p['device_busy_ms']:.3f} ms, "
                  f"{p['kernels']:g} kernels; top: {ops}")
    lim = f"{limit:.0f} tokens/s ({result['bandwidth_gbs']:.0f} GB/s)" if limit else "unknown (pass --bandwidth)"
    print(f"bandwidth limit at batch 1: {lim}")
    if result["plain_tokens_per_s"]:
        print("\n| batch | decoding | tokens/s | vs specdec eager | share of bandwidth limit x batch |"
              "\n|---:|---|---:|---:|---:|")
    for b, rates in result["plain_tokens_per_s"].items():
        for v, r in rates.items():
            share = f"{r / (limit * b):.1%}" if limit else "-"
            print(f"| {b} | {v} | {r:.1f} | {r / rates['specdec eager']:.2f}x | {share} |")
    forced_result = result["forced"]
    if forced_result is not None:
        print(f"\nforced acceptance {args.acceptance} per position, k = {args.k} (NOT lossless), batch 1:")
        rates = forced_result["tokens_per_s"]
        for v, r in rates.items():
            print(f"| {v} | {r:.1f} tokens/s | {r / rates['plain compiled']:.2f}x |")
    elif "forced_note" in result:
        print(f"\nforced acceptance: {result['forced_note']}")
    if "explicit_graphs" in result:
        x = result["explicit_graphs"]
        print_side_by_side("CUDA graphs, inductor's (trees) against specdec's (explicit)", x, "trees", "explicit",
                           f"explicit: target one-token pass {x['target_forward_ms']:.2f} ms, draft token "
                           f"{x['draft_token_ms']:.2f} ms (c = {x['c']:.3f}), a step of k = {args.k} drafts "
                           f"{x['draft_step_ms']:.2f} ms (c = {x['c_in_step']:.3f} a draft)")
    if "frozen" in result:
        x = result["frozen"]
        print_side_by_side("compile=on with frozen weights against compile=on", x, "on", "frozen",
                           f"target passes, ms by new tokens: {x['target_forward_ms']}; device memory added "
                           f"{x['device_memory_added_gb']} GB")
    if "combined" in result:
        x = result["combined"]
        print_side_by_side("explicit CUDA graphs with frozen weights against compile=on", x, "on", "explicit_frozen",
                           f"target passes, ms by new tokens: {x['target_forward_ms']}; a step of k = {args.k} "
                           f"drafts {x['draft_step_ms']:.2f} ms (c = {x['c_in_step']:.3f} a draft); "
                           f"forced steps: {x['forced_pipeline']}; device memory added {x['device_memory_added_gb']} GB")
    if "autotune" in result:
        x = result["autotune"]
        print_side_by_side("compile=autotune against compile=on", x, "on", "autotune",
                           f"autotune: target one-token pass {x['target_forward_ms']:.2f} ms")
    if "profiles" in result:
        print("\nprofiles, batch 1, per token (torch.profiler):\n| decoder | wall ms | device busy ms | busy share | "
              "kernels | launches | graph launches | top operator |\n|---|---:|---:|---:|---:|---:|---:|---|")
        for v, x in result["profiles"].items():
            first = x["top"][0]["name"][:40] if x["top"] else "-"
            print(f"| {v} | {x['wall_ms_per_token']:.3f} | {x['device_busy_ms_per_token']:.3f} | "
                  f"{x['device_busy_share']:.0%} | {x['kernels_per_token']:.1f} | {x['launches_per_token']:.1f} | "
                  f"{x['graph_launches_per_token']:.2f} | {first} |")
    if "host" in result:
        print("\nhost time per step (cProfile, batch 1; the waits are reads of the device):")
        print("| decoder | wall ms | waiting ms | host busy ms | top function (own ms) |\n|---|---:|---:|---:|---|")
        for v, x in result["host"].items():
            first = f"{x['top'][0]['name']} ({x['top'][0]['own_ms_per_step']:.3f})" if x["top"] else "-"
            print(f"| {v} | {x['wall_ms_per_step']:.3f} | {x['wait_ms_per_step']:.3f} | {x['host_ms_per_step']:.3f} | {first} |")
    if "host_syncs_per_step" in result:
        print("\nhost synchronisations per step (specdec's count; CUDA's detector):")
        for v, x in result["host_syncs_per_step"].items():
            print(f"| {v} | {x.get('counted', '-')} | {x.get('cuda', '-')} |")
    if result["skipped"]:
        print(f"\nskipped for time (--budget-s {args.budget_s:.0f}): {', '.join(result['skipped'])}")
    if result.get("errors"):
        print(f"\nstages that failed (tracebacks in the JSON's errors): {', '.join(result['errors'])}")
    print(f"\nstage seconds: {result['stages_s']}")
    print(f"compiled graphs: {result['compile_report']}; {result['seconds']:.0f} s in all")


if __name__ == "__main__":
    main()
