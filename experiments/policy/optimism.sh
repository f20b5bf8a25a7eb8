#!/usr/bin/env bash
# A/B of the policy's `optimism` (default 1 against 0, `<method>0`), every policy method in one run
# per batch size, 3 repetitions into runs/optimism2_rep{1,2,3}; then `python experiments/policy/ab.py ...`.
set -euo pipefail
cd "$(dirname "$0")/../.."
V="method=suffix method.schedule=cost_aware method.name=suffix_ca
  +method@compare.ngram_ca=ngram compare.ngram_ca.name=ngram_ca compare.ngram_ca.num_speculative_tokens=8 compare.ngram_ca.schedule=cost_aware
  +method@compare.draft_ca=draft compare.draft_ca.name=draft_ca compare.draft_ca.num_speculative_tokens=4 compare.draft_ca.schedule=cost_aware
  +method@compare.draft_ca0=draft compare.draft_ca0.name=draft_ca0 compare.draft_ca0.num_speculative_tokens=4 compare.draft_ca0.schedule=cost_aware +compare.draft_ca0.schedule_args.optimism=0
  +method@compare.eagle=eagle
  +method@compare.eagle_ca=eagle compare.eagle_ca.name=eagle_ca compare.eagle_ca.schedule=cost_aware
  +method@compare.eagle_ca0=eagle compare.eagle_ca0.name=eagle_ca0 compare.eagle_ca0.schedule=cost_aware +compare.eagle_ca0.schedule_args.optimism=0
  +method@compare.hybrid=hybrid
  +method@compare.hybrid0=hybrid compare.hybrid0.name=hybrid0 +compare.hybrid0.proposer.optimism=0"
for rep in 1 2 3; do
  MAX_NEW=64 RUNS=experiments/policy/runs/optimism2_rep$rep METHODS="$V" bash experiments/policy/run.sh
done
