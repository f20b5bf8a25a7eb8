"""A hybrid proposer: several ways of drafting, and each step the one expected to give the most
tokens per second (Arctic Inference switches this way between suffix decoding and a model drafter).

Every step:
1. parts whose drafting is measured to be free (lookups: n-gram, suffix; under `cheap` of a plain
   step) all propose; each proposal is valued by what it offers: the width that pays best for it
   and the expected tokens from that width (`specdec.adaptive.policy.Planner.best_keep`);
2. parts that cost something (a draft model) are valued before running, by the k with the best
   expected rate from their acceptance so far and their measured drafting cost;
3. the best of these and plain decoding wins (`Planner.choose`: plain unless a part beats it by
   `margin`; a part passed over for long explores); a costly winner runs now, and a deterministic
   chain it proposes is kept at the width that pays given what each row offered (`Planner.keep`,
   as `cost_aware` does); a tree is scored whole.
A chain part never measured is tried first, drafting one token; one whose single token cost under
`cheap` of a plain step is then run with the lookups, at the full k, to measure that. A tree part
never measured is valued as any plan, its drafting free until measured: its first try scores its
whole width, so it waits for a batch size where that width could pay. A part that
runs a draft model is not tried blind: until measured its drafting is priced at the draft's share of
the target's parameters (`model_cost_hint`), and it runs when that could pay. A lookup that could
not pay even if every row offered k drafts is not run that step (`Planner.worth_proposing`).

Every cost and acceptance estimate is the policy's (`specdec.adaptive.policy`): drafting D(part, B, k) and
the rest of a step R(B, T) from this run's clocks, acceptance per part. Lookup parts that were not
chosen are judged anyway, against the tokens the step emitted (for a draft with no q, P(accepted)
= p(draft) = P(the emitted token equals it), so this is exact when greedy and unbiased when
sampling; a draft longer than what was emitted is censored, not rejected), so their estimates
keep up without exploring.

Per-step choices rest on estimates that can be off (pooled acceptance, one part's drafts valued
against another's), so the hybrid also follows the leader among strategies: switching per step, or
one part alone (taking plain steps where it cannot pay). Every step values each strategy as the
hindsight comparison below does, over decayed sums, and follows another strategy once it leads the
one followed by `margin` (`_stand`): by its own estimates, never lastingly slower than its best
part. The sums start afresh with each request (`standing="request"`, the default) or are kept
across requests per batch size (`"batch_size"`). Per request is the default because, kept across
requests, the leader of the first prompts (a lookup alone) was followed on later prompts of another
kind, where the trained drafter does better (experiments/policy/LOG.md, "The hybrid's leader chosen
per request").

`report()` gives, per generation, the part chosen at each step ("plain" for none), how often each
won, each fixed option's speed and that of the choices made (relative to plain decoding), and the
regret against the best single option in hindsight: 1 - (speed of the choices made) / (speed of
the best fixed option), all valued at the end of the step (exact counterfactual tokens where a
lookup's draft was judged against the emitted tokens, the model's expectation elsewhere; the cost
model's step costs; a part with no plan in a step counts a plain step), and the steps that
followed each strategy. Negative regret: switching beat every fixed option.

A part may draft token trees (the trained EAGLE-style drafter, `method.heads_path`): its k is a
depth, a tree of any depth is priced at its node budget in scoring width (and only once widths that
wide were measured at the batch size), its acceptance is learned per depth, and a tree is never
cut. A part with trained heads is optional: `heads_path: null` leaves it out.

The choice depends on the past and on deterministic proposals (functions of the past) only, and a
sampled draft is never cut, so every verifier stays lossless.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace

import torch

from specdec.adaptive.policy import Plan, Planner, StepClock, drafting, model_cost_hint, verified
from specdec.core.errors import InvalidInput
from specdec.core.schedules import cut
from specdec.core.tree import TreeProposal
from specdec.proposers.base import Proposal


def _without_heads(part) -> bool:
    """A part given as a factory whose `heads_path` is None: trained heads it does not have."""
    return "heads_path" in getattr(part, "keywords", {}) and part.keywords["heads_path"] is None


SWITCH = "switch"  # the strategy of choosing a part per step (the others: one part alone)
STANDING_DECAY = 0.99  # per step: strategies are compared over about the last 100 steps
LEAD_EVIDENCE = 16.0  # plain steps of valued time before a strategy's standing counts


class HybridProposer:
    """parts: name -> a proposer, or a factory called with `engine=` (Hydra `_partial_: true`).
    Other arguments are the policy's (see `specdec.adaptive.schedules.CostAwareSchedule`)."""

    name = "hybrid"

    def __init__(self, engine=None, parts: Mapping | None = None, margin: float = 0.02, explore: float = 0.01,
                 prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.98, window: int = 16,
                 cheap: float = 0.01, probe: int = 32, width_error: float = 0.5, confirm: int = 3,
                 optimism: float = 1.0, standing: str = "request", objective: str = "makespan"):
        if not parts:
            raise ValueError("method.proposer.parts: the hybrid needs at least one proposer, e.g. "
                             "{suffix: {_target_: specdec.proposers.suffix.SuffixProposer, _partial_: true}}")
        if not isinstance(parts, Mapping):
            raise InvalidInput(f"method.proposer.parts: a mapping of names to proposers, got {type(parts).__name__} "
                               f"{parts!r}")
        for n, p in parts.items():
            if not (hasattr(p, "propose") or callable(p)):
                raise InvalidInput(f"method.proposer.parts.{n}: {p!r} ({type(p).__name__}) is not a proposer or a "
                                   "factory of one; give one with _target_ and _partial_: true, e.g. "
                                   "{_target_: specdec.proposers.suffix.SuffixProposer, _partial_: true}")
        self.parts = {str(n): (p(engine=engine) if isinstance(p, type) or not hasattr(p, "propose") else p)
                      for n, p in parts.items() if not _without_heads(p)}
        if not self.parts:
            raise ValueError("method.proposer.parts: every part was left out (heads_path null)")
        for part in self.parts.values():  # the choice reads each lookup's offers on the host
            if hasattr(part, "static_width"):
                part.static_width = False
        self.trees = {n: p.num_nodes for n, p in self.parts.items() if getattr(p, "drafts_trees", False)}
        # With a tree part, the loop makes cache room for its nodes and verifies through the tree
        # verifier, which sends the other parts' chains to the chain rule.
        self.num_nodes = max(self.trees.values(), default=0)
        if standing not in ("batch_size", "request"):
            raise ValueError(f"method.proposer.standing must be batch_size or request, got {standing!r}")
        self.standing_scope = standing  # strategies compared over all requests at a batch size, or per request
        if "plain" in self.parts:
            raise ValueError("method.proposer.parts: 'plain' names plain decoding; call the part something else")
        self.hints = {n: c for n, c in ((n, model_cost_hint(p, engine)) for n, p in self.parts.items()) if c is not None}
        self.args = {"margin": margin, "explore": explore, "prior": prior, "prior_weight": prior_weight,
                     "decay": decay, "window": window, "cheap": cheap, "probe": probe,
                     "width_error": width_error, "confirm": confirm, "optimism": optimism, "objective": objective}
        try:  # a bad argument fails here, not at the first step
            Planner(1, **self.args)
        except ValueError as err:
            raise ValueError(f"method.proposer: {err}") from None
        self.planner: Planner | None = None  # made at the first step, when k_max is known
        self.clock = StepClock()
        self._drafted_before: set[str] = set()
        self._step: dict = {}
        self.choices: list[str] = []
        self.hindsight: dict[str, list[float]] = {}  # option -> [tokens, plain steps of time] this generation
        # Per batch size, decayed over steps (and kept across generations with standing="batch_size"): strategy ("switch", or a
        # part used alone) -> [tokens, plain steps of time], valued as in the hindsight comparison.
        self.standing: dict[int, dict[str, list[float]]] = {}
        self.follow: dict[int, str] = {}  # batch size -> the strategy followed now
        self.followed: list[str] = []  # per step of this generation

    def reset(self, state) -> None:
        if self.standing_scope == "request":
            self.standing, self.follow = {}, {}
        for part in self.parts.values():
            part.reset(state)
        self.clock.reset()
        if self.planner is not None:
            self.planner.new_generation()
        self._step, self.choices, self.hindsight, self.followed = {}, [], {}, []
        self._drafted_before: set[str] = set()  # parts that drafted in the previous step

    # ---------------------------------------------------------------- choosing

    def _timed(self, name: str, state, k: int) -> Proposal:
        start = time.perf_counter()
        proposal = self.parts[name].propose(state, k)
        self._step["drafts"].append((name, k, time.perf_counter() - start))
        return proposal

    def _planner(self, k: int) -> Planner:
        if self.planner is None:
            self.planner = Planner(k, **self.args)
            self.planner.costs.hints.update(self.hints)
            self.planner.nodes.update(self.trees)
        return self.planner

    @torch.inference_mode()
    def propose(self, state, k: int) -> Proposal:
        planner = self._planner(k) if k > 0 else self.planner
        if planner is not None:
            self.clock.tick(planner.costs)
            planner.next_step()
        b, rows = state.batch_size, state.open_rows()
        k = min(k, planner.k_max) if planner is not None else 0
        self._step = {"name": "plain", "asked": 0, "drafts": [], "lookups": {}, "options": {}, "rows": rows}
        if k == 0 or not rows or not planner.ready(b) or planner.probing(b):  # plain: nothing measured here yet, or a probe
            return Proposal.empty(b, state.tokens.device)
        # A chain never timed is tried first, one token: a draft model's first steps cost little. A
        # tree is not: its first try scores its whole width, so it is valued as any plan (drafting
        # free until measured) and taken where that width pays or when exploring is due. Tried
        # blind, a tree paid its whole width where it could not pay, and was never chosen after
        # (experiments/policy/LOG.md, "A tree part's first try").
        untimed = [n for n in self.parts if planner.costs.blind(n, b) and n not in planner.nodes]
        if untimed:
            return self._use(untimed[0], self._timed(untimed[0], state, 1), 1)

        lookups, spent, skipped = {}, 0.0, set()  # spent: the lookups' drafting, in plain steps, sunk for every option
        for name in self.parts:
            if planner.is_cheap(name, b) and not planner.worth_proposing(name, b, rows):
                skipped.add(name)  # no offer it could make would be kept: not run (its estimates wait for exploring)
            elif planner.is_cheap(name, b) or planner.only_tried(name, b):
                lookups[name] = self._timed(name, state, k)
                spent += planner.costs.draft_cost(name, b, k)
        options: list[tuple[str, Plan | None]] = []
        for name in self.parts:
            if name in skipped:
                continue
            if name in lookups:
                options.append((name, planner.best_keep(name, b, rows, lookups[name].lengths, spent)))
            else:
                options.append((name, planner.best_ask(name, b, rows, state.sampling.greedy, spent, cap=k,
                                                       switching=name not in self._drafted_before)))
        plain = planner.plain(b, rows, spent)
        name, plan = switch = planner.choose(options, plain)
        follow = self.follow.get(b, SWITCH)
        if follow != SWITCH:  # a single part has done better than switching lately: that part, or plain
            name, plan = planner.choose([o for o in options if o[0] == follow], plain)
        self._step.update(switch=switch, follow=follow)
        # A part with no plan this step (a lookup that offered or could offer nothing that pays, a
        # draft that cannot pay) would have taken a plain step as a fixed option too.
        self._step["options"] = {n: (p if p is not None else plain) for n, p in options} | \
            {n: plain for n in skipped} | {"plain": plain}
        self._step["lookups"] = {n: p for n, p in lookups.items() if n != name}
        if name is None:
            return Proposal.empty(b, state.tokens.device)
        if name in lookups:
            return self._use(name, cut(lookups[name], plan.k), k, offered=lookups[name].lengths)
        proposal = self._timed(name, state, plan.k)
        if proposal.probs is None and not isinstance(proposal, TreeProposal):
            # A deterministic chain is kept at the width that pays, given what each row offered, as
            # `cost_aware` does (`Planner.keep`): asked k, it was valued at its best width <= k, and
            # scoring all k drafts at batch 16, where a width costs what it is not worth, lost.
            keep = planner.keep(name, b, rows, proposal.lengths, plan.k).k
            if proposal.max_length > keep:
                return self._use(name, cut(proposal, keep), plan.k, offered=proposal.lengths)
        return self._use(name, proposal, plan.k)

    def _use(self, name: str, proposal: Proposal, asked: int, offered: list[int] | None = None) -> Proposal:
        self._step.update(name=name, asked=asked, offered=list(offered or proposal.drafted))
        return proposal

    # ---------------------------------------------------------------- learning

    def observe(self, state, outcome) -> None:
        step, planner = self._step, self.planner
        name = step.get("name", "plain")
        empty = replace(outcome, proposal=Proposal.empty(len(outcome.active), state.tokens.device),
                        accepted=[0] * len(outcome.active))
        for part_name, part in self.parts.items():  # a part that did not draft must not roll anything back
            part.observe(state, outcome if part_name == name else empty)
        if planner is None:
            return
        b, p = len(outcome.active), outcome.proposal
        drafts = step.get("drafts", [])
        self.clock.done(b, 1 + p.max_length, sum(d[2] for d in drafts), drafting(drafts, self._drafted_before))
        self._drafted_before = {d[0] for d in drafts if d[1] > 0}
        planner.stepped(b, 1 + p.max_length)
        self.choices.append(name)
        if name != "plain":
            rows = [r for r, on in enumerate(outcome.active) if on]
            planner.model(name).observe_offers(step["asked"], [step["offered"][r] for r in rows])
            planner.observe(name, verified(p.drafted, outcome.accepted, outcome.active))
        self._judge_lookups(state, outcome)
        self._record_hindsight(name, outcome)

    def _judge_lookups(self, state, outcome) -> None:
        """Lookup drafts not used this step, cut to the width they were valued at, compared with the
        tokens the step emitted; their counterfactual tokens go to the hindsight comparison."""
        options, counterfactual = self._step.get("options", {}), {}
        for part_name, proposal in self._step.get("lookups", {}).items():
            width = options[part_name].k if part_name in options else 0
            rates = self.planner.model(part_name).rates()
            rows, tokens = {}, []  # tokens: per row that took part, what this draft would have given
            drafts = proposal.drafts_on_host()  # a lookup's are on the host already: no read
            for r, (on, n) in enumerate(zip(outcome.active, outcome.emitted)):
                if not on:
                    continue
                draft = drafts[r][:width]
                emitted = state.committed[r][outcome.prev_seq_lens[r]: outcome.prev_seq_lens[r] + n]
                matched = next((i for i, (d, e) in enumerate(zip(draft, emitted)) if d != e), min(len(draft), n))
                tokens.append(matched + 1.0)
                if not draft:
                    continue
                if matched < min(len(draft), n):  # a verdict: draft matched + 1 was wrong
                    rows[r] = (matched, matched + 1)
                else:  # censored: the emitted tokens ran out; the rest of the draft is valued by the model
                    rows[r] = (matched, matched)
                    run = 1.0
                    for a in rates[matched: len(draft)]:
                        run *= a
                        tokens[-1] += run
            self.planner.observe(part_name, rows)
            counterfactual[part_name] = self._worth(tokens)
        self._step["counterfactual"] = counterfactual

    def _worth(self, tokens: list[float]) -> float:
        """`Planner.worth` of a step whose rows that took part emitted `tokens`, in row order."""
        return self.planner.worth(tokens, self.planner.rooms(self._step["rows"]))

    def _value(self, option: str, plan: Plan, chosen: str, outcome, counterfactual: dict) -> float:
        """What the step gave, or would have given, under `option`, in the policy's tokens
        (`Planner.worth`): realized for the choice made, one per row for a plain step, the
        counterfactual for a lookup judged this step, else the model's expectation."""
        if option == chosen:
            return self._realized(outcome)
        if plan.k == 0:
            return float(sum(outcome.active))
        return counterfactual.get(option, plan.tokens)

    def _realized(self, outcome) -> float:
        return self._worth([float(n) for n, on in zip(outcome.emitted, outcome.active) if on])

    def _record_hindsight(self, name: str, outcome) -> None:
        """The step's value under each option (`_value`), over its predicted cost in plain steps."""
        options = self._step.get("options", {})
        if not options:
            return  # a step that tried an untimed part: nothing to compare
        counterfactual = self._step.get("counterfactual", {})
        values = {o: (self._value(o, plan, name, outcome, counterfactual), plan.cost) for o, plan in options.items()}
        values["chosen"] = (self._realized(outcome), options[name].cost)
        for option, (tokens, cost) in values.items():
            total = self.hindsight.setdefault(option, [0.0, 0.0])
            total[0] += tokens
            total[1] += cost
        sw_name, sw_plan = self._step["switch"]
        strategies = {SWITCH: (self._value(sw_name or "plain", sw_plan, name, outcome, counterfactual), sw_plan.cost)}
        strategies |= {part: values[part] for part in self.parts if part in values}
        self._stand(len(outcome.active), strategies)

    def _stand(self, b: int, values: dict[str, tuple[float, float]]) -> None:
        """Follow the leader among strategies: switching per step, or one part alone (plain where
        it cannot pay). `values`: each strategy's (tokens, plain steps) this step, as in the
        hindsight comparison (switching: realized when it was followed, else the value of the part
        it would have chosen). Sums decay per step (kept across generations at this batch size only
        with `standing="batch_size"`); another strategy is followed once it leads the one followed by `margin`, with at
        least `LEAD_EVIDENCE` plain steps of evidence. So, by its own estimates, the hybrid is not
        lastingly slower than its best part, and switches per step where that pays."""
        table = self.standing.setdefault(b, {})
        for total in table.values():
            total[0] *= STANDING_DECAY
            total[1] *= STANDING_DECAY
        for strategy, (tokens, cost) in values.items():
            total = table.setdefault(strategy, [0.0, 0.0])
            total[0] += tokens
            total[1] += cost
        rates = {s: t / c for s, (t, c) in table.items() if c >= LEAD_EVIDENCE}
        follow = self.follow.get(b, SWITCH)
        if rates:
            best = max(rates, key=rates.get)
            if rates[best] > rates.get(follow, 0.0) * (1 + self.planner.margin):
                self.follow[b] = best
        self.followed.append(self._step["follow"])

    def report(self) -> dict:
        """Choices per step, wins per part, and the regret against the best fixed option in hindsight."""
        rates = {o: t / s for o, (t, s) in self.hindsight.items() if s > 0}
        chosen = rates.pop("chosen", None)
        best = max(rates, key=rates.get, default=None)
        plain = rates.get("plain")
        return {
            "choices": list(self.choices),
            "counts": {n: self.choices.count(n) for n in [*self.parts, "plain"]},
            # tokens (as the policy values them, `objective`) per unit of time of each fixed option and
            # of the choices made, plain = 1
            "speed_vs_plain": {o: round(r / plain, 3) for o, r in [*rates.items(), ("chosen", chosen)]
                               if plain and r is not None},
            "best_in_hindsight": best,
            # steps that followed each strategy: switching per step, or one part alone
            "followed": {s: self.followed.count(s) for s in dict.fromkeys(self.followed)},
            "regret": round(1.0 - chosen / rates[best], 4) if chosen and best else None,
        }
