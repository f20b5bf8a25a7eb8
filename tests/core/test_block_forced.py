"""Block verification (Sun et al. 2024) and forced acceptance.

Block verification is lossless: its output distribution is computed exactly, by enumerating every
draft block and every kept length, and equals the target's, for blocks shorter than k too; sampled
through the decoding loop on tiny models it passes the chi-square test of the joint distribution of
a whole step (two drafts and the bonus), which a variant that forgets a term of the keep probability
fails. On the same drafts it accepts at least as many as token-level speculative sampling: exactly in
expectation (the paper's 11/9 against 10/9, and tiny models over many seeds) and as measured.

Forced acceptance accepts draft i with the set probability a_i whatever it is, emits the target's
own token at the first slot not accepted, and is marked lossy wherever results go.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.core.metrics import RowStats
from specdec.core.sampling import SamplingParams, probabilities
from specdec.core.verify import BlockVerifier, ForcedVerifier, GreedyVerifier, make_verifier
from specdec.models import tiny_random_model
from specdec.proposers.base import Proposal
from specdec.proposers.draft_model import DraftModelProposer
from specdec.study.config import ConfigError
from tests.stats import chi_square_pvalue


class NoStopMassBlockVerifier(BlockVerifier):
    """Deliberately broken: h_i = r_i / r_i, the 1 - w_i in the denominator forgotten, so a prefix
    with any residual mass is always kept."""

    @staticmethod
    def keep_probability(r, w):
        return (r > 0).to(r.dtype)


class TokenResidualBlockVerifier(BlockVerifier):
    """Subtly broken: the token-level residual norm(max(p - q, 0)) after the kept prefix (w_tau left
    out). Off by less than 1e-3 in total variation here: the exact check sees it, sampling would not."""

    def residual(self, p_t, q_t, w_t):
        return super().residual(p_t, q_t, torch.ones_like(w_t))


# ---------------------------------------------------------------- exact distributions


def _tau_block(verifier: BlockVerifier, p, q, proposal) -> tuple[torch.Tensor, torch.Tensor]:
    """P(tau = i | block) [N, k+1] and the weights w, from the verifier's own h: the longest kept
    prefix is i when eta_i <= h_i and every longer one fails."""
    w = verifier.weights(p, q, proposal)
    h = verifier.keep_probabilities(p, q, proposal, w)  # [N, k]
    k = h.shape[1]
    cols = [torch.prod(1 - h, dim=1)]
    cols += [h[:, i - 1] * torch.prod(1 - h[:, i:], dim=1) for i in range(1, k + 1)]
    return torch.stack(cols, 1), w


def _tau_token(p, q, x) -> torch.Tensor:
    """Token-level speculative sampling: P(tau = i | block) [N, k+1], draft j kept w.p. min(1, p/q)."""
    k = x.shape[1]
    p_x = p[:, :k].gather(-1, x[..., None]).squeeze(-1)
    q_x = q.gather(-1, x[..., None]).squeeze(-1)
    acc = (p_x / q_x).clamp(max=1)
    reach = torch.cumprod(torch.cat([torch.ones_like(acc[:, :1]), acc], 1), 1)  # [N, k+1]
    return reach * torch.cat([1 - acc, torch.ones_like(acc[:, :1])], 1)


def _block_of(tables_p, tables_q, v, k, length=None):
    """Every draft block of a context-dependent toy pair: x [N, k], p [N, k+1, V], q [N, k, V], q(block).
    `length` < k: blocks of that many drafts, padded with token 0 (p and q go on along the padding)."""
    length = k if length is None else length
    blocks = [(*b, *[0] * (k - length)) for b in itertools.product(range(v), repeat=length)]
    x = torch.tensor(blocks).view(len(blocks), k)
    p = torch.stack([torch.stack([tables_p(b[:i]) for i in range(k + 1)]) for b in blocks])
    q = torch.stack([torch.stack([tables_q(b[:i]) for i in range(k)]) for b in blocks])
    q_block = torch.prod(q.gather(-1, x[..., None]).squeeze(-1)[:, :length], 1)
    return x, p, q, q_block


def _random_tables(v: int, seed: int, scale: float = 1.5):
    g = torch.Generator().manual_seed(seed)
    memo: dict[tuple, torch.Tensor] = {}

    def table(prefix: tuple) -> torch.Tensor:
        if prefix not in memo:
            memo[prefix] = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * scale, -1)
        return memo[prefix]

    return table


@pytest.mark.parametrize("verifier", [BlockVerifier(), NoStopMassBlockVerifier(), TokenResidualBlockVerifier()],
                         ids=["block", "broken", "subtly-broken"])
def test_block_verification_output_is_exactly_the_targets(verifier):
    """One step, then the target's own sampling up to k+1 tokens: the joint of those k+1 tokens,
    summed over every block, kept length and emitted token, equals the target's joint."""
    v, k = 3, 3
    p_table, q_table = _random_tables(v, 0), _random_tables(v, 1)
    x, p, q, q_block = _block_of(p_table, q_table, v, k)
    proposal = Proposal(x, [k] * len(x), q)
    tau, w = _tau_block(verifier, p, q, proposal)
    joint = torch.zeros([v] * (k + 1), dtype=torch.float64)
    for n, block in enumerate(x.tolist()):
        for t in range(k + 1):
            dist = p[n, k] if t == k else verifier.residual(p[n, t][None], q[n, t][None], w[n, t][None])[0]
            for y in range(v):
                for rest in itertools.product(range(v), repeat=k - t):
                    z = (*block[:t], y, *rest)
                    pr = q_block[n] * tau[n, t] * dist[y]
                    for j in range(t + 1, k + 1):
                        pr = pr * p_table(z[:j])[z[j]]
                    joint[z] += pr
    target = torch.zeros_like(joint)
    for z in itertools.product(range(v), repeat=k + 1):
        target[z] = torch.prod(torch.stack([p_table(z[:j])[z[j]] for j in range(k + 1)]))
    gap = float((joint - target).abs().sum())
    if type(verifier) is BlockVerifier:
        assert gap < 1e-12
    else:
        assert gap > 1e-4  # 0.37 and 3.5e-4: the exact check sees both breaks


def _emitted_dists(verifier: BlockVerifier, p, q, proposal, monkeypatch) -> torch.Tensor:
    """[N, k+1, V]: the distribution `verify_probs` itself draws the emitted token from when it keeps
    i drafts (its bonus-or-residual choice included): h forced to keep exactly i, `sample` captured."""
    drawn = []

    def capture(dist, generator=None):
        drawn.append(dist)
        return torch.zeros(len(dist), dtype=torch.long)

    monkeypatch.setattr("specdec.core.verify.sample", capture)
    n, k = proposal.tokens.shape
    for i in range(k + 1):
        h = torch.zeros(n, k, dtype=p.dtype)
        if i:
            h[:, i - 1] = 1.0
        monkeypatch.setattr(verifier, "keep_probabilities", lambda *args, h=h: h)
        assert verifier.verify_probs(p, proposal).accepted.tolist() == [i] * n
    monkeypatch.delattr(verifier, "keep_probabilities")
    return torch.stack(drawn, 1)


def test_block_verification_of_shorter_blocks_is_exactly_the_targets(monkeypatch):
    """Rows of 0..k-1 drafts next to full ones, in one batch (k = 3): as in the test above, one step
    completed by the target's own sampling to k+1 tokens, the emitted token's distribution read from
    verify_probs itself. A row that keeps all its gamma < k drafts must draw its bonus from
    p(. | X^gamma), not from a residual built with q at a padding slot."""
    v, k = 3, 3
    p_table, q_table = _random_tables(v, 2), _random_tables(v, 3)
    parts = [_block_of(p_table, q_table, v, k, length) for length in range(k + 1)]
    x, p, q, q_block = (torch.cat(t) for t in zip(*parts))
    lengths = [length for length, part in enumerate(parts) for _ in part[0]]
    verifier = BlockVerifier()
    proposal = Proposal(x, lengths, q)
    tau, _ = _tau_block(verifier, p, q, proposal)
    emitted = _emitted_dists(verifier, p, q, proposal, monkeypatch)
    target = torch.zeros([v] * (k + 1), dtype=torch.float64)
    for z in itertools.product(range(v), repeat=k + 1):
        target[z] = torch.prod(torch.stack([p_table(z[:j])[z[j]] for j in range(k + 1)]))
    for length in range(k + 1):
        joint = torch.zeros_like(target)
        for n in (i for i, g in enumerate(lengths) if g == length):
            block = x[n].tolist()
            assert float(tau[n, length + 1:].sum()) == 0  # padding is never kept
            for t in range(length + 1):
                for y in range(v):
                    for rest in itertools.product(range(v), repeat=k - t):
                        z = (*block[:t], y, *rest)
                        pr = q_block[n] * tau[n, t] * emitted[n, t, y]
                        for j in range(t + 1, k + 1):
                            pr = pr * p_table(z[:j])[z[j]]
                        joint[z] += pr
        assert float((joint - target).abs().sum()) < 1e-12, length


def test_the_papers_example_accepts_11_9_against_10_9():
    """Sun et al.'s motivating example: context-independent p = (1/3, 2/3), q = (2/3, 1/3), k = 2."""
    p_table = lambda prefix: torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)  # noqa: E731
    q_table = lambda prefix: torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)  # noqa: E731
    x, p, q, q_block = _block_of(p_table, q_table, 2, 2)
    tau, _ = _tau_block(BlockVerifier(), p, q, Proposal(x, [2] * 4, q))
    lengths = torch.arange(3, dtype=torch.float64)
    assert float(q_block @ (tau @ lengths)) == pytest.approx(11 / 9)
    assert float(q_block @ (_tau_token(p, q, x) @ lengths)) == pytest.approx(10 / 9)


# ---------------------------------------------------------------- tiny models, same drafts

V = 6
PROMPT = [3, 5, 2]
PARAMS = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def models():
    return (tiny_random_model(seed=21, vocab_size=V, eos_token_id=None, logit_std=1.5),
            tiny_random_model(seed=22, vocab_size=V, num_layers=1, eos_token_id=None, logit_std=1.5))


@torch.inference_mode()
def _model_blocks(target, draft, prompt, k):
    """Every block of k drafts after `prompt`, with both models' shaped probabilities along it."""
    x = torch.tensor(list(itertools.product(range(V), repeat=k)))
    seqs = torch.cat([torch.tensor(prompt).expand(len(x), -1), x], 1)
    n = len(prompt)
    p = probabilities(target(seqs).logits[:, n - 1:], PARAMS).double()  # [N, k+1, V]
    q = probabilities(draft(seqs).logits[:, n - 1: n - 1 + k], PARAMS).double()  # [N, k, V]
    q_block = torch.prod(q.gather(-1, x[..., None]).squeeze(-1), 1)
    return x, p, q, q_block


def test_block_accepts_at_least_token_level_in_expectation_over_many_seeds(models):
    """Exact expected accepted drafts per step, over the draft's own blocks, for 20 random prompts."""
    target, draft = models
    gains = []
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, V, (4,), generator=g).tolist()
        x, p, q, q_block = _model_blocks(target, draft, prompt, k=3)
        lengths = torch.arange(4, dtype=torch.float64)
        block = float(q_block @ (_tau_block(BlockVerifier(), p, q, Proposal(x, [3] * len(x), q))[0] @ lengths))
        token = float(q_block @ (_tau_token(p, q, x) @ lengths))
        assert block >= token - 1e-12, (seed, block, token)
        gains.append(block - token)
    assert sum(gains) / len(gains) > 0.01  # and strictly more on average


def test_block_and_token_level_sampled_on_the_same_drafts(models):
    """The verifiers as they run: 40,000 drafts sampled from the draft model, each judged by both;
    each mean accepted length matches its exact expectation, and block's is the larger."""
    target, draft = models
    x_all, p_all, q_all, q_block = _model_blocks(target, draft, PROMPT, k=3)
    g = torch.Generator().manual_seed(0)
    pick = torch.multinomial(q_block, 40_000, replacement=True, generator=g)
    proposal = Proposal(x_all[pick], [3] * len(pick), q_all[pick].float())
    p = p_all[pick].float()
    block = BlockVerifier().verify_probs(p, proposal, g).accepted.double()
    token_rule = make_verifier("speculative_sampling", PARAMS)
    token = token_rule.verify_probs(p, proposal, g).accepted.double()
    lengths = torch.arange(4, dtype=torch.float64)
    exact_block = float(q_block @ (_tau_block(BlockVerifier(), p_all, q_all, Proposal(x_all, [3] * len(x_all), q_all))[0] @ lengths))
    exact_token = float(q_block @ (_tau_token(p_all, q_all, x_all) @ lengths))
    se = 4 * 1.2 / 40_000 ** 0.5  # 4 standard errors (accepted counts have sd < 1.2)
    assert abs(block.mean() - exact_block) < se and abs(token.mean() - exact_token) < se
    assert exact_block > exact_token and block.mean() > token.mean()


def _exact_joint_of_tokens_2_to_4(target) -> torch.Tensor:
    """P(t2, t3, t4) = sum_t1 p(t1) p(t2|t1) p(t3|t1,t2) p(t4|t1,t2,t3), over the shaped target."""
    with torch.inference_mode():
        grid = torch.tensor(list(itertools.product(range(V), repeat=3)))  # (t1, t2, t3)
        seqs = torch.cat([torch.tensor(PROMPT).expand(len(grid), -1), grid], 1)
        p = probabilities(target(seqs).logits[:, -4:], PARAMS).double()  # predicting t1, t2, t3, t4
    p1 = p[0, 0]
    p2 = p[:, 1].view(V, V, V, V)[:, 0, 0]  # [t1, t2]
    p3 = p[:, 2].view(V, V, V, V)[:, :, 0]  # [t1, t2, t3]
    p4 = p[:, 3].view(V, V, V, V)  # [t1, t2, t3, t4]
    joint = p1[:, None, None, None] * p2[:, :, None, None] * p3[:, :, :, None] * p4
    return joint.sum(0).flatten()


def _sample_tokens_2_to_4(models, verifier, n=20_000) -> torch.Tensor:
    target, draft = models
    engine = Engine(target, draft, dtype="float32")
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=2, verifier=verifier)
    out = dec.generate([PROMPT] * n, max_new_tokens=4, temperature=PARAMS.temperature, seed=0)
    assert 0.05 < out.stats.acceptance_rate < 0.95  # the draft really differs
    triples = torch.tensor([o[1:4] for o in out.output_ids])
    return torch.bincount((triples[:, 0] * V + triples[:, 1]) * V + triples[:, 2], minlength=V ** 3)


def test_block_verification_preserves_the_joint_distribution_of_a_step(models):
    expected = _exact_joint_of_tokens_2_to_4(models[0])
    assert chi_square_pvalue(_sample_tokens_2_to_4(models, "block"), expected) > 1e-3


def test_broken_block_verification_fails_the_same_test(models):
    expected = _exact_joint_of_tokens_2_to_4(models[0])
    assert chi_square_pvalue(_sample_tokens_2_to_4(models, NoStopMassBlockVerifier()), expected) < 1e-6


def test_block_respects_per_row_draft_lengths_and_one_hot_q():
    """A row with fewer drafts is a block of its own length; padding is never kept; a deterministic
    proposer (q one-hot) keeps a prefix only as the target's probability of it allows."""
    p = torch.softmax(torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0)), -1)
    proposal = Proposal(torch.tensor([[1, 2, 3], [1, 2, 3], [4, 4, 4]]), [3, 1, 0])
    for seed in range(50):
        out = BlockVerifier().verify_probs(p, proposal, torch.Generator().manual_seed(seed))
        assert out.accepted.tolist()[1] <= 1 and out.accepted.tolist()[2] == 0


def test_make_verifier_block_is_greedy_at_temperature_zero():
    assert isinstance(make_verifier("block", SamplingParams(0.0)), GreedyVerifier)
    v = make_verifier("block", SamplingParams(1.0))
    assert isinstance(v, BlockVerifier) and v.lossless and v.name == "block"
    with pytest.raises(ValueError, match="takes no verifier_args"):
        make_verifier("block", SamplingParams(1.0), gamma=2)


# ---------------------------------------------------------------- forced acceptance

CURVE = [0.9, 0.5, 0.7, 0.3]


def test_forced_acceptance_follows_the_set_curve():
    """40,000 steps of k = 4 drafts: the number accepted per step follows P(j) = a_1..a_j (1 - a_{j+1})
    (chi-square), and the measured conditional per-position acceptance is the curve."""
    n, k = 40_000, len(CURVE)
    logits = torch.randn(n, k + 1, 7, generator=torch.Generator().manual_seed(0))
    drafts = torch.randint(0, 7, (n, k), generator=torch.Generator().manual_seed(1))
    out = ForcedVerifier(CURVE)(logits, Proposal(drafts, [k] * n), SamplingParams(), torch.Generator().manual_seed(2))
    expected, reach = [], 1.0
    for a in [*CURVE, 0.0]:
        expected.append(reach * (1 - a))
        reach *= a
    counts = torch.bincount(out.accepted, minlength=k + 1)
    assert chi_square_pvalue(counts, torch.tensor(expected)) > 1e-3
    stats = RowStats()
    for a in out.accepted.tolist():
        stats.record(k, a, a + 1)
    for measured, a, reached in zip(stats.per_position_acceptance, CURVE, stats.reached_at):
        assert abs(measured - a) < 5 * (a * (1 - a) / reached) ** 0.5


def test_forced_keeps_wrong_drafts_and_emits_the_targets_token_after_them():
    logits = torch.full((2, 4, 6), -5.0)
    logits[:, :, 1] = 5.0  # the target's argmax is 1 everywhere; the drafts are never 1
    drafts = torch.tensor([[2, 3, 4], [5, 5, 5]])
    out = ForcedVerifier([1.0, 1.0, 0.0])(logits, Proposal(drafts, [3, 1]), SamplingParams())
    assert out.accepted.tolist() == [2, 1]  # a_3 = 0 stops row 0; row 1 drafted one
    assert out.tokens[0, :3].tolist() == [2, 3, 1] and out.tokens[1, :2].tolist() == [5, 1]
    sampled = ForcedVerifier(0.0)(logits, Proposal(drafts, [3, 3]), SamplingParams(1.0), torch.Generator())
    assert sampled.tokens[:, 0].tolist() == [1, 1]  # at temperature 1, a sample of p (here all but one-hot)


def test_forced_checks_its_curve(engine_factory):
    assert not ForcedVerifier([0.5]).lossless
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        ForcedVerifier([0.5, 1.5])
    with pytest.raises(ValueError, match="k = 4"):
        ForcedVerifier([0.5, 0.5]).check_k(4)
    ForcedVerifier(0.5).check_k(16)  # one number: every position
    with pytest.raises(ValueError, match="acceptance"):
        make_verifier("forced", SamplingParams())
    engine = engine_factory(tiny_random_model(seed=1, eos_token_id=None))
    with pytest.raises(ValueError, match="k = 4"):
        SpeculativeDecoder(engine, DraftModelProposer(engine), 4, verifier="forced",
                           verifier_args={"acceptance": [0.5]}).generate([[1, 2]], max_new_tokens=4)


def test_forced_through_the_decoder_measures_the_curve_and_is_lossy(engine_factory):
    engine = engine_factory(tiny_random_model(seed=1, eos_token_id=None))
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine), 3, verifier="forced",
                             verifier_args={"acceptance": [0.8, 0.6, 0.4]}, eos_token_id=[])
    out = dec.generate([[1, 2, 3]] * 32, max_new_tokens=40, seed=3)
    assert out.lossless is False and out.verifier == "forced"
    total = out.stats.total
    for measured, a, reached in zip(total.per_position_acceptance, [0.8, 0.6, 0.4], total.reached_at):
        assert abs(measured - a) < 5 * (a * (1 - a) / reached) ** 0.5


def test_forced_runs_are_marked_lossy_in_results_and_table(tmp_path):
    from hydra import compose, initialize_config_dir

    from specdec.study import experiment
    from tests.study.test_experiment import CONF, FAST

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*FAST, "method=draft_forced", "method.verifier_args.acceptance=[0.5,0.5]",
                                           "method.num_speculative_tokens=2"])
    result = experiment.run(cfg, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["lossless"] is False and summary["verifier"] == "forced"
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {r["lossless"] for r in rows if r["method"] == "draft_forced"} == {False}
    assert "draft_forced (lossy)" in result.table
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        bad = compose("config", overrides=[*FAST, "method=draft_forced", "method.num_speculative_tokens=8"])
    with pytest.raises(ConfigError, match="method.verifier: .*k = 8"):
        experiment.run(bad, tmp_path / "bad")


@pytest.mark.parametrize(("method", "overrides"), [
    ("medusa", ["method.verifier=block", "generation.temperature=1.0"]),
    ("medusa", ["method.verifier=block"]),  # greedy at temperature 0, but block verification has no tree form
    ("eagle", ["method.verifier=forced", "+method.verifier_args.acceptance=0.5"]),
    ("eagle", ["method.verifier=typical", "generation.temperature=1.0"]),
])
def test_tree_proposers_refuse_verifiers_without_a_tree_form_before_any_model_loads(method, overrides, tmp_path,
                                                                                    monkeypatch):
    from hydra import compose, initialize_config_dir

    from specdec.study import experiment
    from specdec.study.config import validate
    from tests.study.test_experiment import CONF, FAST

    def no_model(*args, **kwargs):
        raise AssertionError("a model loaded before the config was refused")

    monkeypatch.setattr(experiment, "load_model", no_model)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*FAST, f"method={method}", *overrides])
        fine = compose("config", overrides=[*FAST, f"method={method}", "method.verifier=speculative_sampling",
                                            "generation.temperature=1.0", "target=smollm2_135m"])  # the heads' target
    with pytest.raises(ConfigError, match=f"method.verifier: method={method} drafts token trees, which take "
                                          "verifier=auto, greedy or speculative_sampling"):
        experiment.run(cfg, tmp_path)
    validate(fine)  # the rules with a tree form pass


def test_the_decoder_refuses_block_verification_of_a_tree():
    from specdec.core.tree_verify import TreeVerifier

    with pytest.raises(ValueError, match="verifier=block has no tree form"):
        TreeVerifier(BlockVerifier())
    assert TreeVerifier(GreedyVerifier()).name == "greedy"
