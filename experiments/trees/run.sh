#!/usr/bin/env bash
# The trees study: Medusa heads (static tree) and the EAGLE-style drafter (dynamic tree), against plain
# decoding and n-gram lookup on the same Spec-Bench prompts, interleaved in one run per line below.
# Run from the repository root; every run keeps its folder under $RUNS; the last line prints the table.
#   experiments/trees/run.sh                 # everything (about 1 h on a busy 2-core CPU)
#   LIMIT=10 experiments/trees/run.sh        # Spec-Bench's 60 prompts for the main runs
#   ONLY="greedy t07" experiments/trees/run.sh
set -euo pipefail -f   # -f: no globbing of the bracketed overrides
RUNS=${RUNS:-experiments/trees/runs}
LIMIT=${LIMIT:-1}           # prompts per category in the main runs (10: Spec-Bench's 60 prompts; 1 fits a busy 2-core CPU)
SWEEP_LIMIT=${SWEEP_LIMIT:-1}  # prompts per category in the float32 check and the tree shapes
ONLY=${ONLY:-"greedy t07 greedy_float32 shapes depth medusa_trees medusa_trees_float32"}
COMMON="experiment=spec_bench_greedy generation.max_new_tokens=128 logger=none plots=false threads=1"
run() {
    local name=$1 limit=$2; shift 2
    [[ " $ONLY " == *" $name "* ]] || return 0
    python -m specdec -m $COMMON data.limit="$limit" hydra.sweep.dir="$RUNS/$name" "$@"
}
TREES="method=eagle +method@compare.medusa=medusa +method@compare.ngram=ngram"   # one interleaved run
# EAGLE_V1=<an older eagle checkpoint>: measured beside the shipped one in the main runs
OLD=${EAGLE_V1:+"+method@compare.eagle_v1=eagle compare.eagle_v1.name=eagle_v1 compare.eagle_v1.heads_path=$EAGLE_V1"}
# variant NAME METHOD KEY=VALUE...: one more decoder in the same interleaved run, under its own name
variant() { local name=$1 method=$2; shift 2; echo "+method@compare.$name=$method compare.$name.name=$name ${*/#/compare.$name.}"; }

# the main comparison: eagle (dynamic tree), medusa (static tree) and ngram, interleaved with plain decoding
run greedy "$LIMIT" $TREES $OLD
# sampling at temperature 0.7 (recursive rejection sampling over the tree)
run t07 "$LIMIT" $TREES generation.temperature=0.7
# token identity in float32 (bfloat16 trees are scored at their own width: near-ties may flip)
run greedy_float32 "$SWEEP_LIMIT" $TREES dtype=float32
# tree shapes in one interleaved run, all 5 levels deep: EAGLE's dynamic tree at budgets 4, 8, 12, 20 and
# as a chain (topk 1, width 1: one path of depth 5); Medusa's default static tree and its chain
D5="proposer.depth=5 num_speculative_tokens=5"
EAGLE_B12_D5="method=eagle method.proposer.budget=12 method.proposer.depth=5 method.num_speculative_tokens=5"
run shapes "$SWEEP_LIMIT" $EAGLE_B12_D5 \
    $(variant eagle_chain eagle proposer.topk=1 proposer.width=1 proposer.budget=5 $D5) \
    $(variant eagle_b4 eagle proposer.budget=4 $D5) $(variant eagle_b8 eagle proposer.budget=8 $D5) \
    $(variant eagle_b20 eagle proposer.budget=20 $D5) \
    +method@compare.medusa=medusa $(variant medusa_chain medusa 'tree=[[0],[0,0],[0,0,0],[0,0,0,0]]')
# tree depth: levels 4 and 5 are rarely accepted but each costs a drafter pass and an output head
# (depth 2, budget 4 measured fastest: the default of conf/method/eagle.yaml since)
run depth "$SWEEP_LIMIT" $EAGLE_B12_D5 $(variant eagle_d3 eagle proposer.budget=12 proposer.depth=3 num_speculative_tokens=3) \
    $(variant eagle_d3_b6 eagle proposer.depth=3 proposer.budget=6 num_speculative_tokens=3) \
    $(variant eagle_d2_b4 eagle proposer.depth=2 proposer.budget=4 num_speculative_tokens=2)

# Medusa's tree shapes in one interleaved run per dtype: the 9-node default of the earlier sections, the
# 3-node tree (the default since this run) and 5 nodes; bfloat16 and float32 (dtype=auto on a CPU
# without bfloat16 units)
MEDUSA_TREES="method=medusa method.tree=[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0],[0,0,1],[0,0,0,0]] \
    $(variant medusa_3 medusa 'tree=[[0],[1],[0,0]]') $(variant medusa_5 medusa 'tree=[[0],[1],[2],[0,0],[0,1]]')"
run medusa_trees "$SWEEP_LIMIT" $MEDUSA_TREES dtype=bfloat16
run medusa_trees_float32 "$SWEEP_LIMIT" $MEDUSA_TREES dtype=float32

python -m specdec.study.compare "$RUNS" \
    --columns run,method,args,temperature,dtype,lossless,speedup,tau,alpha,predicted,measured/predicted,c,verify_cost,tok/s,base_tok/s,=baseline
