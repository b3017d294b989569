"""What a step is priced with: the one step-pricing formula, the layout of its weights as a
vector, and the per-step pricing the controller sends with a policy, which the plugin's half of
the policy (``specpilot.engine_plugin.policy.compose``) re-picks per step from.

    t = base + per_sequence x B + per_token x T + sum_j above_j x max(0, T - knot_j)
        + per_context x L x T + per_speculating_sequence x B x [T > B]
        + per_prefill_token x P
        + sum_d (fixed_d x drafting_d + per_pass_d x passes_d + per_token_d x tokens_d)

B is the batch's sequences, T the tokens the target verifies, L the mean tokens a sequence's KV
cache holds before the step (its context: 0 where unknown), [T > B] whether the step verifies
drafts at all, P the prompt tokens the step prefills beside its decoding (chunked prefill), and
per model draft d its chance of drafting at all in the step (1 or 0 for one step), its
sequential passes and its proposed tokens (deterministic drafts cost nothing here). Seconds,
never below ``MIN_STEP_SECONDS``. The controller's cost model fits the weights as one vector
(``StepColumns``) and prices mixed batches with them; an engine prices its steps with the same
weights as plain numbers (``StepPricing``). Both go through ``PricingArrays``, the one place
the formula is written.

Why: a (class, bucket) decision is priced at the class mix the controller expects in the bucket,
but the batch of one step holds the classes in whatever counts the traffic brought. A model
drafter runs as many passes as the largest K asked of it, so which arm pays for a class moves
with the others in the step: two chat requests among six documents should not pay the drafter's
passes that eight chat requests share (the oracle of the simulator runs such a class on n-gram
drafts in 40% of its steps on ``collapse``). The controller cannot decide per step (a report
interval holds hundreds), so it sends with each policy what pricing a step needs
(``Composition``: the step-cost model's mean weights and the posterior-mean E(K) curves of the
classes), and whether a new one moved enough to be worth sending (``moved``).

Pure (numpy, dataclasses).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
Arm = tuple[str, int]  # (draft, K); ("", 0) is off
MIN_STEP_SECONDS = 1e-6
# Columns of the target's terms before the hinges: base, batch size, verified tokens, context,
# speculating sequences, prefill tokens.
TARGET_COLUMNS = 6
# The context column's feature is L x T, the KV tokens all verified positions attend to: each
# verified position of a sequence attends to that sequence's whole context, so attention's work
# grows with both, and a longer draft (T) costs more the longer the contexts are. A column on
# the context alone (sum_ctx, read once per sequence) would price K=0 alike but leave the
# marginal cost of a verified token independent of context, which is what decides K.
CONTEXT_COLUMN = 3
# The speculating-sequences column's feature is B x [T > B]: a step that verifies drafts at all
# prepares every sequence's draft positions and runs the rejection sampler over the batch, a
# cost per sequence that no step without drafts pays, whatever the drafter. Without it the fit
# reads that cost as a price per verified token below the ridge and a negative price per
# sequence, and a deterministic drafter's step at a large batch is priced far below what it
# measures.
SPECULATING_COLUMN = 4
# The prefill column's feature is P, the prompt tokens a step prefills beside its decoding:
# compute-bound work whose time is linear in its tokens, so steps that carry a prefill chunk
# are priced (and learnt from) with the decode steps instead of left out.
PREFILL_COLUMN = 5
# Columns per model draft: drafts at all (0/1, or the share of steps drafting), sequential
# passes, proposed tokens.
DRAFT_COLUMNS = 3


def split_step_tokens(total_tokens: int, sequences: int, drafts: int) -> tuple[int, int]:
    """(verified, prefill) tokens of a step that schedules ``total_tokens`` for ``sequences``
    sequences with ``drafts`` draft tokens among them: every sequence verifies one token plus
    its drafts (``T``); the step's other tokens are prompt chunks prefilled beside them
    (``P``). How the plugin counts a live step, its start-up profile a dummy one, and the step
    anatomy a recorded one."""
    verified = min(total_tokens, sequences + drafts)
    return verified, total_tokens - verified


def speculates(batch_size: float, verified_tokens: npt.ArrayLike) -> npt.NDArray[np.bool_]:
    """Whether a step of ``batch_size`` sequences verifying ``verified_tokens`` verifies drafts
    at all (more tokens than one per sequence; a small tolerance for means of float sums)."""
    return np.asarray(verified_tokens, dtype=np.float64) > batch_size + 1e-9


@dataclass(frozen=True)
class DraftPricing:
    """What a model draft adds to a step in which it drafts, seconds."""

    fixed_seconds: float
    seconds_per_pass: float
    seconds_per_token: float


@dataclass(frozen=True)
class StepPricing:
    """The step-cost model by its posterior mean weights (``specpilot.controller.core.cost_model``),
    as plain numbers (the formula above; seconds)."""

    base_seconds: float
    seconds_per_sequence: float
    seconds_per_token: float
    knot_tokens: tuple[int, ...]
    seconds_per_token_above: tuple[float, ...]
    drafts: Mapping[str, DraftPricing] = field(default_factory=dict)
    # Per context token a verified token attends to (the L x T term).
    seconds_per_context_token: float = 0.0
    # Per sequence of a step that verifies drafts (the B x [T > B] term).
    seconds_per_speculating_sequence: float = 0.0
    # Per prompt token prefilled in the step (the P term).
    seconds_per_prefill_token: float = 0.0

    def __post_init__(self) -> None:
        if len(self.knot_tokens) != len(self.seconds_per_token_above):
            raise ValueError("step pricing: one slope per knot")
        numbers = [self.base_seconds, self.seconds_per_sequence, self.seconds_per_token,
                   self.seconds_per_context_token, self.seconds_per_speculating_sequence,
                   self.seconds_per_prefill_token, *self.knot_tokens,
                   *self.seconds_per_token_above,
                   *(x for d in self.drafts.values() for x in (
                       d.fixed_seconds, d.seconds_per_pass, d.seconds_per_token))]
        if not all(math.isfinite(x) for x in numbers):
            raise ValueError("step pricing: numbers must be finite")

    def seconds(self, batch_size: float, verified_tokens: FloatArray,
                passes: Mapping[str, FloatArray], draft_tokens: Mapping[str, FloatArray],
                context_tokens: float = 0.0, prefill_tokens: float = 0.0) -> FloatArray:
        """Step seconds, one per entry of ``verified_tokens``; ``passes`` and ``draft_tokens``
        per model draft (entries aligned with ``verified_tokens``; a draft with 0 passes does
        not draft), ``context_tokens`` per sequence, ``prefill_tokens`` for the step. Drafts
        without pricing cost nothing."""
        return self.arrays.seconds_by_name(batch_size, verified_tokens, passes, draft_tokens,
                                           context_tokens=context_tokens,
                                           prefill_tokens=prefill_tokens)

    @cached_property
    def arrays(self) -> PricingArrays:
        return PricingArrays(
            np.array([self.base_seconds, self.seconds_per_sequence, self.seconds_per_token,
                      self.seconds_per_context_token, self.seconds_per_speculating_sequence,
                      self.seconds_per_prefill_token]),
            np.array(self.knot_tokens, dtype=np.float64), np.array(self.seconds_per_token_above),
            tuple(self.drafts),
            np.array([[d.fixed_seconds, d.seconds_per_pass, d.seconds_per_token]
                      for d in self.drafts.values()]).reshape(-1, DRAFT_COLUMNS))


class PricingArrays:
    """The weights as arrays, model drafts by column (``index[name]``): the one place the
    formula is written. ``target``: base, per-sequence, per-token, per-context-token,
    per-speculating-sequence and per-prefill-token seconds; ``above``: the slope above each
    knot; ``draft_weights``: per draft, its fixed, per-pass and per-token seconds. Read at
    each call (views of a weight vector follow it)."""

    def __init__(self, target: FloatArray, knots: FloatArray, above: FloatArray,
                 drafts: Sequence[str], draft_weights: FloatArray) -> None:
        self.target = target
        self.knots = knots
        self.above = above
        self.index = {name: i for i, name in enumerate(drafts)}
        self.n = len(self.index)
        self.fixed = draft_weights[:, 0]
        self.per_pass = draft_weights[:, 1]
        self.per_draft_token = draft_weights[:, 2]

    def mixed_seconds(self, batch_size: float, verified: FloatArray,
                      drafting: FloatArray | npt.NDArray[np.bool_], passes: FloatArray,
                      draft_tokens: FloatArray, context_tokens: float = 0.0,
                      prefill_tokens: float = 0.0) -> FloatArray:
        """Step seconds, one per entry of ``verified``; ``drafting`` (each draft's chance of
        drafting at all), ``passes`` and ``draft_tokens`` as (entries x drafts);
        ``context_tokens``: the mean context per sequence; ``prefill_tokens``: the step's."""
        base, per_sequence, per_token, per_context, per_speculating, per_prefill = self.target
        per_verified = per_token + per_context * context_tokens
        t = (base + per_sequence * batch_size + per_verified * verified
             + per_speculating * batch_size * speculates(batch_size, verified)
             + per_prefill * prefill_tokens
             + np.maximum(0.0, verified[:, None] - self.knots[None, :]) @ self.above)
        for i in range(self.n):
            t = t + self.fixed[i] * drafting[:, i]
            t = t + self.per_pass[i] * passes[:, i]
            t = t + self.per_draft_token[i] * draft_tokens[:, i]
        return np.asarray(np.maximum(t, MIN_STEP_SECONDS), dtype=np.float64)

    def seconds(self, batch_size: float, verified: FloatArray, passes: FloatArray,
                draft_tokens: FloatArray, context_tokens: float = 0.0,
                prefill_tokens: float = 0.0) -> FloatArray:
        """``mixed_seconds`` of steps in which a draft drafts exactly where it runs passes."""
        return self.mixed_seconds(batch_size, verified, passes > 0, passes, draft_tokens,
                                  context_tokens, prefill_tokens)

    def seconds_by_name(self, batch_size: float, verified_tokens: npt.ArrayLike,
                        passes: Mapping[str, npt.ArrayLike],
                        draft_tokens: Mapping[str, npt.ArrayLike],
                        drafting: Mapping[str, npt.ArrayLike] | None = None,
                        context_tokens: float = 0.0, prefill_tokens: float = 0.0
                        ) -> FloatArray:
        """``mixed_seconds`` with each draft's figures by name (entries aligned with
        ``verified_tokens``); ``drafting`` None: a draft drafts where it runs passes. Drafts
        without a column cost nothing."""
        v = np.asarray(verified_tokens, dtype=np.float64)
        by_drafting, by_pass, by_token = np.zeros((DRAFT_COLUMNS, v.size, self.n))
        for figures, into in ((drafting or {}, by_drafting), (passes, by_pass),
                              (draft_tokens, by_token)):
            for name, x in figures.items():
                if (i := self.index.get(name)) is not None:
                    into[:, i] = x
        if drafting is None:
            by_drafting[:] = by_pass > 0
        return self.mixed_seconds(batch_size, v, by_drafting, by_pass, by_token, context_tokens,
                                  prefill_tokens)


class StepColumns:
    """The weights as one vector, as the cost model fits them: base, batch, tokens, context
    (``CONTEXT_COLUMN``), speculating sequences (``SPECULATING_COLUMN``), prefill tokens
    (``PREFILL_COLUMN``), one hinge per knot, then ``DRAFT_COLUMNS`` per model draft in
    ``drafts`` order."""

    def __init__(self, knots: Sequence[int], drafts: Sequence[str]) -> None:
        self.knots = np.asarray(knots, dtype=np.float64)
        self.drafts = tuple(drafts)
        self.index = {name: i for i, name in enumerate(self.drafts)}
        self.n_target = TARGET_COLUMNS + self.knots.size
        self.size = self.n_target + DRAFT_COLUMNS * len(self.drafts)

    def draft_columns(self, i: int) -> range:
        """The columns of the ``i``-th model draft."""
        first = self.n_target + DRAFT_COLUMNS * i
        return range(first, first + DRAFT_COLUMNS)

    def features(self, batch_size: float, verified_tokens: float, draft: str = "",
                 draft_passes: float = 0.0, draft_tokens: float = 0.0,
                 context_tokens: float = 0.0, prefill_tokens: float = 0.0) -> FloatArray:
        """The row of a step of this mean shape: its seconds are the row times the weights.
        ``draft``: the model draft that runs ``draft_passes`` (a mean below 1: the share of
        steps drafting) and proposes ``draft_tokens``; a draft without columns costs nothing.
        ``context_tokens``: the mean context per sequence (0: unknown, the column not read).
        ``prefill_tokens``: the prompt tokens the step prefills beside its decoding."""
        x = np.zeros(self.size)
        x[0] = 1.0
        x[1] = batch_size
        x[2] = verified_tokens
        x[CONTEXT_COLUMN] = context_tokens * verified_tokens
        x[SPECULATING_COLUMN] = batch_size * float(speculates(batch_size, verified_tokens))
        x[PREFILL_COLUMN] = prefill_tokens
        x[TARGET_COLUMNS : self.n_target] = np.maximum(0.0, verified_tokens - self.knots)
        if draft in self.index and draft_passes > 0:
            col = self.draft_columns(self.index[draft]).start
            x[col] = min(draft_passes, 1.0)
            x[col + 1] = draft_passes
            x[col + 2] = draft_tokens
        return x

    def weights(self, base: float, per_sequence: float, per_token: float,
                above: Sequence[float], drafts: Mapping[str, DraftPricing],
                per_context_token: float = 0.0, per_speculating_sequence: float = 0.0,
                per_prefill_token: float = 0.0) -> FloatArray:
        """A weight vector in these columns: the terms of ``StepPricing`` (``drafts`` must
        price every draft of the columns), unchecked."""
        return np.array([base, per_sequence, per_token, per_context_token,
                         per_speculating_sequence, per_prefill_token, *above,
                         *(x for d in (drafts[name] for name in self.drafts)
                           for x in (d.fixed_seconds, d.seconds_per_pass, d.seconds_per_token))],
                        dtype=np.float64)

    def pricing(self, weights: FloatArray) -> StepPricing:
        """A weight vector in these columns as plain numbers."""
        w = [float(x) for x in weights]
        return StepPricing(
            w[0], w[1], w[2], tuple(int(k) for k in self.knots),
            tuple(w[TARGET_COLUMNS : self.n_target]),
            {name: DraftPricing(*(w[c] for c in self.draft_columns(i)))
             for i, name in enumerate(self.drafts)}, w[CONTEXT_COLUMN], w[SPECULATING_COLUMN],
            w[PREFILL_COLUMN])

    def physical_rows(self, measured_knots: int = 0) -> FloatArray:
        """Rows A with A @ weights >= 0 for every weight vector a step can physically have:
        a verified token never makes a step faster, below the first knot and above each of the
        first ``measured_knots`` knots (those some measured step passed), at any context (the
        slope per token of each such segment, the context weight); nor does verifying drafts
        at all, a prompt token prefilled, or a model draft's drafting, passes or tokens. The
        base and the per-sequence weight are free (they trade off with the others over the
        batch sizes measured), and so are the segments no step reached: nothing pins them, and
        steps there are priced from the edge of what was measured."""
        rows = []
        for m in range(min(measured_knots, self.knots.size) + 1):  # above the first m knots
            row = np.zeros(self.size)
            row[2] = 1.0
            row[TARGET_COLUMNS : TARGET_COLUMNS + m] = 1.0
            rows.append(row)
        for col in (CONTEXT_COLUMN, SPECULATING_COLUMN, PREFILL_COLUMN,
                    *range(self.n_target, self.size)):
            row = np.zeros(self.size)
            row[col] = 1.0
            rows.append(row)
        return np.array(rows, dtype=np.float64)

    def arrays(self, weights: FloatArray) -> PricingArrays:
        """A weight vector in these columns as ``PricingArrays`` (views of it)."""
        return PricingArrays(
            weights[:TARGET_COLUMNS], self.knots, weights[TARGET_COLUMNS : self.n_target],
            self.drafts,
            weights[self.n_target :].reshape(-1, DRAFT_COLUMNS))


@dataclass(frozen=True)
class Composition:
    """What the plugin needs to price a step's arms: ``pricing``, and per (class, draft) the
    posterior-mean E(K) for K = 0..the draft's largest (classes without evidence for a draft
    have no curve for it: that draft is not an option for them). ``margin``: the relative gain
    in the step's tokens per second a re-pick needs over the decisions (0.01 = 1%)."""

    pricing: StepPricing
    expected_tokens: Mapping[tuple[str, str], tuple[float, ...]]
    margin: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"composition margin: must be a finite number >= 0, got "
                             f"{self.margin}")
        for (cls, draft), curve in self.expected_tokens.items():
            if len(curve) < 1 or not all(math.isfinite(x) and x >= 0 for x in curve):
                raise ValueError(f"composition: E(K) of ({cls!r}, {draft!r}) must be finite "
                                 "numbers >= 0, K = 0 first")

    def expected(self, traffic_class: str, arm: Arm) -> float:
        """E(K) of ``arm`` for the class (1 when off or unknown)."""
        draft, k = arm
        curve = self.expected_tokens.get((traffic_class, draft))
        return float(curve[k]) if k and curve is not None and k < len(curve) else 1.0


def moved(old: Composition | None, new: Composition | None, batch_sizes: Collection[int],
          max_k: int, tolerance: float,
          context_tokens: Mapping[int, float] | None = None) -> bool:
    """Whether ``new`` prices steps differently enough from ``old`` to be worth sending: a
    curve added or gone, an E(K) or the step time of some arm at one of ``batch_sizes`` (every
    sequence on one model draft at K = 0..``max_k``, over ``context_tokens[b]`` of context
    each, 0 where not given) moved by more than ``tolerance`` (relative), or the margin
    changed."""
    if old is None or new is None:
        return old is not new
    if old.margin != new.margin or old.expected_tokens.keys() != new.expected_tokens.keys():
        return True
    for key, curve in new.expected_tokens.items():
        before = old.expected_tokens[key]
        if len(curve) != len(before) or any(
                abs(a - b) > tolerance * b for a, b in zip(curve, before, strict=True)):
            return True
    ks = np.arange(max_k + 1, dtype=np.float64)
    for b in batch_sizes:
        shapes: list[tuple[dict[str, FloatArray], dict[str, FloatArray]]] = [({}, {})]
        shapes += [({d: ks}, {d: b * ks}) for d in new.pricing.drafts]
        context = (context_tokens or {}).get(b, 0.0)
        for passes, tokens in shapes:
            verified = b * (1.0 + ks)
            t_new = new.pricing.seconds(b, verified, passes, tokens, context)
            t_old = old.pricing.seconds(b, verified, passes, tokens, context)
            if np.any(np.abs(t_new - t_old) > tolerance * t_old):
                return True
    return False
