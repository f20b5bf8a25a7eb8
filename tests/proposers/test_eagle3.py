"""EAGLE-3 on tiny random targets: the target keeps the residual streams entering the tapped layers
(equal to transformers' `output_hidden_states`) through ragged passes, rollbacks and a tree's
compaction; the drafter's forward equals one written here from FORMATS.md's formulas; greedy
decoding with its trees and chains is token-identical to plain greedy, alone and in a ragged batch;
sampling with a reduced draft vocabulary keeps the target's distribution (and a chain whose q is
scattered to the wrong token ids fails the same test); drafters that do not fit the target are
refused, and a missing drafter is named."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import specdec.accel.packed_linear as packed_linear
from specdec.accel.passes import Accelerated
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import CachedModel, Engine
from specdec.core.errors import InputError, InvalidInput
from specdec.core.sampling import SamplingParams
from specdec.core.tree import TokenTree
from specdec.models import tiny_random_model
from specdec.proposers.base import Proposal
from specdec.proposers.eagle3 import Eagle3Drafter, Eagle3Proposer, default_layer_ids
from tests.conftest import RAGGED_PROMPTS
from tests.stats import chi_square_pvalue, exact_joint_of_tokens_2_and_3

ASSETS = Path(__file__).resolve().parents[1] / "assets"

SHAPES = [dict(budget=10, topk=3, width=3, depth=4), dict(budget=6, topk=2, width=1, depth=6),
          dict(budget=1, topk=1, width=1, depth=1)]


def canonical_config(target, draft_vocab: int | None = None, **flags) -> dict:
    """The canonical EAGLE-3 config (contract keys) of a drafter for `target`."""
    c = target.config
    return {**dict(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads,
                intermediate_size=c.intermediate_size, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=c.max_position_embeddings, vocab_size=c.vocab_size,
                draft_vocab_size=draft_vocab or c.vocab_size, target_hidden_size=c.hidden_size, layer_ids=None,
                layer_ids_source=None, norm_before_residual=False, norm_before_fc=False, fc_norm=False,
                norm_output=False, attention_bias=False, mlp_bias=False), **flags}


def drafter_files(target, draft_vocab: int | None = None, seed: int = 3, scale: float = 0.3, **flags):
    """DrafterFiles-shaped inputs: a canonical config and random tensors under the canonical names;
    a reduced vocabulary keeps `draft_vocab` random token ids, ascending, through `d2t` offsets."""
    config = canonical_config(target, draft_vocab, **flags)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        taps = config["layer_ids"] or default_layer_ids(target.config.num_hidden_layers)
        shapes = Eagle3Drafter({**config, "layer_ids": taps}).state_dict()
        tensors = {k: (1 if "norm" in k else 0) + scale * torch.randn_like(v) for k, v in shapes.items() if k != "d2t"}
        kept = torch.sort(torch.randperm(config["vocab_size"])[:draft_vocab]).values if draft_vocab else None
    if draft_vocab:
        tensors["d2t"] = kept - torch.arange(draft_vocab)
        tensors["t2d"] = torch.zeros(config["vocab_size"], dtype=torch.bool).index_fill_(0, kept, True)
    return SimpleNamespace(path="tiny-eagle3", format="eagle3-speculators", kind="eagle3", config=config,
                           tensors=tensors, notes=[])


@pytest.fixture(scope="module")
def target():
    return tiny_random_model(seed=0, eos_token_id=None)


@pytest.fixture(scope="module")
def small_target():
    """A 16-token vocabulary: a random drafter's guesses are often accepted, so steps accept and compact."""
    return tiny_random_model(seed=3, vocab_size=16, num_layers=8, eos_token_id=None, logit_std=2.0)


# --- the target's taps ---------------------------------------------------------------------------


def _taps_of(model, seq: list[int], layers: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        states = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in layers], -1)


@pytest.mark.parametrize("layers", [[0, 3, 8], [2, 4, 5], [1, 6], [8]])
def test_kept_taps_equal_output_hidden_states_through_rollback_and_compaction(small_target, layers):
    model, rows = small_target, len(RAGGED_PROMPTS)
    prompts = [[t % 16 for t in p] for p in RAGGED_PROMPTS]
    lens = [len(p) for p in prompts]
    m = CachedModel(model)
    m.reset(rows, 64)
    m.keep_hidden_states(layers)
    m.forward(torch.tensor([p + [0] * (max(lens) - len(p)) for p in prompts]), advance=lens)
    for b in range(rows):
        assert torch.allclose(m.cache.hidden[b, : lens[b]], _taps_of(model, prompts[b], layers), atol=1e-5)
    # two tokens fed, one kept: the rolled-back one is overwritten by the next pass
    m.forward(torch.tensor([[3, 4], [5, 6], [7, 8]]))
    m.rollback([n + 1 for n in lens])
    seqs = [p + [3 + 2 * b] for b, p in enumerate(prompts)]
    # a tree pass, then only the accepted path is kept
    parents = torch.tensor([[-1, 0, 0, 1], [-1, -1, 0, 1], [-1, 0, 1, -1]])
    tree = TokenTree.build(parents, [4, 4, 3])
    nodes = torch.randint(0, 16, (rows, 4), generator=torch.Generator().manual_seed(1))
    roots = torch.tensor([9, 10, 11])
    starts = [len(s) for s in seqs]
    m.forward(torch.cat([roots[:, None], nodes], 1), positions=tree.positions(torch.tensor(starts)), block_mask=tree.mask)
    accepted = [[0, 1], [], [0, 1, 2]]
    m.keep_path(starts, [a + [-1] * (3 - len(a)) for a in accepted])
    m.forward(torch.tensor([[12], [13], [14]]))
    for b in range(rows):
        seq = seqs[b] + [int(roots[b])] + nodes[b, accepted[b]].tolist() + [12 + b]
        assert m.lengths[b] == len(seq)
        assert torch.allclose(m.cache.hidden[b, : len(seq)], _taps_of(model, seq, layers), atol=1e-5), b


def test_taps_must_be_layers_of_the_target(small_target):
    m = CachedModel(small_target)
    for layers in ([9], [2, 1], [1, 1], [-1, 2], []):
        with pytest.raises(ValueError, match="taps"):
            m.keep_hidden_states(layers)
    assert default_layer_ids(32) == [2, 16, 29] and default_layer_ids(2) == [0, 1, 2]


# --- the drafter's forward against FORMATS.md's formulas ----------------------------------------


def _rms(x, w, eps=1e-5):
    """RMSNorm, normalised in float32 as transformers' LlamaRMSNorm does whatever the input's dtype."""
    y = x.float()
    return w * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x, positions, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # as transformers: float32
    freqs = torch.cat([positions[..., None].float() * inv] * 2, -1)  # [B, T, d]
    cos, sin = freqs.cos().to(x.dtype)[:, None], freqs.sin().to(x.dtype)[:, None]  # float32, as transformers
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


def _reference_forward(t: dict, config: dict, embeds, hidden, positions):
    """EAGLE-3's mid-layer as FORMATS.md section 1.2 writes it, causal, from the raw tensors (float64)."""
    t = {k: v.double() if v.is_floating_point() else v for k, v in t.items()}
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d = config["head_dim"]
    if hidden.shape[-1] != h:
        if config["fc_norm"]:
            hidden = torch.cat([_rms(x, t[f"fc_norm.{i}.weight"]) for i, x in enumerate(hidden.chunk(3, -1))], -1)
        hidden = hidden @ t["fc.weight"].T
    p = "layers.0."
    normed = _rms(hidden, t[p + "hidden_norm.weight"])
    residual = normed if config["norm_before_residual"] else hidden
    x = torch.cat([_rms(embeds, t[p + "input_layernorm.weight"]), normed], -1)  # [B, T, 2H]
    b, n = x.shape[:2]
    q = (x @ t[p + "self_attn.q_proj.weight"].T).view(b, n, heads, d).transpose(1, 2)
    k = (x @ t[p + "self_attn.k_proj.weight"].T).view(b, n, kv, d).transpose(1, 2)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(b, n, kv, d).transpose(1, 2)
    q, k = _rotate(q, positions), _rotate(k, positions)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = (q @ k.transpose(-1, -2)) / d ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, heads * d) @ t[p + "self_attn.o_proj.weight"].T
    hidden = residual + attn
    m = _rms(hidden, t[p + "post_attention_layernorm.weight"])
    gate, up = m @ t[p + "mlp.gate_proj.weight"].T, m @ t[p + "mlp.up_proj.weight"].T
    hidden = hidden + (torch.nn.functional.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    logits = _rms(hidden, t["norm.weight"]) @ t["lm_head.weight"].T
    return hidden, logits


@pytest.mark.parametrize("flags", [{}, {"norm_before_residual": True}, {"fc_norm": True}])
def test_drafter_forward_follows_the_published_formulas(target, flags):
    files = drafter_files(target, draft_vocab=100, **flags)
    drafter = Eagle3Drafter.from_files(files, target).eval().double()  # float64: the check is of the formulas
    torch.manual_seed(0)
    embeds, taps, own = (torch.randn(2, 7, w, dtype=torch.float64) for w in (64, 192, 64))
    positions = torch.arange(3, 10).expand(2, 7)
    with torch.inference_mode():
        for hidden in (taps, own):  # the target's taps (through fc) and the drafter's own output (not)
            out = drafter(embeds, hidden, positions)
            ref, ref_logits = _reference_forward(files.tensors, files.config, embeds, hidden, positions)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(drafter.logits(out), ref_logits, atol=1e-5, rtol=1e-5)
    kept = files.tensors["t2d"].nonzero().flatten()  # the target ids the draft vocabulary keeps, ascending
    assert torch.equal(drafter.target_ids(torch.arange(100)), kept)  # i + d2t[i]


# --- greedy: token identity ---------------------------------------------------------------------


def _greedy_check(model, prompts, files, k, **shape):
    engine = Engine(model, dtype="float32")
    ref = SpeculativeDecoder(engine).generate(prompts, max_new_tokens=20)
    proposer = Eagle3Proposer(engine, files, **shape)
    out = SpeculativeDecoder(engine, proposer, num_speculative_tokens=k).generate(prompts, max_new_tokens=20)
    assert out.output_ids == ref.output_ids and out.lossless
    assert sum(r.accepted for r in out.stats.rows) > 0  # drafts were accepted: the caches were compacted


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s.values())))
@pytest.mark.parametrize("batch", ["single", "ragged"])
def test_greedy_trees_equal_plain_greedy(small_target, shape, batch):
    prompts = [[t % 16 for t in p] for p in RAGGED_PROMPTS[: 1 if batch == "single" else 3]]
    _greedy_check(small_target, prompts, drafter_files(small_target, draft_vocab=12), shape["depth"], **shape)


@pytest.mark.parametrize("batch", ["single", "ragged"])
@pytest.mark.parametrize("vocab", [None, 12])
def test_greedy_chains_equal_plain_greedy(small_target, batch, vocab):
    prompts = [[t % 16 for t in p] for p in RAGGED_PROMPTS[: 1 if batch == "single" else 3]]
    _greedy_check(small_target, prompts, drafter_files(small_target, draft_vocab=vocab), 3, depth=3, chain=True)


@pytest.mark.skipif(not packed_linear.available(), reason="this torch build has no oneDNN linear kernels")
def test_the_drafter_runs_packed_where_the_engine_packs_and_stays_lossless(small_target, monkeypatch):
    """The drafter's own linear layers run packed for a generation (`Engine.add_module`), as the
    target's do, are given back after it, and the greedy tokens equal plain decoding's."""
    prompts = [[t % 16 for t in p] for p in RAGGED_PROMPTS[:3]]
    engine = Engine(small_target, dtype="float32", passes=Accelerated(packed_linear="on"))
    ref = SpeculativeDecoder(engine).generate(prompts, max_new_tokens=20)
    proposer = Eagle3Proposer(engine, drafter_files(small_target, draft_vocab=12), depth=3, budget=6)
    ran: set[int] = set()
    forward = packed_linear._packed_forward

    def recorded(self, x):
        ran.add(id(self))
        return forward(self, x)

    monkeypatch.setattr(packed_linear, "_packed_forward", recorded)
    out = SpeculativeDecoder(engine, proposer, num_speculative_tokens=3).generate(prompts, max_new_tokens=20)
    assert out.output_ids == ref.output_ids and out.lossless
    drafter_linears = {id(m) for m in proposer.drafter.modules() if isinstance(m, torch.nn.Linear)}
    assert drafter_linears & ran, "none of the drafter's linear layers ran packed"
    assert not any("forward" in vars(m) for m in proposer.drafter.modules())  # given back after the generation


def test_greedy_on_the_wide_target_with_the_files_own_taps(target):
    files = drafter_files(target, draft_vocab=128)
    files.config["layer_ids"] = [0, 1, 2]
    _greedy_check(target, RAGGED_PROMPTS, files, 4, **SHAPES[0])
    proposer = Eagle3Proposer(Engine(target, dtype="float32"), files, layer_ids=[0, 1, 2])
    assert proposer.target._hidden_layers == [0, 1, 2]


# --- sampling with a reduced draft vocabulary: the target's distribution -------------------------

V = 8
PROMPT = [3, 5, 2, 7, 4, 6, 3, 5, 1]
PARAMS = SamplingParams(temperature=0.9, top_k=6)
N = 20_000


@pytest.fixture(scope="module")
def sampling_target():
    return tiny_random_model(seed=11, vocab_size=V, num_layers=3, eos_token_id=None, logit_std=1.5)


class MisplacedQ(Eagle3Proposer):
    """Deliberately broken: puts the draft distribution at draft indices, not at the target's ids."""

    def propose(self, state, k):
        p = super().propose(state, k)
        if p.probs is None:  # nothing drafted
            return p
        vd = self.drafter.draft_vocab_size
        ids = self.drafter.target_ids(torch.arange(vd))
        q = p.probs[..., ids]
        wrong = torch.zeros_like(p.probs)
        wrong[..., :vd] = q
        return Proposal(p.tokens, p.lengths, wrong)


@pytest.mark.parametrize("cls, fits", [(Eagle3Proposer, True), (MisplacedQ, False)])
def test_sampled_chains_with_a_reduced_vocabulary_keep_the_targets_distribution(sampling_target, cls, fits):
    engine = Engine(sampling_target, dtype="float32")
    files = drafter_files(sampling_target, draft_vocab=5, scale=0.5)
    proposer = cls(engine, files, depth=2, chain=True)
    dec = SpeculativeDecoder(engine, proposer, num_speculative_tokens=2)
    out = dec.generate([PROMPT] * N, max_new_tokens=4, temperature=PARAMS.temperature, top_k=PARAMS.top_k, seed=0)
    assert out.lossless and out.verifier == "speculative_sampling"
    assert 0.05 < out.stats.acceptance_rate < 0.95
    pairs = torch.tensor([o[1:3] for o in out.output_ids])
    counts = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    p = chi_square_pvalue(counts, exact_joint_of_tokens_2_and_3(sampling_target, PROMPT, PARAMS, V))
    assert p > 1e-3 if fits else p < 1e-6


def test_sampled_trees_keep_the_targets_distribution(sampling_target):
    engine = Engine(sampling_target, dtype="float32")
    proposer = Eagle3Proposer(engine, drafter_files(sampling_target, draft_vocab=5, scale=0.5), budget=4, topk=2,
                              width=2, depth=2)
    out = SpeculativeDecoder(engine, proposer, num_speculative_tokens=2).generate(
        [PROMPT] * N, max_new_tokens=4, temperature=PARAMS.temperature, top_k=PARAMS.top_k, seed=0)
    assert out.lossless and out.verifier == "tree_sampling"
    pairs = torch.tensor([o[1:3] for o in out.output_ids])
    counts = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    assert chi_square_pvalue(counts, exact_joint_of_tokens_2_and_3(sampling_target, PROMPT, PARAMS, V)) > 1e-3


# --- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("change, message", [
    (lambda f: f.config.update(vocab_size=300), "vocab_size=300 where the target has 256"),
    (lambda f: f.config.update(target_hidden_size=96), "target_hidden_size=96 where the target has 64"),
    (lambda f: f.tensors.update(d2t=f.tensors["d2t"] + 200), "outside the target's 256"),
    (lambda f: f.tensors.pop("d2t"), "no d2t maps them"),
    (lambda f: f.config.update(layer_ids=[0, 1, 7]), "the target has 2 layers"),
    (lambda f: f.tensors.update({"fc.weight": torch.zeros(64, 128)}), "fc.weight reads 128 features"),
    (lambda f: f.tensors.pop("norm.weight"), "missing \\['norm.weight'\\]"),
    (lambda f: setattr(f, "kind", "medusa"), "holds a medusa drafter, not an EAGLE-3 one"),
])
def test_drafters_that_do_not_fit_the_target_are_refused(target, change, message):
    files = drafter_files(target, draft_vocab=128)
    change(files)
    with pytest.raises(InvalidInput, match=message):
        Eagle3Proposer(Engine(target, dtype="float32"), files)


@pytest.mark.parametrize("path", [None, "", "embedded"])
def test_a_missing_drafter_names_what_to_pass(target, path):
    with pytest.raises(InputError, match="method=eagle3 needs a drafter: set method.heads_path=<folder>"):
        Eagle3Proposer(Engine(target, dtype="float32"), path)


def test_topk_beyond_the_draft_vocabulary_is_refused(target):
    with pytest.raises(InvalidInput, match="proposes from 8 tokens"):
        Eagle3Proposer(Engine(target, dtype="float32"), drafter_files(target, draft_vocab=8), topk=9)


@pytest.mark.parametrize("dialect", ["speculators", "safeailab"])
def test_a_published_folder_drafts_as_the_files_it_was_written_from(small_target, tmp_path, dialect):
    from specdec.proposers import export

    files = drafter_files(small_target, draft_vocab=12)
    getattr(export, f"export_{dialect}")(files, tmp_path)
    prompts = [[t % 16 for t in p] for p in RAGGED_PROMPTS]
    engine = Engine(small_target, dtype="float32")
    runs = [SpeculativeDecoder(engine, Eagle3Proposer(engine, source, **SHAPES[0]), num_speculative_tokens=4)
            .generate(prompts, max_new_tokens=20) for source in (files, str(tmp_path))]
    assert runs[0].output_ids == runs[1].output_ids
    assert [r.accepted for r in runs[0].stats.rows] == [r.accepted for r in runs[1].stats.rows]


def test_eagle_and_eagle3_share_one_engine_each_reading_its_own_states(target):
    """EAGLE's last hidden states beside EAGLE-3's taps on one engine (one run compares them): the
    engine keeps the union, and each drafter decodes exactly as on an engine of its own."""
    from specdec.proposers.eagle import EagleProposer

    eagle_path, files = str(ASSETS / "tiny_random_eagle.safetensors"), drafter_files(target)

    def decode(engine, proposer):
        return SpeculativeDecoder(engine, proposer, num_speculative_tokens=4).generate(RAGGED_PROMPTS, max_new_tokens=16)

    alone = [decode(e, EagleProposer(e, eagle_path)) for e in [Engine(target, dtype="float32")]]
    alone += [decode(e, Eagle3Proposer(e, files)) for e in [Engine(target, dtype="float32")]]
    shared = Engine(target, dtype="float32")
    proposers = [EagleProposer(shared, eagle_path), Eagle3Proposer(shared, files)]
    n = shared.target.num_layers
    assert shared.target._hidden_layers == sorted({*proposers[1].layer_ids, n})
    plain = SpeculativeDecoder(shared).generate(RAGGED_PROMPTS, max_new_tokens=16)
    for proposer, own in zip(proposers, alone):
        out = decode(shared, proposer)
        assert out.output_ids == own.output_ids == plain.output_ids
        assert [r.accepted for r in out.stats.rows] == [r.accepted for r in own.stats.rows]
    shared.target.keep_hidden_states()  # asked again: the same union
    assert shared.target._hidden_layers == sorted({*proposers[1].layer_ids, n})


@pytest.mark.parametrize("kept, asked", [([0, 3, 8], [0, 8]), ([0, 3, 8], [3, 8]), ([0, 3, 8], None), ([2, 5], [5])])
def test_hidden_at_reads_a_drafters_own_taps_from_the_union(small_target, kept, asked):
    """`hidden_at`: the columns of the taps one drafter asked for, out of all the engine keeps; the
    last hidden states (None) are tap N."""
    prompts = [[t % 16 for t in p] for p in RAGGED_PROMPTS]
    lens = [len(p) for p in prompts]
    m = CachedModel(small_target)
    m.reset(len(prompts), 64)
    m.keep_hidden_states(kept)
    m.keep_hidden_states(asked)
    m.forward(torch.tensor([p + [0] * (max(lens) - len(p)) for p in prompts]), advance=lens)
    taps = [8] if asked is None else asked
    for b in range(len(prompts)):
        got = m.hidden_at(asked, b, slice(0, lens[b]))
        assert torch.allclose(got, _taps_of(small_target, prompts[b], taps), atol=1e-5)
    with pytest.raises(ValueError, match="never asked for"):
        m.hidden_at([1], 0, 0)
