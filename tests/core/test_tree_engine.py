"""Trees on the engine: one target pass scores a whole tree (tree positions, tree mask over the KV
cache), the cache then keeps exactly the accepted path (keys, values and the hidden states kept
beside them), and greedy tree decoding is token-identical
to plain greedy decoding for several static tree shapes, at batch size 1 and in a ragged batch."""

import pytest
import torch

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import CachedModel, Engine
from specdec.core.tree import TokenTree, TreeProposal, static_tree
from specdec.proposers.base import Proposal
from tests.conftest import RAGGED_PROMPTS

MEDUSA_LIKE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
SHAPES = {
    "chain": [[0], [0, 0], [0, 0, 0]],
    "medusa_like": MEDUSA_LIKE,
    "wide": [[0], [1], [2], [3], [0, 0], [1, 0]],
    "deep": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]],
}


def _sliding_model():
    """A tiny Mistral with a 4-token sliding window: the tree mask must keep the window."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        sliding_window=4, initializer_range=0.1, eos_token_id=None, bos_token_id=None,
                        pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 3.0 / 8)
    return model


def _fresh(model, batch, max_len=64):
    m = CachedModel(model, "target")
    m.reset(batch, max_len)
    return m


def _node_path(tree: TokenTree, row: int, node: int) -> list[int]:
    return [j for j in tree.paths[row, node].tolist() if j >= 0]


def _reference(model, seq: list[int]) -> tuple[CachedModel, torch.Tensor]:
    ref = _fresh(model, 1)
    return ref, ref.forward(torch.tensor([seq]))[0]


@pytest.mark.parametrize("arch", ["llama", "sliding"])
@pytest.mark.parametrize("rows", [1, 3])
def test_tree_pass_scores_each_node_as_its_path_and_keeps_only_the_accepted_path(target, arch, rows):
    model = target if arch == "llama" else _sliding_model()
    prompts = RAGGED_PROMPTS[:rows]
    lens = [len(p) for p in prompts]
    padded = torch.tensor([p + [0] * (max(lens) - len(p)) for p in prompts])
    # Row 0 the Medusa-like shape; row 1 a tree with two padding nodes; row 2 a chain-shaped start.
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2], [-1, 0, 0, 1, -1, -1], [-1, 0, 1, 2, 0, 4]])[:rows]
    tree = TokenTree.build(parents, [6, 4, 6][:rows])
    nodes = torch.randint(3, 250, (rows, 6), generator=torch.Generator().manual_seed(1))
    roots = torch.tensor([40, 41, 42])[:rows]
    accepted = [[1, 4], [], [0, 4, 5]][:rows]  # node indices from depth 1 down

    m = _fresh(model, rows)
    m.keep_hidden_states()
    m.forward(padded, advance=lens)
    logits = m.forward(torch.cat([roots[:, None], nodes], 1), positions=tree.positions(torch.tensor(lens)),
                       block_mask=tree.mask)
    for b in range(rows):  # every real node's logits equal a plain run over its own path
        for i in [-1] + list(range(tree.lengths[b])):
            path = [] if i < 0 else _node_path(tree, b, i)
            _, ref_logits = _reference(model, prompts[b] + [int(roots[b])] + nodes[b, path].tolist())
            assert torch.allclose(logits[b, i + 1], ref_logits[-1], atol=1e-5), (b, i)

    m.keep_path(lens, [nodes_b + [-1] * (3 - len(nodes_b)) for nodes_b in accepted])
    assert m.lengths == [n + 1 + len(a) for n, a in zip(lens, accepted)]
    new = torch.tensor([[60, 61], [62, 63], [64, 65]])[:rows]
    after = m.forward(new)
    for b in range(rows):  # the cache equals one that was fed only the accepted path
        seq = prompts[b] + [int(roots[b])] + nodes[b, accepted[b]].tolist() + new[b].tolist()
        ref, ref_logits = _reference(model, seq)
        assert torch.allclose(after[b], ref_logits[-2:], atol=1e-5)
        for layer in range(model.config.num_hidden_layers):
            k, v = m.cache.valid_kv(layer, b)
            k_ref, v_ref = ref.cache.valid_kv(layer, 0)
            assert k.shape == k_ref.shape
            assert torch.allclose(k, k_ref, atol=1e-5) and torch.allclose(v, v_ref, atol=1e-5)
        with torch.inference_mode():  # and the hidden states kept beside them are the path's too
            hidden_ref = model.get_decoder()(input_ids=torch.tensor([seq])).last_hidden_state[0]
        assert torch.allclose(m.cache.hidden[b, : m.lengths[b]], hidden_ref, atol=1e-5)


class TopRankTree:
    """A test proposer: fills a static tree with, at each node, the rank-th most likely token of
    `model` after the row's tokens and the node's parent path (run without a cache, independently
    of the engine's tree code). With probability `swap` the model's first two candidates trade
    places at a parent, so that accepted paths often go through second-ranked siblings."""

    name = "test_tree"

    def __init__(self, model, paths, swap: float = 0.0):
        self.model, self.shape, self.swap = model, static_tree(paths), swap
        self.num_nodes = self.shape.num_nodes
        self.paths_seen: list[list[int]] = []

    def reset(self, state):
        self.generator = torch.Generator().manual_seed(0)

    @torch.inference_mode()
    def propose(self, state, k):
        if k == 0:
            return Proposal.empty(state.batch_size, state.tokens.device)
        tree = self.shape.expand(state.batch_size)
        tokens = torch.zeros(state.batch_size, self.num_nodes, dtype=torch.long)
        for b in range(state.batch_size):
            prefix = state.tokens[b, : state.seq_lens[b]].tolist()
            ranked = {}
            for i, (parent, rank) in enumerate(zip(self.shape.parents, self.shape.ranks)):
                if parent not in ranked:
                    path = [] if parent < 0 else tokens[b, _node_path(tree, b, parent)].tolist()
                    order = self.model(torch.tensor([prefix + path])).logits[0, -1].argsort(descending=True)
                    if torch.rand((), generator=self.generator) < self.swap:
                        order[[0, 1]] = order[[1, 0]]
                    ranked[parent] = order
                tokens[b, i] = ranked[parent][rank]
        return TreeProposal(tokens, [self.num_nodes] * state.batch_size, tree=tree)

    def observe(self, state, outcome):
        for b, on in enumerate(outcome.active):
            if on:
                path = getattr(outcome.verification, "path", None)  # none: a last step that drafted nothing
                if path is not None:
                    self.paths_seen.append([i for i in path[b].tolist() if i >= 0])


def _generate(engine, proposer, prompts, **kw):
    dec = SpeculativeDecoder(engine, proposer, num_speculative_tokens=1)
    return dec.generate(prompts, **{"max_new_tokens": 24, **kw})


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("batch", ["single", "ragged"])
def test_greedy_tree_decoding_equals_plain_greedy(target, shape, batch):
    engine = Engine(target, dtype="float32")
    prompts = RAGGED_PROMPTS[:1] if batch == "single" else RAGGED_PROMPTS
    ref = SpeculativeDecoder(engine).generate(prompts, max_new_tokens=24)
    exact = _generate(engine, TopRankTree(target, SHAPES[shape]), prompts)
    assert exact.output_ids == ref.output_ids
    depth = max(len(p) for p in SHAPES[shape])
    assert exact.stats.mean_accepted_length > 0.9 * (depth + 1)  # the target's own top-1 branch: all accepted
    swapped = TopRankTree(target, SHAPES[shape], swap=0.5)
    out = _generate(engine, swapped, prompts)
    assert out.output_ids == ref.output_ids
    assert 1.2 < out.stats.mean_accepted_length < depth + 1
    if shape != "chain":  # paths through second-ranked siblings were accepted (and compacted)
        assert sum(any(swapped.shape.ranks[i] > 0 for i in p) for p in swapped.paths_seen) >= 3


def test_tree_stats_count_depth_as_drafted(target):
    engine = Engine(target, dtype="float32")
    out = _generate(engine, TopRankTree(target, MEDUSA_LIKE), RAGGED_PROMPTS[:1], max_new_tokens=12)
    assert out.stats.acceptance_rate == 1.0  # every step accepts its full depth of 3
    assert out.stats.per_position_acceptance == [1.0, 1.0, 1.0]
    assert out.verifier == "greedy" and out.lossless


def test_tree_method_refuses_a_lossy_verifier(target):
    engine = Engine(target, dtype="float32")
    dec = SpeculativeDecoder(engine, TopRankTree(target, MEDUSA_LIKE), verifier="typical")
    with pytest.raises(ValueError, match="no tree form"):
        dec.generate(RAGGED_PROMPTS[:1], max_new_tokens=4, temperature=0.7)
