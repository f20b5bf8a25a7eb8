"""The experiments/gpu studies that run anywhere: their plumbing on tiny models, and the one bound
that a study's measurement sets for the code (the operators around a compiled pass)."""


import pytest

from specdec.accel import compiled
from specdec.accel.compiled import CPP_GEMM_ROWS
from tests.conftest import load_script


def _experiment(name: str):
    return load_script(name, "experiments/gpu")


def test_overlap_study_runs_and_compares_tokens(tmp_path):
    out = _experiment("overlap").main(["--model", "tiny_random", "--dtype", "float32", "--repeats", "1",
                                       "--max-new-tokens", "6", "--out", str(tmp_path / "o.json")])
    assert out["tokens_equal"] and out["serial_over_overlapped"] > 0 and out["prompts"] >= 1


def test_few_operators_run_around_a_compiled_pass():
    """experiments/gpu/launches.py's count: on a GPU each is a kernel launch (a draft pays them k times
    a step). The bounds hold what the study measured (14.1, 12.1, 29.8; pipelined 39.7) with a little room."""
    counts = _experiment("launches").main([])  # 40 new tokens: the prefill spread thin
    assert counts["plain overlap=on"] < counts["plain overlap=off"] <= 16
    assert counts["draft k=4 overlap=off"] <= 38 and counts["draft k=4 overlap=on"] <= 44


def test_host_time_study_runs_every_method(tmp_path):
    out = _experiment("host_time").main(["--modes", "eager", "--repeats", "1", "--new-tokens", "8",
                                         "--out", str(tmp_path / "h.json")])
    assert set(out["ms_per_step"]) == {f"{m} eager" for m in ("plain", "draft", "forced", "ngram")}
    assert all(v > 0 for v in out["ms_per_step"].values())


def test_widths_study_reports_each_width_in_both_modes(tmp_path):
    out = _experiment("widths").main(["--model", "tiny_random", "--dtype", "float32", "--widths", "1,3",
                                      "--contexts", "20", "--repeats", "1", "--calls", "1",
                                      "--out", str(tmp_path / "w.json")])
    rows = out["contexts"][20]
    assert [r["tokens"] for r in rows] == [1, 3] and [r["width_on"] for r in rows] == [1, 4]  # float32: 1 wide
    assert all(r["ms_off"] > 0 and r["ms_on"] > 0 for r in rows) and rows[0]["on_over_t1"] == 1.0
    assert (tmp_path / "w.json").exists() and out["cpp_gemm_rows"] == CPP_GEMM_ROWS
    tuned = _experiment("widths").main(["--model", "tiny_random", "--dtype", "float32", "--widths", "1",
                                        "--contexts", "20", "--repeats", "1", "--calls", "1", "--cpp-gemm-rows", "0"])
    assert tuned["cpp_gemm_rows"] == 0 and compiled.CPP_GEMM_ROWS == CPP_GEMM_ROWS  # the study's graphs only
    for bad in ("on,off", "off", "off,fast"):  # off first: every compiled mode is reported against it
        with pytest.raises(SystemExit):
            _experiment("widths").main(["--model", "tiny_random", "--modes", bad])


def test_output_heads_study_reports_every_shape_in_both_modes(tmp_path):
    out = _experiment("output_heads").main(["--vocab", "64,32", "--hidden", "16", "--rows", "1,3",
                                            "--dtype", "float32", "--repeats", "2", "--backend", "eager",
                                            "--out", str(tmp_path / "h.json")])
    assert set(out["ms"]) == {f"{v}x16, {r} rows" for v in (64, 32) for r in (1, 3)}
    assert all(cell["eager"] >= 0 and cell["compiled"] >= 0 for cell in out["ms"].values())
    assert (tmp_path / "h.json").exists()
    tuned = _experiment("output_heads").main(["--vocab", "32", "--hidden", "16", "--rows", "2", "--dtype", "float32",
                                              "--repeats", "1", "--backend", "eager", "--variants", "autotune,autotune_cpp"])
    assert set(tuned["ms"]["32x16, 2 rows"]) == {"eager", "autotune", "autotune_cpp", "autotune_over_eager",
                                                  "autotune_cpp_over_eager"}
    with pytest.raises(SystemExit):
        _experiment("output_heads").main(["--variants", "compiled,fast"])
