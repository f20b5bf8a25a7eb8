"""The forced-acceptance sweep as one table: the acceptance curve set and measured, and the speedup
measured against the cost model's predictions, recomputed from each job's results.jsonl with
`specdec.study.results.MethodSummary.measure` (so the table follows the current definitions):

- predicted: decode only, E * t_base / t_step, E from the measured per-position acceptance;
- with prefill: the same steps plus the method's measured prefill, against the baseline's tokens/s.

    python experiments/measurement/forced_table.py experiments/measurement/runs/forced_draft
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specdec.core.metrics import expected_tokens_per_step, ratio
from specdec.study.report import BASELINE
from specdec.study.results import MethodSummary, PromptResult


def main(sweep: Path) -> None:
    print("| k | a set | a_i measured (min-max) | E from the set a | tau | speedup | predicted | measured / "
          "predicted | predicted with prefill | measured / that |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = []
    for job in sorted(sweep.glob("*/results.jsonl")):
        summary = json.loads((job.parent / "summary.json").read_text())
        name = summary["method"]
        cfg = summary["method_configs"][name]
        k, a = cfg["num_speculative_tokens"], cfg["verifier_args"]["acceptance"]
        rows = [PromptResult.from_dict(json.loads(line)) for line in job.read_text().splitlines()]
        m = MethodSummary.measure([r for r in rows if r.method == name], [r for r in rows if r.method == BASELINE],
                                  greedy=summary["temperature"] == 0)
        e_set = expected_tokens_per_step([a] * k if isinstance(a, (int, float)) else list(a)[:k])
        measured = m.per_position_acceptance
        lines.append((k, a, f"{min(measured):.2f}-{max(measured):.2f}", e_set, m.mean_accepted_length,
                      m.speedup, m.predicted_speedup, m.measured_over_predicted, m.predicted_speedup_with_prefill))
    for k, a, spread, e_set, tau, speedup, predicted, over, with_prefill in sorted(lines):
        print(f"| {k} | {a} | {spread} | {e_set:.2f} | {tau:.2f} | {speedup:.2f}x | {predicted:.2f}x | "
              f"{over:.2f} | {with_prefill:.2f}x | {ratio(speedup, with_prefill):.2f} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
