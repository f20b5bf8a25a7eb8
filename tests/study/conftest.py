"""The study tests' shared fixture: the order in which a run measures its decoders."""

import pytest

from specdec.study import experiment


@pytest.fixture
def batch_calls(monkeypatch) -> list[tuple[str, str]]:
    """From now on, (prompt id, decoder role) of every batch an experiment measures, in order."""
    calls = []
    real = experiment.run_batch

    def spy(decoder, role, batch, *args):
        calls.append((batch[0].prompt_id, role))
        return real(decoder, role, batch, *args)

    monkeypatch.setattr(experiment, "run_batch", spy)
    return calls
