#!/usr/bin/env bash
# The strategies study: every method against plain decoding on the same Spec-Bench prompts
# (2 per category, 12 prompts; the 2 multi-turn ones have 2 turns), 64 new tokens per turn,
# greedy and at temperature 0.7. Run from the repository root. Each line below is one sweep, kept in
# its own folder under $RUNS; the last line prints the study's table from all of them.
set -euo pipefail
DRAFT=${DRAFT:-outputs/drafts/smollm2-135m-distilled-2l}
RUNS=${RUNS:-experiments/strategies/runs}
[ -d "$DRAFT" ] || python scripts/train_draft.py          # the distilled draft (see README)
COMMON="~experiment data=spec_bench data.limit=2 generation.max_new_tokens=64 logger=none plots=false"
D="method=draft draft.path=$DRAFT draft.name=distilled-2l"
run() { local name=$1; shift; python -m specdec -m $COMMON hydra.sweep.dir="$RUNS/$name" "$@"; }

# greedy
run greedy_ngram method=ngram method.num_speculative_tokens=2,4,8
run greedy_ngram_cost_aware method=ngram method.num_speculative_tokens=8 method.schedule=cost_aware
run greedy_layer_skip method=layer_skip method.proposer.exit_layer=4,12
run greedy_draft $D method.num_speculative_tokens=1,2,4
run greedy_draft_schedules $D method.num_speculative_tokens=6 method.schedule=heuristic,confidence,cost_aware

# temperature 0.7
T=generation.temperature=0.7
run t07_ngram $T method=ngram
run t07_layer_skip $T method=layer_skip method.proposer.exit_layer=12
run t07_draft $T $D method.num_speculative_tokens=1,2,4
run t07_draft_schedules $T $D method.num_speculative_tokens=6 method.schedule=heuristic,confidence,cost_aware
run t07_draft_typical $T method=draft_typical draft.path=$DRAFT draft.name=distilled-2l method.num_speculative_tokens=2

# the study's table: one row per run, with the speedup (tau) of every category
python -m specdec.study.compare "$RUNS" \
    --columns run,method,args,temperature,lossless,speedup,tau,alpha,predicted,c,verify_cost,tok/s,base_tok/s,=baseline
