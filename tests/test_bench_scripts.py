"""Plumbing of the benchmark scripts on tiny shapes (no timing is asserted)."""

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_benchmark_runs_on_cpu_with_tiny_shapes(tmp_path):
    bench = _load("bench_gpu")
    out = bench.main(["--device", "cpu", "--shape", "tiny", "--dtype", "float32", "--context", "32",
                      "--k-max", "3", "--new-tokens", "8", "--repeats", "1", "--out", str(tmp_path / "r.json")])
    assert set(out["target_forward_ms"]) == {1, 2, 3, 4} and out["verify_ratio"][1] == 1.0
    assert out["decode_tokens_per_s"] > 0 and out["c"] > 0
    assert (tmp_path / "r.json").exists()


def test_predicted_speedup_formula():
    bench = _load("bench_gpu")
    # free drafts and free verification: the speedup is the expected tokens per step
    assert bench.predicted_speedup(0.5, 2, 0.0, 1.0) == 1 + 0.5 + 0.25
    assert bench.predicted_speedup(1.0, 4, 0.0, 1.0) == 5
    assert bench.predicted_speedup(0.0, 4, 0.1, 1.2) < 1  # nothing accepted: pure overhead
