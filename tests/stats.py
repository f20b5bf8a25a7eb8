"""Chi-square goodness of fit, with the p-value from torch (no SciPy needed)."""

import torch


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """observed: [C] counts; expected_probs: [C]. Cells with small expectation are pooled into one."""
    n = observed.sum().double()
    expected = expected_probs.double() * n
    small = expected < min_expected
    obs = torch.cat([observed.double()[~small], observed.double()[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    chi2 = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(len(obs) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, chi2 / 2))


def exact_joint_of_tokens_2_and_3(model, prompt: list[int], params, vocab: int) -> torch.Tensor:
    """P(t2, t3) = sum_t1 p(t1) p(t2|t1) p(t3|t1,t2) after `prompt`, under `model`'s distribution shaped
    by `params` (`SamplingParams`), over a vocabulary of `vocab` tokens: [vocab * vocab]."""
    from specdec.core.sampling import probabilities

    v = vocab
    with torch.inference_mode():
        grid = torch.cartesian_prod(torch.arange(v), torch.arange(v))  # [V*V, 2] (t1, t2)
        seqs = torch.cat([torch.tensor(prompt).expand(v * v, -1), grid], 1)
        p = probabilities(model(seqs).logits[:, -3:], params)
    joint = p[0, 0][:, None, None] * p[:, 1].view(v, v, v)[:, 0][:, :, None] * p[:, 2].view(v, v, v)
    return joint.sum(0).flatten()
