"""The decoding core runs where only torch and transformers are installed (a typical GPU box): with
hydra, omegaconf, wandb, gguf and datasets made unimportable, a speculative generation with a named
verifier and schedule still runs and equals plain greedy decoding."""

import subprocess
import sys

SCRIPT = """
import sys
for name in ("hydra", "omegaconf", "wandb", "gguf", "datasets"):
    sys.modules[name] = None  # import of any of them now raises ImportError
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.proposers.draft_model import DraftModelProposer
from specdec.core.schedules import make_schedule
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
engine = Engine(LlamaForCausalLM(cfg), LlamaForCausalLM(cfg), dtype="float32")
prompts = [[1, 2, 3, 4], [5, 6]]
spec = SpeculativeDecoder(engine, DraftModelProposer(engine), 3, verifier="block", schedule=make_schedule("cost_aware", 3),
                          eos_token_id=[]).generate(prompts, max_new_tokens=12)
plain = SpeculativeDecoder(engine, eos_token_id=[]).generate(prompts, max_new_tokens=12)
assert spec.output_ids == plain.output_ids, (spec.output_ids, plain.output_ids)
print("ok", spec.stats.steps, plain.stats.steps)
"""


def test_decoding_core_needs_no_harness_dependencies():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")
