"""The figures (specdec.study.figures): files written, lines only over numeric axes, one colour per method
in every figure, lossy methods marked, intervals drawn where the summary has them, counts on the
acceptance curve, and the context in the subtitle."""

from __future__ import annotations

import math

import pytest
from matplotlib.colors import to_hex
from matplotlib.lines import Line2D

from specdec.study import figures
from specdec.study.figures import (
    LOSSY_HATCH,
    LOSSY_NOTE,
    MIN_COUNT,
    acceptance_figure,
    category_figure,
    comparison_figure,
    interval,
    method_colour,
    run_figures,
    sweep_figure,
)


def _block(speedup: float, tau: float, rates: list[float], reached: list[int], ci: bool = True) -> dict:
    block = {"speedup": speedup, "mean_accepted_length": tau, "per_position_acceptance": rates,
             "reached_per_position": reached}
    if ci:
        block.update(speedup_ci_low=speedup - 0.1, speedup_ci_high=speedup + 0.2,
                     mean_accepted_length_ci_low=tau - 0.3, mean_accepted_length_ci_high=tau + 0.1)
    return block


def _method(speedup: float, lossless: bool, ci: bool = True) -> dict:
    cats = {"qa": _block(speedup, 2.0, [0.8, 0.5, 0.4], [40, 32, 3], ci),
            "math": _block(speedup + 0.1, 2.2, [0.9, 0.7], [50, 45], ci)}
    return {"overall": _block(speedup, 2.1, [0.85, 0.6, 1.0], [90, 77, 2], ci), "categories": cats,
            "lossless": lossless}


def _summary(ci: bool = True) -> dict:
    return {"method": "draft_forced", "categories": ["qa", "math"], "target": "tiny-target", "data": "builtin",
            "num_prompts": 7, "device": "cpu", "dtype": "float32", "lossless": False,
            "methods": {"draft_forced": _method(1.3, False, ci), "ngram": _method(1.1, True, ci),
                        "autoregressive": {"overall": {"speedup": 1.0, "mean_accepted_length": 1.0,
                                                       "per_position_acceptance": []},
                                           "categories": {}, "lossless": True}}}


def _bars(ax) -> dict[str, list]:
    """{legend label: its bar patches} of an axes."""
    return {c.get_label(): list(c.patches) for c in ax.containers if hasattr(c, "patches")}


def _legend_texts(fig) -> list[str]:
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    return [t.get_text() for legend in legends for t in legend.get_texts()]


def test_a_run_writes_png_and_pdf(tmp_path):
    paths = run_figures(_summary(), tmp_path)
    assert set(paths) == {"categories", "acceptance_per_position"}
    for name, png in paths.items():
        assert png.read_bytes()[:4] == b"\x89PNG"
        assert (tmp_path / f"{name}.pdf").read_bytes()[:4] == b"%PDF"


def test_each_method_keeps_its_colour_in_every_figure():
    summary = _summary()
    bars = _bars(category_figure(summary).axes[0])
    lines = [line for line in acceptance_figure(summary).axes[0].lines if len(line.get_xdata())]
    rows = [{"method": m, "lossless": m != "draft_forced", "k": k, "speedup": 1.0, "mean_accepted_length": 2.0}
            for m in ("ngram", "draft_forced") for k in ("2", "4")]
    sweep = sweep_figure(["method", "k"], rows, "ctx")
    for name in ("ngram", "draft_forced"):
        colour = method_colour(name)
        assert colour == method_colour(f"{name}[num_speculative_tokens=2]")  # a variant keeps its method's
        assert {to_hex(p.get_facecolor()) for label, ps in bars.items() if label.startswith(name) for p in ps} \
            == {colour}
        assert colour in {to_hex(line.get_color()) for line in lines}
        sweep_bars = [p for label, ps in _bars(sweep.axes[0]).items() if label.startswith(name) for p in ps]
        assert sweep_bars and {to_hex(p.get_facecolor()) for p in sweep_bars} == {colour}
    assert method_colour("ngram") != method_colour("draft_forced")
    assert method_colour("my_new_method") == method_colour("my_new_method")  # a hash, not an order


def test_lossy_methods_are_hatched_hollow_and_named_in_the_legend():
    summary = _summary()
    fig = category_figure(summary)
    bars = _bars(fig.axes[0])
    assert all(p.get_hatch() == LOSSY_HATCH for p in bars["draft_forced (lossy)"])
    assert all(not p.get_hatch() for p in bars["ngram"])
    assert "draft_forced (lossy)" in _legend_texts(fig) and LOSSY_NOTE in _legend_texts(fig)
    acceptance = acceptance_figure(summary)
    lossy = [h for h in acceptance.legends[0].legend_handles if isinstance(h, Line2D)]
    faces = {t.get_text(): h.get_markerfacecolor() for t, h in zip(acceptance.legends[0].get_texts(), lossy)}
    assert faces["draft_forced (lossy)"] == "white" and faces["ngram"] != "white"
    no_lossy = {**summary, "methods": {k: v for k, v in summary["methods"].items() if k != "draft_forced"}}
    assert LOSSY_NOTE not in _legend_texts(category_figure(no_lossy))


def test_error_bars_come_from_the_intervals_only_where_there_are_some():
    with_ci = category_figure(_summary(ci=True)).axes[0]
    without = category_figure(_summary(ci=False)).axes[0]
    assert all(c.errorbar is not None for c in with_ci.containers if hasattr(c, "patches"))
    assert all(c.errorbar is None for c in without.containers if hasattr(c, "patches"))
    assert "95% interval" in with_ci.get_ylabel() and "95% interval" not in without.get_ylabel()
    assert interval({"speedup_ci_low": 0.9, "speedup_ci_high": 1.2}, "speedup") == (0.9, 1.2)
    assert interval({"speedup_ci": [0.9, 1.2]}, "speedup") == (0.9, 1.2)
    assert interval({"speedup_ci_low": None, "speedup_ci_high": 1.2}, "speedup") is None
    assert interval({}, "speedup") is None


def test_sweep_lines_only_over_numeric_axes_with_ticks_at_the_values():
    rows = [{"method": m, "lossless": True, "method.num_speculative_tokens": k, "speedup": 1.0 + int(k) / 10,
             "mean_accepted_length": 1.5} for m in ("ngram", "suffix") for k in ("1", "2", "4")]
    fig = sweep_figure(["method", "method.num_speculative_tokens"], rows, "ctx")
    (cat_top, num_top), (cat_bottom, num_bottom) = fig.axes[0:2], fig.axes[2:4]
    for ax in (cat_top, cat_bottom):  # the method: grouped bars, no line joins two methods
        assert not [line for line in ax.lines if line.get_marker() not in (None, "None", "")]
        assert sum(len(ps) for ps in _bars(ax).values()) == len(rows)
        assert [t.get_text() for t in ax.get_xticklabels()] == ["ngram", "suffix"]
    for ax in (num_top, num_bottom):  # k: one line per method, ticks at 1, 2, 4 and nowhere else
        data = [line for line in ax.lines if len(line.get_xdata()) == 3]
        assert len(data) == 2 and not _bars(ax)
        assert list(ax.get_xticks()) == [1.0, 2.0, 4.0]
    assert figures.is_numeric(["1", "2.5", 4]) and not figures.is_numeric(["1", "heuristic"])
    for col in (0, 1):  # every column has a legend under it
        assert fig.axes[2 + col].get_legend() is not None
    assert fig.get_suptitle().endswith("ctx")


def test_acceptance_leaves_out_rarely_reached_positions_and_shows_n():
    fig = acceptance_figure(_summary())
    left = fig.axes[0]
    drawn = {to_hex(line.get_color()): list(line.get_xdata()) for line in left.lines if len(line.get_xdata())}
    assert drawn[method_colour("draft_forced")] == [1, 2]  # position 3 was reached twice (< MIN_COUNT)
    notes = [t.get_text() for t in left.texts]
    assert "n=90" in notes and "n=77" in notes and "n=2" not in notes
    assert f"fewer than {MIN_COUNT} times" in fig.get_suptitle()
    assert list(left.get_xticks()) == [1, 2, 3]


def test_acceptance_counts_come_from_results_rows_when_the_summary_has_none():
    summary = _summary()
    for block in [b for m in summary["methods"].values() for b in [m["overall"], *m["categories"].values()]]:
        block.pop("reached_per_position", None)
    rows = [{"method": "draft_forced", "category": "qa", "reached_per_position": [20, 11, 1]},
            {"method": "draft_forced", "category": "math", "reached_per_position": [30, 12]}]
    left = acceptance_figure(summary, rows).axes[0]
    assert {"n=50", "n=23"} <= {t.get_text() for t in left.texts}


def test_subtitles_name_target_prompts_n_device_and_dtype():
    title = category_figure(_summary()).get_suptitle()
    for part in ("tiny-target", "builtin", "n=7", "cpu", "float32"):
        assert part in title
    entries = [{"label": "run-a ngram", "method": "ngram", "lossless": True,
                "blocks": {"qa": _block(1.2, 2.0, [], []), "overall": _block(1.1, 2.0, [], [])}},
               {"label": "run-b ngram", "method": "ngram", "lossless": True,
                "blocks": {"overall": _block(1.3, 2.0, [], [])}}]
    fig = comparison_figure(entries, ["qa"], "the context")
    assert "the context" in fig.get_suptitle()
    labels = _legend_texts(fig)
    assert "[1] run-a ngram" in labels and "[2] run-b ngram" in labels  # one colour, numbered bars
    assert {t.get_text() for t in fig.axes[0].texts} >= {"1", "2"}


@pytest.mark.parametrize("value", [None, "x", float("nan"), math.inf])
def test_missing_numbers_draw_nothing_rather_than_fail(value):
    summary = _summary()
    summary["methods"]["ngram"]["overall"]["speedup"] = value
    category_figure(summary)  # no exception: a missing value leaves its bar out
