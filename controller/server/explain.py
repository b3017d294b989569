"""The English of an explanation: the core explains a decision in numbers
(``controller.core.snapshot.Explanation``); this renders them as the few sentences that
ExplainDecision returns as ``text``."""

from __future__ import annotations

from controller.core.snapshot import Explanation


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
    if decision.k == 0 and decision.probe_rate > 0:
        lines.append(
            f"Probing {decision.probe_rate:.1%} of requests at K={decision.probe_k} with "
            f"{decision.probe_draft!r} so a recovery is noticed."
        )
    return " ".join(lines)
