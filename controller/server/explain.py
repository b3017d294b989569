"""The English of the core's numbers: an explanation
(``specpilot.controller.core.snapshot.Explanation``) as the few sentences that ExplainDecision
returns as ``text``, and a decision event, with the figures it was taken on, as the decision log's
line (the dashboard, /api/decisions and ``specpilot policy watch``)."""

from __future__ import annotations

from specpilot.contract.records import OFFLINE_PIN, ArmFigures, DecisionEvent, Reason
from specpilot.controller.core.snapshot import Explanation

# What figures say instead of a ratio where the posteriors cannot rank the arms compared
# (``ArmFigures.too_little_evidence``, ``PolicyConfig.rank_probability``).
TOO_LITTLE = "too little evidence"


def arm_label(draft: str, k: int) -> str:
    """One (draft, K) as people read it: "off" without speculation, else "<draft> K=<k>"."""
    return "off" if k == 0 else f"{draft} K={k}"


def explanation_text(ex: Explanation) -> str:
    name, decision = ex.traffic_class, ex.decision
    if decision is None:
        return f"class {name!r} has no decision yet: no engine has connected."
    best = max(ex.arms, key=lambda a: a.goodput)
    chosen = next((a for a in ex.arms if a.arm == decision.arm), None)
    what = "speculation off" if decision.k == 0 else f"draft {decision.draft!r} with K={decision.k}"
    lines = [f"class {name!r} at batch {ex.batch_size}: {what} (reason: {decision.reason.value})."]
    if chosen is not None:
        lines.append(
            f"Expected {chosen.expected_tokens:.2f} tokens per step in "
            f"{chosen.step_seconds * 1e3:.2f} ms: {chosen.goodput:.1f} tokens/s, "
            + (f"{TOO_LITTLE} to tell it from no speculation." if chosen.too_little_evidence
               else "slowing the rest of the batch more than it gains." if chosen.goodput <= 0
               else f"{_times(chosen.speedup)} no speculation.")
        )
    if best.arm != decision.arm and not ex.best_ranked:
        lines.append(
            f"By posterior means {arm_label(repr(best.draft), best.k)} expects more, but with "
            f"{TOO_LITTLE} to rank the two."
        )
    elif best.arm != decision.arm:
        lines.append(
            f"By posterior means the best arm is {arm_label(repr(best.draft), best.k)} at "
            + (f"{_times(best.speedup)}" if not best.too_little_evidence
               else f"a speedup with {TOO_LITTLE} to tell it from no speculation")
            + "; the choice holds by hysteresis, dwell time, an override or an exploratory draw."
        )
    for draft, rates in ex.rates:
        lines.append(f"Acceptance by position for {draft!r}: "
                     f"{', '.join(f'{r:.2f}' for r in rates)}.")
    if ex.override is not None:
        lines.append(f"Override in force: {ex.override}.")
    if decision.probe_rate > 0:
        lines.append(
            f"Probing {decision.probe_rate:.1%} of {probe_unit(decision.probe_steps)} at "
            f"K={decision.probe_k} with {decision.probe_draft!r} so a recovery is noticed."
        )
    return " ".join(lines)


def probe_unit(whole_steps: bool) -> str:
    """What a probe share is a share of (``Decision.probe_steps``)."""
    return "steps (all of the class's requests in each)" if whole_steps else "requests"


def decision_text(event: DecisionEvent) -> str:
    """One decision-log line from the figures the decision was taken on, kept in the event, so
    that it reads the same whenever it is rendered, e.g. "code: K 4 -> 2 at batch 24 (goodput);
    d K=2 expects 1.10x the goodput of d K=4 (142 vs 129 tokens/s); expected 1.42x no
    speculation; d acceptance 0.52 +/- 0.03 at position 1".

    Arms are compared by ratios, never by percentages, and only in the direction the reason
    allows. A choice the posterior means favour says how much more the chosen arm expects than
    the one it replaced (or, switching speculation off, how little the old arm gained). A choice
    they do not favour (an exploring draw, a detected change) says so beside the arm they do
    favour; one that no goodput comparison made (an operator's override, an offline pin,
    warm-up) says what made it, with the chosen arm's own figures. A missing figure reads "no
    estimate yet"; a comparison the posteriors cannot rank (``ArmFigures.too_little_evidence``)
    reads "too little evidence" instead of a ratio."""
    return f"{_change(event)} {decision_detail(event)}"


def decision_detail(event: DecisionEvent) -> str:
    """A decision line after what changed: "at batch 24 (goodput); ..." (``decision_text``)."""
    new, old, fig = event.decision, event.previous, event.figures
    if fig is None:
        return f"({new.reason.value}); figures not recorded"
    parts = [f"at batch {fig.batch_size} ({new.reason.value})"]
    chosen = arm_label(new.draft, new.k)
    if fig.pinned_by == OFFLINE_PIN:
        return "; ".join([*parts, "offline class: speculation pinned off by configuration"])
    if new.reason is Reason.WARMUP:
        return "; ".join([*parts, "warm-up: no acceptance data for the class yet, so no "
                                  "estimate yet"])
    lead = {Reason.OVERRIDE: f"set by an operator ({fig.pinned_by or 'override'})",
            Reason.EXPLORE: f"exploring, to learn what {chosen} gains",
            Reason.CHANGE_DETECTED: "acceptance changed: decided afresh on the reset estimates",
            Reason.NEIGHBOURS: "held within the choices of the neighbouring batch ranges with "
                               "more evidence (the best K falls as the batch grows)",
            Reason.OFFLINE: "offline class, priced at full load"}.get(new.reason)
    parts += [lead] if lead else []
    if new.reason is Reason.OVERRIDE:
        if fig.chosen is None or new.k:
            parts.append(_expected(chosen, fig.chosen))
        if fig.best is not None and fig.best.too_little_evidence:
            parts.append(f"by posterior means {arm_label(fig.best.draft, fig.best.k)} would "
                         f"be the best, with {TOO_LITTLE} to rank it against {chosen}")
        elif fig.best is not None:
            parts.append(f"by posterior means {arm_label(fig.best.draft, fig.best.k)} would be "
                         f"the best, at {_speedup(fig.best)}" if fig.best.k else
                         "by posterior means no draft gains enough to pay for drafting")
    elif fig.chosen is None:
        parts.append(_expected(chosen, fig.chosen))
    else:
        if fig.best is not None:
            parts.append(_against_best(chosen, fig.chosen, fig.best))
        elif old is not None:
            parts.append(_gain(chosen, fig.chosen, arm_label(old.draft, old.k), fig.previous))
        if new.k and (old is None or old.k):  # against off, the ratio above is the speedup
            parts.append(_expected(chosen, fig.chosen))
    return "; ".join(parts + _acceptance(event))


def _change(event: DecisionEvent) -> str:
    """The class and what changed: "code: K 4 -> 2", "code: draft d -> ngram at K=2"."""
    new, old = event.decision, event.previous
    head = f"{new.traffic_class}: "
    if old is None:
        return head + arm_label(new.draft, new.k)
    if old.k == new.k and old.draft != new.draft:
        return head + f"draft {old.draft or 'none'} -> {new.draft or 'none'} at K={new.k}"
    head += f"K {old.k} -> {new.k}"
    if new.k and old.k and old.draft != new.draft:
        head += f" ({old.draft} -> {new.draft})"
    return head


def _times(ratio: float) -> str:
    """A ratio as "1.84x"; below what two decimals show, "below 0.01x" (never "0.00x")."""
    return f"{ratio:.2f}x" if ratio >= 0.005 else "below 0.01x"


def _speedup(f: ArmFigures) -> str:
    return f"{_times(f.speedup)} no speculation"


def _expected(label: str, f: ArmFigures | None) -> str:
    """The chosen arm's own expectation."""
    if f is None:
        return f"{label}: no estimate yet"
    if f.too_little_evidence:
        return f"{TOO_LITTLE} to tell {label} from no speculation"
    if f.goodput <= 0:
        return "expected to slow the rest of the batch more than it gains"
    return f"expected {_speedup(f)}"


def _rate(tokens_per_second: float) -> str:
    return (f"{tokens_per_second:,.0f}" if tokens_per_second >= 10
            else f"{tokens_per_second:.1f}")


def _gain(new: str, chosen: ArmFigures, old: str, previous: ArmFigures | None) -> str:
    """A choice the posterior means favour against the arm it replaces: the chosen arm expects
    at least the old arm's goodput, except when speculation goes off because drafting gains
    less than it must (``PolicyConfig.min_speedup``)."""
    if previous is None:  # no engine offers it any more
        return f"{old}: no estimate to compare with"
    if previous.too_little_evidence:
        return f"{TOO_LITTLE} to rank {new} against {old}"
    if previous.goodput <= 0 < chosen.goodput:
        return f"{old} would slow the rest of the batch more than it gains"
    if chosen.goodput >= previous.goodput > 0:
        return (f"{new} expects {_times(chosen.goodput / previous.goodput)} the goodput of {old} "
                f"({_rate(chosen.goodput)} vs {_rate(previous.goodput)} tokens/s)")
    if chosen.k == 0:
        return f"{old} expects only {_speedup(previous)}, too little to pay for drafting"
    # Not what the posterior means favour: the figures alone, no claim.
    return f"{new} expects {_rate(chosen.goodput)} tokens/s, {old} {_rate(previous.goodput)}"


def _against_best(new: str, chosen: ArmFigures, best: ArmFigures) -> str:
    """A choice the posterior means do not favour, against the arm they do."""
    name = arm_label(best.draft, best.k)
    if best.too_little_evidence:
        return f"{TOO_LITTLE} to rank {new} against {name}, the best by posterior means"
    if chosen.goodput <= 0:
        return f"{new} would slow the rest of the batch; by posterior means {name} is the best"
    if chosen.goodput >= best.goodput:  # above off, by less than drafting must gain
        return (f"{new} expects only {_speedup(chosen)}, too little to pay for drafting by "
                "posterior means")
    return (f"{new} expects {_times(chosen.goodput / best.goodput)} the goodput of {name}, the "
            "best by posterior means")


def _acceptance(event: DecisionEvent) -> list[str]:
    """Position-1 acceptance of the draft the decision is about (the chosen one, or the one
    speculation was switched off from), or that it has none yet: its arms were priced on the
    prior."""
    new, old, fig = event.decision, event.previous, event.figures
    if fig is None:
        return []
    arm = fig.chosen if new.k else fig.previous if old is not None and old.k else None
    if arm is None or not arm.k:
        return []
    if arm.acceptance is None:
        return [f"no acceptance data for {arm.draft} yet: priced on the prior"]
    mean, half_width = arm.acceptance
    return [f"{arm.draft} acceptance {mean:.2f} +/- {half_width:.2f} at position 1"]
