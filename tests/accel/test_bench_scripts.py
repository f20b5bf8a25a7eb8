"""Plumbing of the benchmark scripts on tiny shapes (no timing is asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.accel.compiled import CompiledForward
from specdec.accel.passes import Accelerated
from specdec.core.engine import Engine
from tests.conftest import load_script

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load(name: str):
    return load_script(name)


def test_device_benchmark_runs_on_cpu_with_tiny_shapes(tmp_path):
    """Every row of the device table is produced (compiled with dynamo's quick `eager` backend; the
    explicit CUDA-graph rows run compiled without graphs on a CPU; --autotune adds its stage)."""
    bench = _load("bench_gpu")
    out = bench.main(["--device", "cpu", "--tiny", "--dtype", "float32", "--context", "16", "--k-max", "2",
                      "--new-tokens", "4", "--repeats", "1", "--batch-sizes", "1,2", "--k", "2",
                      "--compile-backend", "eager", "--explicit-graphs", "on", "--autotune", "--out", str(tmp_path / "r.json")])
    assert set(out["target_forward_ms"]) == set(out["compiled_target_forward_ms"]) == {1, 2, 3}
    assert set(out["verify_ratio"]) == set(out["compiled_verify_ratio"]) == {1, 2, 3}
    assert all(r > 0 for r in [*out["verify_ratio"].values(), *out["compiled_verify_ratio"].values()])
    assert out["c"] > 0 and out["compiled_c"] > 0
    assert set(out["draft_step_ms"]) == set(out["c_in_step"]) == {"eager", "compiled"}
    assert all(c > 0 for c in out["c_in_step"].values())
    passes = out["compiled_pass_profiles"]  # T = 1 and the widest (k_max + 1), per pass; no device time on a CPU
    assert set(passes) == {1, 3} and all(p["device_busy_ms"] == 0 and p["top"] for p in passes.values())
    for p in passes.values():  # ranked by their own time, per pass
        ms = [op["self_ms"] for op in p["top"]]
        assert ms[0] > 0 and ms == sorted(ms, reverse=True) and all(op["calls"] > 0 for op in p["top"])
    assert set(out["plain_tokens_per_s"]) == {1, 2}
    assert set(out["plain_tokens_per_s"][1]) == {"specdec eager", "specdec compiled", "specdec compiled serial",
                                                  "transformers dynamic", "transformers static"}
    assert set(out["plain_tokens_per_s"][2]) == {"specdec eager", "specdec compiled"}
    assert all(r > 0 for rates in out["plain_tokens_per_s"].values() for r in rates.values())
    forced = out["forced"]
    assert forced["lossless"] is False and set(forced["speedup_over_compiled_plain"]) == {
        "forced eager", "forced compiled", "forced compiled serial"}
    assert out["compile_report"]["target"]["graphs"] >= 1
    assert out["compile_report_explicit"]["target"]["compiled_calls"] >= 1
    explicit = out["explicit_graphs"]
    assert set(explicit["tokens_per_s"]) == {f"{kind} {mode}" for kind in ("plain", "forced")
                                             for mode in ("trees", "explicit")}
    assert set(explicit["explicit_over_trees"]) == {"plain", "forced"} and explicit["c"] > 0 < explicit["c_in_step"]
    syncs = out["host_syncs_per_step"]  # one read a step, and the prefill's: 4 tokens in 3 steps
    assert set(syncs) == {f"{kind} {n}" for kind in ("plain", "forced")
                          for n in ("eager", "compiled", "compiled explicit")}
    assert syncs["plain eager"] == {"counted": 4 / 3} and 1 < syncs["forced eager"]["counted"] <= 2
    tuned = out["autotune"]  # compile=autotune beside compile=on, the last stage
    assert set(tuned["tokens_per_s"]) == {f"{kind} {mode}" for kind in ("plain", "forced") for mode in ("on", "autotune")}
    assert set(tuned["autotune_over_on"]) == {"plain", "forced"} and tuned["target_forward_ms"] > 0
    assert tuned["compile_report"]["target"]["compiled_calls"] >= 1
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["forced"]["k"] == 2 and saved["shape"] == "tiny"
    assert saved["skipped"] == [] and len(saved["stages_s"]) == 11 and list(saved["stages_s"])[-1] == "autotune"
    combined = saved["combined"]  # explicit graphs with frozen weights beside compile=on's defaults
    assert set(combined["tokens_per_s"]) == {f"{kind} {mode}" for kind in ("plain", "forced")
                                             for mode in ("on", "explicit_frozen")}
    assert set(combined["explicit_frozen_over_on"]) == {"plain", "forced"} and combined["c_in_step"] > 0
    assert set(combined["target_forward_ms"]) == {"1", "3"}
    assert combined["forced_pipeline"] is None  # overlap=auto pipelines the steps on a GPU only
    assert combined["compile_report"]["target"]["compiled_calls"] >= 1
    assert combined["device_memory_added_gb"] is None and saved["frozen"]["device_memory_added_gb"] is None  # CPU
    host = saved["host"]  # the host's time per step under cProfile, its waits for the device apart
    assert set(host) == {"plain compiled", "forced compiled", "forced compiled serial", "forced compiled explicit"}
    for h in host.values():
        assert h["steps"] >= 1 and 0 <= h["wait_ms_per_step"] < h["wall_ms_per_step"]
        assert h["host_ms_per_step"] == pytest.approx(h["wall_ms_per_step"] - h["wait_ms_per_step"])
        ms = [f["own_ms_per_step"] for f in h["top"]]
        assert ms and ms == sorted(ms, reverse=True) and not any("synchronize" in f["name"] for f in h["top"])
    frozen = saved["frozen"]  # compile=on with frozen weights beside compile=on as it is
    assert set(frozen["tokens_per_s"]) == {f"{kind} {mode}" for kind in ("plain", "forced") for mode in ("on", "frozen")}
    assert set(frozen["frozen_over_on"]) == {"plain", "forced"}
    assert set(frozen["target_forward_ms"]) == {"on", "frozen"}
    assert all(set(ms) == {"1", "3"} for ms in frozen["target_forward_ms"].values())  # T = 1 and k + 1 (JSON keys)
    assert frozen["compile_report"]["target"]["compiled_calls"] >= 1
    profiles = saved["profiles"]  # on a CPU: no device time, operators ranked by host time
    assert set(profiles) == {"plain eager", "plain compiled", "forced compiled", "forced compiled serial",
                             "plain compiled explicit", "forced compiled explicit"}
    for p in profiles.values():
        assert p["tokens"] == 3 and p["wall_ms_per_token"] > 0 and p["device_busy_share"] == 0  # the prefill's left out
        ms = [op["self_ms"] for op in p["top"]]
        assert ms and ms[0] > 0 and ms == sorted(ms, reverse=True)


def test_device_benchmark_keeps_to_its_time_budget(tmp_path, capsys):
    """Past --budget-s no stage starts: the skipped ones are named, and the JSON is written anyway
    (it is written after every stage, so that a run cut short keeps what it measured)."""
    bench = _load("bench_gpu")
    out = bench.main(["--device", "cpu", "--tiny", "--dtype", "float32", "--context", "16", "--k-max", "2",
                      "--new-tokens", "4", "--repeats", "1", "--batch-sizes", "1,2", "--skip-hf",
                      "--compile-backend", "eager", "--budget-s", "0", "--out", str(tmp_path / "r.json")])
    assert out["skipped"] == ["plain decoding, batch 1", "scoring costs", "forced acceptance",
                              "plain decoding, batch 2", "host synchronisations", "profiles", "host time",
                              "frozen weights"]
    assert out["plain_tokens_per_s"] == {} and "target_forward_ms" not in out
    assert json.loads((tmp_path / "r.json").read_text())["skipped"] == out["skipped"]
    assert "skipped for time (--budget-s 0)" in capsys.readouterr().out


def test_device_benchmark_runs_only_the_stages_asked_for(tmp_path, capsys):
    """--stages lets a rerun on a GPU spend its time on what an earlier run did not measure, first what
    it needs most (in the order given, each once); an unknown stage is refused before any model is built."""
    bench = _load("bench_gpu")
    out = bench.main(["--device", "cpu", "--tiny", "--dtype", "float32", "--context", "16", "--k-max", "2",
                      "--new-tokens", "4", "--repeats", "1", "--batch-sizes", "1,2", "--k", "2", "--skip-hf",
                      "--compile-backend", "eager", "--explicit-graphs", "off", "--stages", "batches,forced,batches"])
    assert list(out["stages_s"]) == ["plain decoding, batch 2", "forced acceptance"] and out["skipped"] == []
    assert set(out["plain_tokens_per_s"]) == {2} and out["forced"]["lossless"] is False
    assert "target_forward_ms" not in out and "profiles" not in out
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--tiny", "--stages", "forced,bogus"])
    assert "unknown bogus" in capsys.readouterr().err


def test_a_draft_step_is_timed_as_decoding_runs_it():
    """Under compile=on the draft's step of k drafts is the one compiled call a greedy draft with a
    fixed k makes (`catch_up_chain`), eagerly the passes one by one; either way the draft's cache is
    left where the step left it (the context, the token caught up on, k - 1 drafts)."""
    from specdec.models import tiny_random_model

    bench = _load("bench_gpu")
    target = tiny_random_model(seed=0)
    context = torch.arange(1, 17)[None]
    tokens = torch.cat([context, context[:, :1]], dim=1)
    for compile in ("off", "on"):
        engine = Engine(target, target, dtype="float32", passes=Accelerated(compile=compile))
        if engine.compile:
            engine.draft.compiled = CompiledForward(engine.draft, backend="eager")
        engine.draft.reset(1, 64)
        engine.draft.forward(context)
        assert bench.time_draft_step(engine.draft, tokens, 16, 4, repeats=1) > 0
        assert engine.draft.cache.lengths == [16 + 1 + 3]
        if engine.compile:
            assert any(kind.startswith("catch-up and chain of 3") for kind, *_ in engine.draft.compiled.shapes)


def test_busy_time_is_the_union_of_kernel_intervals():
    bench = _load("bench_gpu")
    assert bench._busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert bench._busy_us([]) == 0


@pytest.mark.parametrize("script", ["bench_gpu", "device_check"])
def test_device_scripts_import_no_experiment_stack(script):
    """The GPU box may lack pytest, hydra, wandb, gguf and datasets: the scripts' imports must not need them."""
    code = ("import sys, importlib.util; spec = importlib.util.spec_from_file_location('b', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(sorted(x for x in ('hydra', 'wandb', 'gguf', 'datasets', 'omegaconf', 'pytest') if x in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(SCRIPTS / f"{script}.py")], capture_output=True,
                         text=True, check=True, cwd=SCRIPTS.parent)
    assert out.stdout.strip() == "[]"


def test_device_check_runs_its_checks_on_cpu(tmp_path):
    """The GPU machine's one command, its plumbing on the CPU (dynamo's quick backend; the host-sync
    check needs CUDA): every compiled case gives the eager tokens, and the results are written."""
    check = _load("device_check")
    assert check.main(["--device", "cpu", "--skip-bench", "--backend", "eager", "--out-dir", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "checks.json").read_text())
    cases = saved["compiled_equals_eager"]
    assert len(cases) == 12 and all(case["equal"] for case in cases.values()) and "host_syncs" not in saved
    assert all(cases[f"draft k=4 ragged {mode}"]["pipeline"]["pipelined_steps"] > 0
               for mode in ("frozen", "explicit graphs frozen"))
    assert cases["eagle k=4 ragged"]["compile"]["eagle drafter"]["compiled_calls"] > 0
    assert cases["draft k=4 ragged"]["pipeline"]["pipelined_steps"] > 0  # compiled with overlap=on: pipelined
    assert cases["draft k=1 ragged"]["pipeline"] is None  # k = 1 has no chain to pipeline


def test_device_check_leaves_out_cases_past_its_checks_budget(tmp_path, capsys):
    """No case starts past --checks-budget-s: with none left, every case is named as skipped (not
    failed), the command passes, and the line says which were left out."""
    check = _load("device_check")
    assert check.main(["--device", "cpu", "--skip-bench", "--backend", "eager", "--checks-budget-s", "0",
                       "--out-dir", str(tmp_path)]) == 0
    cases = json.loads((tmp_path / "checks.json").read_text())["compiled_equals_eager"]
    assert len(cases) == 12 and all("skipped" in case for case in cases.values())
    assert "compiled_equals_eager: ok (skipped for time: plain k=1 ragged, draft k=4 ragged" in capsys.readouterr().out


def test_device_check_counts_only_the_callers_that_ran():
    """On a GPU, explicit graphs need a capture per caller that ran compiled; the engine's draft under
    plain decoding never runs and must not fail the check. inductor's trees: no caller may skip."""
    check = _load("device_check")
    ran = {"graphs": 2, "compiled_calls": 30, "cuda_graph_captures": 2, "cuda_graph_skips": 0}
    idle = {"graphs": 0, "compiled_calls": 0, "cuda_graph_captures": 0, "cuda_graph_skips": 0}
    uncaptured = ran | {"cuda_graph_captures": 0}
    assert check.graphs_ok({"target": ran, "draft": idle}, "explicit", "cuda")
    assert not check.graphs_ok({"target": ran, "draft": uncaptured}, "explicit", "cuda")
    assert not check.graphs_ok({"target": idle}, "explicit", "cuda")  # nothing ran compiled at all
    assert check.graphs_ok({"target": ran | {"cuda_graph_captures": 0}, "draft": idle}, "trees", "cuda")
    assert not check.graphs_ok({"target": ran | {"cuda_graph_skips": 1}}, "trees", "cuda")
    assert check.graphs_ok({"target": idle}, "explicit", "cpu")  # a CPU captures nothing


def test_predicted_speedup_is_the_cost_model_of_specdec_metrics(tmp_path):
    """The script's predictions apply specdec.core.metrics (no formula of its own), in target steps."""
    bench = _load("bench_gpu")
    out = bench.main(["--device", "cpu", "--tiny", "--dtype", "float32", "--context", "8", "--k-max", "2",
                      "--new-tokens", "2", "--repeats", "1", "--batch-sizes", "1", "--k", "2", "--skip-hf",
                      "--compile-backend", "eager"])
    e = 1 + 0.8 + 0.8 * 0.8  # expected tokens per step, alpha = 0.8, k = 2
    step = 2 * out["compiled_c"] + out["compiled_verify_ratio"][3]  # 2 draft tokens, a 3-token scoring pass
    assert out["predicted_speedup"]["alpha=0.8,k=2"] == pytest.approx(e / step)
    assert set(out["predicted_speedup"]) == {"alpha=0.6,k=2", "alpha=0.8,k=2", "alpha=0.9,k=2"}


def test_the_decisions_benchmark_decides_alike_on_every_run():
    """experiments/policy/bench_decisions.py: its digest of the decisions is what tells a pure
    speed-up of the policy from a change of behaviour, so it must not depend on the clock."""
    bench = load_script("bench_decisions", "experiments/policy")
    (ms, first), (_, second) = bench.run(4, 60), bench.run(4, 60)
    assert ms > 0 and first == second and first != bench.run(16, 60)[1]


def test_the_modeled_speedup_prices_each_step_at_its_width():
    """experiments/policy/modeled.py: plain steps of a batch over the sum of rho(B, T) of the
    method's steps; a batch of the method is the rows it wrote together."""
    modeled = load_script("modeled", "experiments/policy")
    rho = {2: {1: 1.0, 2: 1.5, 3: 2.0}}

    def rows(method, steps, cpu):
        return [{"method": method, "prompt_id": str(i), "step_draft_lengths": steps, "cpu_s": cpu} for i in range(2)]
    # two roles: plain decoding ends the first batch and starts the second
    runs = rows("m", [1, 2, 0], 1.0) + rows(modeled.BASE, [0] * 5, 1.1) + rows(modeled.BASE, [0] * 3, 0.9) + \
        rows("m", [0, 0], 0.8)
    assert modeled.modeled(runs, "m", rho) == [5 / (1.5 + 2.0 + 1.0), 3 / 2.0]


def test_host_waits_are_known_by_their_own_names():
    """The host stage sets apart the calls that wait for the device by their own names: a read or a
    synchronisation, not any function whose name merely contains one (a guard's `_empty_strided_cpu`)."""
    bench = _load("bench_gpu")
    assert bench._waits("~:0(<method 'tolist' of 'torch._C.TensorBase' objects>)")
    assert bench._waits("~:0(<method 'synchronize' of 'torch._C._CudaEventBase' objects>)")
    assert bench._waits("__init__.py:1050(synchronize)")
    assert not bench._waits("~:0(<built-in method torch._C._dynamo.guards._empty_strided_cpu>)")
    assert not bench._waits("compiled.py:140(cpu_has_bfloat16_units)")
