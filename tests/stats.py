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
