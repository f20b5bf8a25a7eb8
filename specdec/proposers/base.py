"""The proposer protocol: how a way of drafting plugs into the decoding loop.

A proposer sees the decoding state (tokens so far, per row) and returns a `Proposal` of up to k
tokens per row, with the draft probabilities q when it has them. After verification it gets an
`observe` call with the outcome, so that it can roll back its own state (a draft model's KV cache)
or learn (acceptance statistics). Nothing else is required: a new strategy is one module.

The types and the protocol are defined in `specdec.core.types`, beneath both the loop and the proposers;
this module hands them on to proposers, which import them from here.
"""

from specdec.core.types import DecodeState, Proposal, Proposer, StepOutcome

__all__ = ["DecodeState", "Proposal", "Proposer", "StepOutcome"]
