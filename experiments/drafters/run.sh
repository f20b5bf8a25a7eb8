#!/usr/bin/env bash
# The drafters study: the EAGLE-3 drafter that scripts/train_heads.py kind=eagle3 trains for the embedded
# SmolLM2-135M, beside the shipped EAGLE-style drafter (method=eagle) and n-gram lookup, interleaved with
# plain decoding prompt by prompt. Run from the repository root; each run keeps its folder under
# $RUNS and appends its rows to experiments/drafters/results.csv.
#   experiments/drafters/run.sh                                    # LIMIT=2: 12 Spec-Bench prompts, ~15 min
#   DRAFTER2=experiments/drafters/runs/eagle3-v2048 NAME=vocab experiments/drafters/run.sh   # + a second drafter
set -euo pipefail -f   # -f: no globbing of the bracketed overrides
RUNS=${RUNS:-experiments/drafters/runs}
LIMIT=${LIMIT:-2}                               # prompts per Spec-Bench category
NAME=${NAME:-limit$LIMIT}
DRAFTER=${DRAFTER:-$RUNS/eagle3-v4096}          # scripts/train_heads.py kind=eagle3 out=<this>
ASKED=""                                        # the variables that chose the drafters, for the recorded command
[[ "$DRAFTER" != "$RUNS/eagle3-v4096" ]] && ASKED="DRAFTER=$DRAFTER "
ASKED="$ASKED${DRAFTER2:+DRAFTER2=$DRAFTER2 }"
COMMON="experiment=spec_bench_greedy generation.max_new_tokens=128 logger=none plots=false threads=1 progress=false"
# variant NAME METHOD KEY=VALUE...: one more decoder in the same interleaved run, under its own name
variant() { local name=$1 method=$2; shift 2; echo "+method@compare.$name=$method compare.$name.name=$name ${*/#/compare.$name.}"; }
#   ONE=1 DRAFTER2=experiments/drafters/runs/eagle3-v2048 experiments/drafters/run.sh  # all in one run
# ONE=1: eagle, eagle3 at eagle's shape (and DRAFTER2's), n-gram, interleaved in one run (the target keeps
# the union of the drafters' taps). Otherwise two runs, as the first measurements were made when one
# target could feed only one kind of hidden states: each interleaved with plain decoding, n-gram lookup
# in both as the common reference.
if [[ -n "${ONE:-}" ]]; then
  METHODS="method=eagle +method@compare.ngram=ngram \
    $(variant eagle3_d2 eagle3 heads_path=$DRAFTER proposer.budget=4 proposer.depth=2 num_speculative_tokens=2)"
  if [[ -n "${DRAFTER2:-}" ]]; then
    METHODS="$METHODS $(variant eagle3_b eagle3 heads_path=$DRAFTER2 proposer.budget=4 proposer.depth=2 num_speculative_tokens=2)"
  fi
  TAG="ONE=1 NAME=$NAME LIMIT=$LIMIT ${ASKED}experiments/drafters/run.sh"
  python -m specdec $COMMON data.limit=$LIMIT hydra.run.dir=$RUNS/$NAME-one $METHODS
  python experiments/drafters/collect.py "$RUNS/$NAME-one" "$NAME-one" "$TAG" --vocab eagle=8192
  exit 0
fi
# Run 1: eagle3 at its method file's shape (budget 8, depth 4) and at eagle's (budget 4, depth 2)
METHODS="method=eagle3 method.heads_path=$DRAFTER \
  $(variant eagle3_d2 eagle3 heads_path=$DRAFTER proposer.budget=4 proposer.depth=2 num_speculative_tokens=2) \
  +method@compare.ngram=ngram"
if [[ -n "${DRAFTER2:-}" ]]; then
  METHODS="$METHODS $(variant eagle3_b eagle3 heads_path=$DRAFTER2 proposer.budget=4 proposer.depth=2 num_speculative_tokens=2)"
fi
TAG="NAME=$NAME LIMIT=$LIMIT ${ASKED}experiments/drafters/run.sh"
python -m specdec $COMMON data.limit=$LIMIT hydra.run.dir=$RUNS/$NAME-eagle3 $METHODS
python experiments/drafters/collect.py "$RUNS/$NAME-eagle3" "$NAME-eagle3" "$TAG"
# Run 2: the shipped EAGLE-style drafter (its default shape: budget 4, depth 2)
python -m specdec $COMMON data.limit=$LIMIT hydra.run.dir=$RUNS/$NAME-eagle method=eagle +method@compare.ngram=ngram
python experiments/drafters/collect.py "$RUNS/$NAME-eagle" "$NAME-eagle" "$TAG" --vocab eagle=8192   # the shipped checkpoint's vocab_ids
