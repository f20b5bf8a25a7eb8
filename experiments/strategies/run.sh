#!/usr/bin/env bash
# The strategies study: every method against plain decoding on the same Spec-Bench prompts
# (2 per category, 12 prompts; the 2 multi-turn ones have 2 turns), 64 new tokens per turn,
# greedy and at temperature 0.7. Run from the repository root; results land in multirun/.
set -euo pipefail
DRAFT=${DRAFT:-outputs/drafts/smollm2-135m-distilled-2l}
[ -d "$DRAFT" ] || python scripts/train_draft.py          # the distilled draft (see README)
COMMON="data=spec_bench data.limit=2 generation.max_new_tokens=64 logger=none plots=false"
D="method=draft draft.path=$DRAFT draft.name=distilled-2l"
run() { python -m specdec -m $COMMON "$@"; }

# greedy
run method=ngram method.num_speculative_tokens=2,4,8
run method=ngram method.num_speculative_tokens=8 method.schedule=cost_aware
run method=layer_skip method.proposer.exit_layer=4,12
run $D method.num_speculative_tokens=1,2,4
run $D method.num_speculative_tokens=6 method.schedule=heuristic,confidence,cost_aware

# temperature 0.7
T=generation.temperature=0.7
run $T method=ngram
run $T method=layer_skip method.proposer.exit_layer=12
run $T $D method.num_speculative_tokens=1,2,4
run $T $D method.num_speculative_tokens=6 method.schedule=heuristic,confidence,cost_aware
run $T method=draft_typical draft.path=$DRAFT draft.name=distilled-2l method.num_speculative_tokens=2
