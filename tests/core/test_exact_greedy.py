"""Exact greedy in bfloat16 on the embedded SmolLM2-135M: with `exact_greedy` on (every target pass
scored at one width, attention over the whole cache buffer), n-gram lookup and the draft method
(draft = the target itself) produce plain decoding's tokens exactly, alone and in a ragged batch
(against plain decoding of the same batch).
Without it, the same token scored in passes of different shapes gets different logits, which is
what lets outputs drift."""

import pytest
import torch

from specdec import Engine, ModelSpec, SpeculativeDecoder, load_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer
from specdec.study.data import build_turn_input

pytestmark = pytest.mark.slow

K = 4
QUESTIONS = (
    "Summarize in one sentence: The city council met on Tuesday to discuss the new bus routes. After a "
    "long debate, the council voted to extend two routes to the airport and to add night buses on weekends.",
    "Translate to German: The weather is nice today, so we are going to the park.",
    "What is 17 times 23? Think step by step.",
)


@pytest.fixture(scope="module")
def setup():
    model, tok = load_model(ModelSpec(path="embedded"))
    engine = Engine(model, model, dtype="bfloat16")
    prompts = [build_turn_input(tok, [], q) for q in QUESTIONS]
    return engine, prompts


def _decoders(engine, exact: bool):
    plain = SpeculativeDecoder(engine, exact_greedy=exact)
    ngram = SpeculativeDecoder(engine, NgramProposer(engine), K, exact_greedy=exact)
    draft = SpeculativeDecoder(engine, DraftModelProposer(engine), K, exact_greedy=exact)
    for d in (plain, ngram, draft):
        d.score_width = K + 1  # one width for all three, as an experiment sets it
    return plain, ngram, draft


def test_speculative_greedy_equals_plain_decoding_in_bfloat16(setup):
    engine, prompts = setup
    plain, ngram, draft = _decoders(engine, exact=True)
    for prompt in prompts:
        want = plain.generate([prompt], max_new_tokens=48).output_ids[0]
        for dec in (ngram, draft):
            out = dec.generate([prompt], max_new_tokens=48)
            assert out.output_ids[0] == want
            assert out.stats.total.accepted > 0


def test_a_ragged_batch_equals_plain_decoding_of_the_same_batch(setup):
    """The same batch, not each prompt alone: the batch's composition is part of every pass's shape
    too (measured: one of these three prompts decodes differently in this batch than alone)."""
    engine, prompts = setup
    plain, ngram, draft = _decoders(engine, exact=True)
    want = plain.generate(prompts, max_new_tokens=32).output_ids
    assert ngram.generate(prompts, max_new_tokens=32).output_ids == want
    assert draft.generate(prompts, max_new_tokens=32).output_ids == want


def test_without_a_fixed_shape_a_token_gets_other_logits(setup):
    """The reason for the option: the last prompt token and three more, scored in one 4-wide pass,
    against each scored alone (1 wide, the key length growing): some logits differ in bfloat16. With
    both passes the same width and the key length fixed, none do."""
    engine, prompts = setup
    target = engine.target
    ids = torch.tensor([prompts[0] + prompts[1][:3]])
    n = len(prompts[0])

    def scored(width: int, fixed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        target.reset(1, n + 16)
        target.cache.fixed_kv_len = fixed
        target.forward(ids[:, : n - 1])
        block = ids[:, n - 1 : n + 3]
        together = target.forward(torch.cat([block, block[:, :1].expand(1, width - 4)], 1))[0, :4]
        target.rollback([n - 1])
        alone = []
        for j in range(4):
            alone.append(target.forward(torch.cat([block[:, j : j + 1]] * width, 1))[0, 0])
            target.rollback([n + j])
        return together, torch.stack(alone)

    together, alone = scored(width=4, fixed=True)  # the 1-token passes padded to 4 as well
    assert torch.equal(together, alone)
    target.reset(1, n + 16)
    target.forward(ids[:, : n - 1])
    one_wide = [target.forward(ids[:, n - 1 + j : n + j])[0, 0] for j in range(4)]
    assert not all(torch.equal(a, b) for a, b in zip(together, one_wide))
