"""One engine step's policy: what each request runs with, and what the drafter drafts.

A step looks the policy up once per batch size (``PolicyView.lookup``: the probe draws of the
step are made there), re-picks the settled classes' arms for the classes and counts of the step
(``compose``, batch_max engines), and resolves each class once: its decision or re-pick, its
probe, and the engine's drafter at K 0 where the choice names a draft the engine may not run.
A request then differs from its class only by its probe point (``ClassChoice.probed``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from specpilot.engine_plugin.policy.view import Choice, ClassChoice, PolicyLookup, PolicyView


class StepPolicy:
    """The policy of one step (make a new one, or ``start`` again, every step). ``allowed``:
    the drafts the engine may run; ``drafter``: the engine's own drafter, named with K 0 where a
    choice is not allowed."""

    __slots__ = ("_allowed", "_classes", "_composed", "_lookups", "_view", "off")

    def __init__(self, view: PolicyView, allowed: Collection[str], drafter: str) -> None:
        self._view = view
        self._allowed = allowed
        # What a request runs while off: the engine's drafter at K 0.
        self.off = Choice(drafter, 0, False)
        self._lookups: dict[int, PolicyLookup] = {}
        self._composed: dict[str, Choice] = {}
        self._classes: dict[tuple[PolicyLookup, str], ClassChoice] = {}

    def start(self) -> None:
        """A new step: lookups, re-picks and resolved classes are forgotten."""
        self._lookups.clear()
        self._composed = {}
        self._classes.clear()

    def lookup(self, batch_size: int) -> PolicyLookup:
        """This step's policy for a batch of ``batch_size`` (one lookup per size and step)."""
        lookup = self._lookups.get(batch_size)
        if lookup is None:
            lookup = self._lookups[batch_size] = self._view.lookup(batch_size)
        return lookup

    def compose(self, lookup: PolicyLookup, counts: Mapping[str, int], batch_size: int,
                context_tokens: float = 0.0) -> None:
        """Re-pick under ``lookup``, for the rest of the step, the arms of the settled classes
        for a step of ``batch_size`` sequences, ``counts`` per traffic class, over
        ``context_tokens`` of context each on average (``PolicyLookup.compose``)."""
        self._composed = lookup.compose(counts, batch_size, context_tokens)
        self._classes.clear()

    @property
    def composed(self) -> bool:
        """Whether this step re-picks some class's arm (the decisions then do not all stand)."""
        return bool(self._composed)

    def resolve(self, lookup: PolicyLookup, traffic_class: str) -> ClassChoice:
        """What the requests of ``traffic_class`` run with under ``lookup`` in this step: a probe
        stays as the policy asked, anything else may be re-picked, and a choice of a draft not
        allowed runs the drafter at K 0."""
        key = (lookup, traffic_class)
        resolved = self._classes.get(key)
        if resolved is None:
            c = lookup.resolve(traffic_class)
            choice = c.choice if c.choice.probe else self._composed.get(traffic_class, c.choice)
            resolved = self._classes[key] = ClassChoice(
                self._runnable(choice), c.probe_rate, self._runnable(c.probe_choice), c.epoch)
        return resolved

    def choice(self, lookup: PolicyLookup, traffic_class: str, request_key: str) -> Choice:
        """The (draft, K) of a request of ``traffic_class`` keyed ``request_key``."""
        return self.resolve(lookup, traffic_class).of(request_key)

    def uniform(self, lookup: PolicyLookup, classes: Iterable[str]) -> Choice | None:
        """The one choice every request of ``classes`` gets under ``lookup``, or None where they
        may differ (``PolicyLookup.uniform``; a step with re-picks is never taken as one)."""
        return None if self._composed else lookup.uniform(classes)

    def _runnable(self, choice: Choice) -> Choice:
        if choice.k and choice.draft not in self._allowed:
            return self.off
        return choice


def drafter_k(choices: Sequence[Choice], k_mode: str, deterministic: Collection[str]) -> int:
    """The K the engine's drafter drafts in a step of ``choices`` (at least one) in the batch
    modes. ``batch_max``: the largest K any request wants from the drafter (requests on
    ``deterministic`` drafts get theirs by substitution and need no passes); each request is
    then cut to its own. ``batch_wide``: the median, one K for all (keeps uniform-decode CUDA
    graphs on GPUs)."""
    if k_mode == "batch_max":
        return max((c.k for c in choices if c.draft not in deterministic), default=0)
    ks = sorted(c.k for c in choices)
    return ks[len(ks) // 2]
