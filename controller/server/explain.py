"""The English of an explanation: the core explains a decision in numbers
(``controller.core.snapshot.Explanation``); this renders them as the few sentences that
ExplainDecision returns as ``text``."""

from __future__ import annotations

from controller.core.snapshot import Explanation
from controller.core.types import DecisionEvent


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
            f"{chosen.speedup:.2f}x no speculation."
        )
    if best.arm != decision.arm:
        lines.append(
            f"By posterior means the best arm is {arm_label(repr(best.draft), best.k)} at "
            f"{best.speedup:.2f}x; the choice holds by hysteresis, dwell time, an override or an "
            "exploratory draw."
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


def decision_text(event: DecisionEvent, ex: Explanation,
                  acceptance: tuple[float, float] | None) -> str:
    """One decision-log line, e.g. "code: K 4 -> 2 at batch 24 (goodput); acceptance 0.52 +/-
    0.03; K=4 goodput 9% below K=2". ``ex`` explains the (class, bucket) now and ``acceptance``
    is (mean, half-width of the credible interval) at position 1 of the draft in question, so
    the figures are as of when the line is rendered, not of the decision."""
    new, old = event.decision, event.previous
    head = f"{new.traffic_class}: "
    if old is None:
        head += arm_label(new.draft, new.k)
    elif old.k == new.k and old.draft != new.draft:
        head += f"draft {old.draft or 'none'} -> {new.draft or 'none'} at K={new.k}"
    else:
        head += f"K {old.k} -> {new.k}"
        if new.k and old.k and old.draft != new.draft:
            head += f" ({old.draft} -> {new.draft})"
    parts = [f"{head} at batch {ex.batch_size} ({new.reason.value})"]
    if acceptance is not None:
        parts.append(f"acceptance {acceptance[0]:.2f} +/- {acceptance[1]:.2f}")
    goodput = {a.arm: a.goodput for a in ex.arms}
    compared = old is not None and old.arm != new.arm and old.arm in goodput
    if old is not None and compared and goodput.get(new.arm, 0.0) > 0:
        ratio = goodput[old.arm] / goodput[new.arm] - 1.0
        parts.append(f"{arm_label(old.draft, old.k)} goodput {abs(ratio):.0%} "
                     f"{'below' if ratio < 0 else 'above'} {arm_label(new.draft, new.k)}")
    if new.k:
        parts.append(f"expected {new.expected_speedup:.2f}x")
    return "; ".join(parts)
