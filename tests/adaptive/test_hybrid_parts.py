"""The hybrid's parts must be proposers or factories of them: anything else (a number, a name, a list
of names) is refused by the part's key, where it ended in `'int' object is not callable`."""

import pytest

from specdec.adaptive.hybrid import HybridProposer
from specdec.core.errors import InvalidInput
from specdec.proposers.suffix import SuffixProposer


@pytest.mark.parametrize("parts, message", [
    ({"x": 5}, r"method.proposer.parts.x: 5 \(int\) is not a proposer or a factory of one; give one with _target_"),
    ({"s": SuffixProposer, "x": "suffix"}, r"method.proposer.parts.x: 'suffix' \(str\) is not a proposer"),
    (["suffix"], r"method.proposer.parts: a mapping of names to proposers, got list"),
])
def test_a_part_that_is_not_a_proposer_is_refused_by_name(parts, message):
    with pytest.raises(InvalidInput, match=message):
        HybridProposer(parts=parts)


def test_proposers_and_factories_are_parts():
    hybrid = HybridProposer(parts={"made": SuffixProposer(), "factory": SuffixProposer})
    assert sorted(hybrid.parts) == ["factory", "made"]
    assert all(isinstance(p, SuffixProposer) for p in hybrid.parts.values())
