#!/usr/bin/env bash
# The policy study: n-gram, suffix decoding, the target drafting for itself (draft=self) and the
# trained EAGLE-style drafter, each with a fixed k and with the cost-aware policy, and the hybrid of all four, against plain
# decoding at batch sizes 1, 4 and 16, interleaved batch by batch in one run per batch size.
# Embedded SmolLM2-135M-Instruct, default dtype, Spec-Bench prompts, greedy, 32 new tokens per turn (MAX_NEW=64: 64); plain
# decoding one token wide (engine.exact_greedy=false: the fastest plain decoding, not the padded exact one).
# Run from the repository root; results in $RUNS/b{1,4,16}; then `python experiments/policy/collect.py`.
set -euo pipefail
# ~experiment: no preset (the default one adds methods of its own)
RUNS=${RUNS:-experiments/policy/runs}
MAX_NEW=${MAX_NEW:-32}   # new tokens per turn
EXTRA=${EXTRA:-}         # more overrides for every run, e.g. EXTRA=generation.temperature=0.7
COMMON="~experiment data=spec_bench generation.max_new_tokens=$MAX_NEW engine.exact_greedy=false logger=none plots=false progress=false draft=self $EXTRA"
METHODS=${METHODS:-"method=ngram method.num_speculative_tokens=8
  +method@compare.ngram_ca=ngram compare.ngram_ca.name=ngram_ca compare.ngram_ca.num_speculative_tokens=8 compare.ngram_ca.schedule=cost_aware
  +method@compare.suffix=suffix
  +method@compare.suffix_ca=suffix compare.suffix_ca.name=suffix_ca compare.suffix_ca.schedule=cost_aware
  +method@compare.draft1=draft compare.draft1.name=draft1 compare.draft1.num_speculative_tokens=1
  +method@compare.draft_ca=draft compare.draft_ca.name=draft_ca compare.draft_ca.num_speculative_tokens=4 compare.draft_ca.schedule=cost_aware
  +method@compare.eagle=eagle
  +method@compare.eagle_ca=eagle compare.eagle_ca.name=eagle_ca compare.eagle_ca.schedule=cost_aware
  +method@compare.hybrid=hybrid"}   # METHODS=...: another set
SHORT='data.categories=[qa,translation,math_reasoning]'   # short prompts: a batch of 16 fits the time budget

# batch 1: one prompt of each of Spec-Bench's six categories, in sequence (earlier outputs feed suffix decoding)
python -m specdec $COMMON $METHODS data.limit=1 generation.batch_size=1 hydra.run.dir=$RUNS/b1
# batch 4: 6 prompts, a batch of 4 and one of 2
python -m specdec $COMMON $METHODS "$SHORT" data.limit=2 generation.batch_size=4 hydra.run.dir=$RUNS/b4
# batch 16: 18 prompts, a batch of 16 and one of 2
python -m specdec $COMMON $METHODS "$SHORT" data.limit=6 generation.batch_size=16 hydra.run.dir=$RUNS/b16
