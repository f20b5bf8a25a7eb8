"""The one command for a GPU machine: the GPU checks a CPU cannot run, then the device benchmark.

    python scripts/device_check.py --out-dir <dir>               # on a GPU: checks (a few minutes), then bench_gpu
    python scripts/device_check.py --device cpu --skip-bench      # the same checks' plumbing, anywhere

A GPU box may lack pytest, hydra, wandb, gguf and datasets: this needs torch and transformers only.
The checks, on tiny random models in float32 (so that tokens must be identical):

1. compile=on (inductor; CUDA graphs on a GPU) gives the eager path's greedy tokens: plain decoding
   (compiled with its steps overlapped, against the eager serial loop) and a draft model at k = 1
   and 4 (at k = 4 its steps pipelined, `specdec.accel.pipeline`), a single prompt and a ragged batch of three, and EAGLE's token trees (the tests' tiny
   trained drafter) on the ragged batch; on a GPU no compiled graph may run without CUDA graphs
   (`cuda_graph_skips`, with the captures, in each case's compile report); and with specdec's own
   CUDA graphs (`cuda_graphs="explicit"`) plain decoding, the draft model at k = 4 and EAGLE on the
   ragged batch, each model with graphs captured (one decoder after another, each dropped before
   the next captures: the device's graph pool outlives them), the draft model's pipelined steps
   captured whole (`graphed_steps` > 0, no `step_graph_error`); and the draft model at k = 4 with
   inductor's weight freezing (`frozen`, the benchmark's frozen stage), under inductor's graphs and
   under specdec's (the benchmark's combined stage);
2. host synchronisations: CUDA's own detector (`torch.cuda.set_sync_debug_mode`) sees no more per
   generation than specdec's count, which is one read a step plus the prefill's (eager plain
   decoding serial and overlapped, draft-model, n-gram and EAGLE decoding; skipped without CUDA).

Compiling on a GPU may take longer than expected, and the benchmark's numbers are what a GPU run
is for: no case of check 1 starts past --checks-budget-s (150 s; the ragged cases of each
method and graph mode first, then the single-prompt and k = 1 ones), and those left out are named
as skipped, not failed.

It writes `checks.json` (and, unless --skip-bench, the benchmark's `bench_gpu.json`) to --out-dir,
prints a line per check, and exits 1 if a check failed (the benchmark runs anyway: its numbers stand
on their own).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdec.accel.compiled import CompiledForward  # noqa: E402
from specdec.accel.passes import Accelerated  # noqa: E402
from specdec.accel.syncs import count_host_syncs, detect_cuda_syncs  # noqa: E402
from specdec.core.decoding import SpeculativeDecoder  # noqa: E402
from specdec.core.engine import Engine  # noqa: E402
from specdec.models import tiny_random_model  # noqa: E402
from specdec.proposers.draft_model import DraftModelProposer  # noqa: E402
from specdec.proposers.eagle import EagleProposer  # noqa: E402
from specdec.proposers.ngram import NgramProposer  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16, 17, 18]]
# Seconds left for the benchmark's last stage to run past its start (a batch size compiling its graphs).
BENCH_MARGIN_S = 120
EAGLE = ROOT / "tests" / "assets" / "tiny_random_eagle.safetensors"


def _decoder(target, draft, device: str, compile: str, backend: str, method: str, k: int,
             overlap: str = "auto", cuda_graphs: str = "trees", freezing: bool | None = None) -> SpeculativeDecoder:
    engine = Engine(target, draft, device=device, dtype="float32", passes=Accelerated(compile=compile, cuda_graphs=cuda_graphs))
    if engine.compile:
        for model in (engine.target, engine.draft):
            if model is not None:
                model.compiled = CompiledForward(model, backend=backend, cuda_graphs=cuda_graphs, freezing=freezing)
    proposer = {"plain": lambda: None, "draft": lambda: DraftModelProposer(engine), "ngram": lambda: NgramProposer(engine),
                "eagle": lambda: EagleProposer(engine, str(EAGLE), budget=10, topk=3, width=3, depth=4)}[method]()
    return SpeculativeDecoder(engine, proposer, num_speculative_tokens=k, overlap=overlap)


def graphs_ok(report: dict, cuda_graphs: str, device: str) -> bool:
    """On a GPU every compiled graph must run as a CUDA graph: one that inductor skipped runs kernel by
    kernel, launch-bound again (its reason is in the log), and explicit graphs are captured by
    specdec, at least one per caller that ran compiled. A caller that never ran (the engine's draft
    model under plain decoding or EAGLE) captures nothing and is not counted."""
    if not device.startswith("cuda"):
        return True
    ran = [r for r in report.values() if r["compiled_calls"]]
    if cuda_graphs == "trees":
        return all(r["cuda_graph_skips"] == 0 for r in ran)
    return bool(ran) and all(r["cuda_graph_captures"] > 0 for r in ran)


def check_compiled_equals_eager(target, draft, device: str, backend: str, deadline: float = float("inf")) -> dict:
    """Greedy tokens of compile=on against compile=off, per (method, k, batch, CUDA-graph mode);
    plain decoding compiled with its steps overlapped (`overlap=on`) against the eager serial loop.
    The cases run most telling first; none starts past `deadline` (a `time.perf_counter()` value):
    those are marked skipped, so that compiling on a slow device leaves the benchmark its time."""
    cases = [("plain", 1, "ragged", "trees"), ("draft", 4, "ragged", "trees"), ("eagle", 4, "ragged", "trees")]
    cases += [(m, k, "ragged", "explicit") for m, k in (("plain", 1), ("draft", 4), ("eagle", 4))]
    # inductor's weight freezing (the benchmark's frozen stage), and with explicit graphs (its combined stage)
    cases += [("draft", 4, "ragged", "frozen"), ("draft", 4, "ragged", "explicit frozen")]
    cases += [("plain", 1, "single", "trees"), ("draft", 4, "single", "trees"), ("draft", 1, "single", "trees"),
              ("draft", 1, "ragged", "trees")]
    out = {}
    for method, k, batch, graphs in cases:
        name = f"{method} k={k} {batch}" + {"trees": "", "explicit": " explicit graphs", "frozen": " frozen",
                                            "explicit frozen": " explicit graphs frozen"}[graphs]
        if time.perf_counter() > deadline:
            out[name] = {"skipped": "past the checks' time budget (--checks-budget-s)"}
            continue
        started = time.perf_counter()
        prompts = PROMPTS[:1] if batch == "single" else PROMPTS
        eager = _decoder(target, draft, device, "off", backend, method, k, "off").generate(prompts, max_new_tokens=24)
        frozen, graphs = "frozen" in graphs, "explicit" if "explicit" in graphs else "trees"
        compiled = _decoder(target, draft, device, "on", backend, method, k, "on", graphs,
                            True if frozen and backend == "inductor" else None)
        got = compiled.generate(prompts, max_new_tokens=24)
        again = compiled.generate(prompts, max_new_tokens=24)  # replays: known entries skip their guards
        report = compiled.engine.compile_report()
        same = got.output_ids == eager.output_ids == again.output_ids
        pipeline = got.reports.get("pipeline") or {}
        # explicit graphs capture a pipelined step whole: a capture the device refused is reported here
        whole = not (graphs == "explicit" and pipeline and device.startswith("cuda")) or (
            pipeline.get("graphed_steps", 0) > 0
            and "step_graph_error" not in pipeline)
        out[name] = {"equal": same and whole and graphs_ok(report, graphs, device),
                     "tokens_equal": same, "compile": report,
                     "pipeline": got.reports.get("pipeline"), "seconds": round(time.perf_counter() - started, 1)}
    return out


def check_syncs(target, draft, device: str) -> dict:
    """Per method: specdec's count and CUDA's detector over one generation each, and the steps
    (plain decoding serial and overlapped)."""
    out = {}
    for method, overlap in (("plain", "off"), ("plain", "on"), ("draft", "auto"), ("ngram", "auto"), ("eagle", "auto")):
        decoder = _decoder(target, draft, device, "off", "eager", method, 4, overlap)
        decoder.generate(PROMPTS, max_new_tokens=8)
        with count_host_syncs() as syncs:
            counted = decoder.generate(PROMPTS, max_new_tokens=16)
        torch.cuda.synchronize()
        with detect_cuda_syncs() as messages:
            detected = decoder.generate(PROMPTS, max_new_tokens=16)
        out[method if overlap == "auto" else f"{method} overlap={overlap}"] = {"steps": counted.stats.steps, "counted": syncs.total, "detected": len(messages),
                       "detected_steps": detected.stats.steps, "first_detected": messages[:3],
                       "ok": syncs.total == 1 + counted.stats.steps and len(messages) <= syncs.total}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--backend", default="inductor", help="compile=on's backend for check 1 (eager: quick plumbing)")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--bench-args", default="", help="extra arguments for scripts/bench_gpu.py, e.g. '--skip-hf'")
    ap.add_argument("--checks-budget-s", type=float, default=150,
                    help="seconds past which no compiled-versus-eager case starts (the rest are marked skipped)")
    ap.add_argument("--budget-s", type=float, default=420,
                    help="seconds for everything: the benchmark starts no stage past what the checks leave, less "
                         "a margin for the stage that runs over (`bench_gpu.py --budget-s`)")
    args = ap.parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    target = tiny_random_model(seed=0, eos_token_id=None)
    draft = tiny_random_model(seed=1, num_layers=1, eos_token_id=None)
    results, failed, began = {"device": args.device, "torch": torch.__version__}, False, time.perf_counter()
    deadline = began + args.checks_budget_s
    checks = [("compiled_equals_eager",
               lambda: check_compiled_equals_eager(target, draft, args.device, args.backend, deadline))]
    if args.device.startswith("cuda"):
        checks.append(("host_syncs", lambda: check_syncs(target, draft, args.device)))
    for name, run in checks:
        try:
            results[name] = run()
            ok = all(case.get("equal", case.get("ok")) for case in results[name].values() if "skipped" not in case)
        except Exception:  # report and go on: the next check and the benchmark still tell something
            results[name], ok = {"error": traceback.format_exc()}, False
        failed |= not ok
        skipped = [case for case, r in results[name].items() if "skipped" in r]
        print(f"[{time.perf_counter() - began:6.1f} s] {name}: {'ok' if ok else 'FAILED'}"
              + (f" (skipped for time: {', '.join(skipped)})" if skipped else ""), flush=True)
        if not ok:
            print(json.dumps(results[name], indent=1, default=str)[:4000], flush=True)
        (out_dir / "checks.json").write_text(json.dumps(results, indent=2, default=str))  # kept if cut short
    if not args.skip_bench:
        spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "scripts" / "bench_gpu.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        left = args.budget_s - (time.perf_counter() - began) - BENCH_MARGIN_S
        bench.main(["--device", args.device, "--out", str(out_dir / "bench_gpu.json"), "--budget-s", str(max(left, 0)),
                    *args.bench_args.split()])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
