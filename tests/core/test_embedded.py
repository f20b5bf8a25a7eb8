"""The embedded SmolLM2-135M-Instruct target: speculative greedy decoding with the target as its
own draft equals plain greedy decoding (and `transformers` generate), with acceptance 1.0."""

import pytest
import torch

from specdec import DraftModelProposer, Engine, ModelSpec, SpeculativeDecoder, load_model
from specdec.study.data import build_turn_input

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    return load_model(ModelSpec(path="embedded"))


def test_self_draft_greedy_equals_plain_greedy_with_full_acceptance(smollm):
    model, tok = smollm
    engine = Engine(model, model, dtype="float32")
    prompts = [build_turn_input(tok, [], q) for q in
               ("Name three primary colors.", "Translate to French: The cat sleeps on the warm windowsill.")]
    plain = SpeculativeDecoder(engine, tokenizer=tok).generate(prompts, max_new_tokens=24)
    spec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=4, tokenizer=tok)
    out = spec.generate(prompts, max_new_tokens=24)
    assert out.output_ids == plain.output_ids
    # Every draft the target judged was accepted: no step ended at a rejection. (alpha itself counts the
    # drafts past max_new_tokens as proposed but not accepted, as vLLM's draft_acceptance_rate does.)
    total = out.stats.total
    assert total.recovered == 0 and total.bonus > 0
    assert out.stats.per_position_acceptance == [1.0] * 4
    assert all(len(o) > 5 for o in out.output_ids)  # really generated, not an immediate EOS
    with torch.inference_mode():
        hf = model.generate(torch.tensor([prompts[0]]), max_new_tokens=24, do_sample=False)
    assert hf[0, len(prompts[0]):].tolist() == plain.output_ids[0]
