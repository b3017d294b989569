"""Step-time model: seconds per engine step as a function of batch size, verified tokens and draft
work, fitted online from the engine's step timings.

    t = c0 + c_B * B + c_T * T + sum_j c_j * max(0, T - knot_j) + c_L * L * T
        + c_S * B * [T > B] + c_P * P
        + sum_d (f_d * [d drafts] + p_d * passes_d + q_d * draft_tokens_d)

(the formula, and the layout of its weights as one vector, are ``specpilot.contract.pricing``'s)
where B is the batch size, T the tokens the target verifies (B plus the drafts), L the mean
context per sequence (the KV tokens each verified token attends to), [T > B] whether the step
verifies drafts at all (its sequences' draft positions prepared and the rejection sampler run,
whatever the drafter), P the prompt tokens the step prefills beside its decoding, the hinge terms
let the slope per token rise where the step turns from memory-bound to compute-bound, and each
model draft d adds a fixed cost whenever it drafts at all (its input preparation, the rejection
sampler's set-up, the bookkeeping of a speculative step: on this CPU about 2.5 ms at batch 1, as
much as two passes), a cost per sequential draft pass (K of them) and per proposed token (B*K).
Without the fixed term the jump from no speculation to K=1 is read as a per-pass cost, and longer
drafts are priced far above what they cost. N-gram drafts cost nothing measurable. The fit is
Bayesian linear regression in information form: the prior is a set of virtual observations of the
prior roofline (so it is usable before any data and carries units).

Step costs are facts about the hardware, not about the traffic, so the evidence is never forgotten
on a clock: a quiet hour of small batches must not return a peak's batch sizes to the prior.
Each observation forgets only along its own direction (directional forgetting: n new steps of
features x halve, every ``half_life_steps`` steps, what the evidence says along x, and nothing
across it), so a shape the engine keeps running follows drift while one it stopped running keeps
what was measured. A change of the hardware itself (another tenant, a new build) shows in the
residuals: a two-sided CUSUM of each observation's log ratio to the prediction before it
(``CostChangeTest``) forgets most of the evidence when it accumulates past its threshold, as the
acceptance estimator does on a detected change.

A shape larger than any the model timed (more sequences, or more verified tokens, than its own
observations reached: ``Extent``) is priced from the edge of what was timed: the fit at the
nearest timed size plus the edge's slopes per sequence and per verified token, neither below
zero, times the excess. Extrapolated freely, a fit of a few timed shapes against the prior's
virtual ones bent its hinges and its per-sequence weight to opposite signs beyond them: a plain
step at an untimed batch size priced at the 1 us floor (so that K=1 expected ten times the
goodput of K=2 there), or every K at one price (speculation free at high load).

The evidence is a sufficient statistic (``CostEvidence``: the information matrix, the
time-weighted features, the squared times, reports and steps), so engines of one type (model,
drafts, hardware) share it as they share acceptance evidence: the posterior is prior + own + the
fleet's (``specpilot.controller.core.fleet.fleet_costs``), and what a model exports is only its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from specpilot.contract.pricing import (
    CONTEXT_COLUMN,
    MIN_STEP_SECONDS,
    PREFILL_COLUMN,
    TARGET_COLUMNS,
    DraftPricing,
    FloatArray,
    PricingArrays,
    StepColumns,
    StepPricing,
    speculates,
)
from specpilot.contract.records import DraftSpec
from specpilot.controller.core.tunable import tunable

SunkDraft = tuple[str, int]  # (model draft name, draft passes per step)
_RIDGE = 1e-9  # keeps the information matrix invertible for features no design point excites
# Added to the unit diagonal of the scaled precision only when it does not factorize as it is.
_JITTER = 1e-10
# Keeps the scaled information matrix invertible where the evidence measured too few shapes
# (the features of an unmeasured shape then read a huge variance: nothing is forgotten).
_FORGET_RIDGE = 1e-9
# The share of a model's own evidence kept when its change test fires: the new costs take over
# within a report or two, the old ones still temper a single noisy one.
_FORGET_ON_CHANGE = 1.0 / 64.0
# Virtual reports behind the prior noise level: the noise estimate follows the data quickly.
_NOISE_PRIOR_REPORTS = 2.0
# The context the prior's virtual steps are read at for the context column's own weight,
# tokens per sequence: a few hundred, where attention starts to matter.
_PRIOR_CONTEXT_TOKENS = 512.0
# The prefill column's own prior: as firm as this many virtual steps of this many prefill tokens
# each. Light: a prompt token's price differs by orders of magnitude between a CPU and a GPU, and
# held as firmly as the other weights' prior (the design's 20 steps) the prior's price outweighed
# a thousand live steps of short prompts, and the other columns bent to make up for it.
_PRIOR_PREFILL_TOKENS = 512.0
_PRIOR_PREFILL_STEPS = 1.0
# Seconds (per token, per sequence) by which a weight may read below zero and count as zero:
# far below any price a step shows, far above the solves' rounding.
_PHYSICAL_SLACK = 1e-12
# Virtual steps behind the prior's level (``_rebuild_prior``): a tenth of one, so the first live
# steps set it.
_PRIOR_LEVEL_STEPS = 0.1


@dataclass(frozen=True)
class CostPrior:
    """Step-cost model prior: what a step costs before any timing is observed."""

    base_seconds: float = tunable(0.02, ge=0)
    """Prior fixed step time, seconds."""
    seconds_per_token: float = tunable(2e-5, ge=0)
    """Prior step time per verified token below the ridge, seconds."""
    ridge_tokens: int = tunable(128, ge=1, one_of="cost_knots_tokens")
    """Prior ridge point (memory- to compute-bound), verified tokens; must be one of
    cost_knots_tokens."""
    seconds_per_token_above_ridge: float = tunable(2e-4, ge=0)
    """Prior extra step time per verified token above the ridge, seconds."""
    draft_seconds_fixed: float = tunable(5e-4, ge=0)
    """Prior model-draft time per step in which it drafts at all, whatever K, seconds."""
    draft_seconds_per_pass: float = tunable(1e-3, ge=0)
    """Prior model-draft time per sequential draft pass, seconds."""
    draft_seconds_per_token: float = tunable(1e-5, ge=0)
    """Prior model-draft time per proposed token, seconds."""
    seconds_per_context_token: float = tunable(0.0, ge=0)
    """Prior step time per context token a verified token attends to (a step's verified
    tokens times its mean KV length per sequence), seconds. 0: context is free until timings
    that carry it (or a start-up profile at two context lengths) show otherwise; the prior on it
    is independent of the other weights, so steps reported without context never move it."""
    strength_steps: float = tunable(20.0, gt=0)
    """Weight of the cost prior's shape (how a step's price moves with its sequences, tokens
    and draft work), in equivalent observed steps spread over every batch bucket and K; its
    level is held by a tenth of a step, so the first live steps set it. Not lighter: the
    start-up profile's speculative points are low (see ``profile_weight_steps``), and at 0.5
    the fit followed them: on the real CPU engine specpilot priced K=2-4 at batch 32 as a
    1.4-2x speedup where no speculation was best (0.93 of draft:2p against 1.03 at 20),
    although the simulator, whose profile is exact, gained 1.1%."""
    noise_seconds: float = tunable(1e-3, gt=0)
    """Prior standard deviation of one step's time around the model, seconds (held as two
    virtual reports; the residuals of the observed reports take over)."""
    profile_weight_steps: float = tunable(1.0, ge=0)
    """Weight of each point of an engine's start-up step profile, in equivalent observed steps
    (forgotten like live timings); 0 = profiles ignored. The points tell the shape of the step
    costs, not their level (taken about their mean): the dummy steps lack a served engine's
    per-step overhead. One step a point outweighs the generic
    prior where nothing was observed, and lets the live timings take over within a report
    where the engine runs: the profile times the forward passes and the sampling but not a
    speculative step's input preparation, so its speculative points are low (at 10 a point
    the one-step-ahead predictions above batch 8 stayed 16-22% low on the demo's engine)."""
    profile_center_steps: float = tunable(200.0, ge=0)
    """Weight of each start-up profile point in the fit the prior is centred on, in equivalent
    prior steps; 0 = the prior stays generic. The prior keeps its ``strength_steps``, but its
    virtual steps are placed on the fit of the generic prior plus the profile at this weight, so
    shapes nothing was observed at are priced from this hardware (the generic prior priced K=8 at
    batch 16 as 43 ms against 73 in the simulator, no speculation at batch 32 as 14.7 against
    11.8), while the profile itself stays a light observation (``profile_weight_steps``) that
    live timings override where the engine runs. Against 0, on the real CPU engine the steps
    priced within 10% one step ahead went from 27% to 89%, and the simulator suite from 0.975 to
    0.985 of the oracle (0.983 at 20 a point)."""
    sample_scale: float = tunable(0.5, ge=0)
    """Scale of the posterior cost draw each decide round prices its sampled goodput with
    (1 = the posterior; 0 = decide on mean costs, no exploration over cost)."""


@dataclass(frozen=True, eq=False)
class CostEvidence:
    """Step-timing evidence of a cost model, in information form: ``information`` =
    sum w x x^T and ``weighted_times`` = sum w x t over observed steps (w steps of features x and
    mean time t), ``squared_times`` = sum w t^2 (seconds^2), ``reports`` and ``steps`` the
    counts. Columns: ``StepColumns(knots, drafts)``."""

    drafts: tuple[str, ...]
    knots: tuple[int, ...]
    information: FloatArray
    weighted_times: FloatArray
    squared_times: float
    reports: float
    steps: float

    def __post_init__(self) -> None:
        n = StepColumns(self.knots, self.drafts).size
        if self.information.shape != (n, n) or self.weighted_times.shape != (n,):
            raise ValueError(f"cost evidence: expected a {n}x{n} information matrix and {n} "
                             f"weighted times for {len(self.knots)} knots and "
                             f"{len(self.drafts)} drafts, got {self.information.shape} and "
                             f"{self.weighted_times.shape}")
        if len(set(self.drafts)) != len(self.drafts):
            raise ValueError(f"cost evidence: drafts repeat: {self.drafts}")
        scalars = np.array([self.squared_times, self.reports, self.steps])
        if not (np.isfinite(self.information).all() and np.isfinite(self.weighted_times).all()
                and np.isfinite(scalars).all()):
            raise ValueError("cost evidence: numbers must be finite")
        if scalars.min() < 0 or np.diag(self.information).min(initial=0.0) < 0:
            raise ValueError("cost evidence: squared times, reports, steps and the information "
                             "matrix's diagonal must be >= 0")
        if not np.allclose(self.information, self.information.T, rtol=1e-9, atol=0.0):
            raise ValueError("cost evidence: the information matrix must be symmetric")

    def plus(self, other: CostEvidence) -> CostEvidence:
        """The sum of two evidences with the same columns."""
        if (other.drafts, other.knots) != (self.drafts, self.knots):
            raise ValueError("cost evidence: columns differ")
        return CostEvidence(self.drafts, self.knots, self.information + other.information,
                            self.weighted_times + other.weighted_times,
                            self.squared_times + other.squared_times,
                            self.reports + other.reports, self.steps + other.steps)

    def aligned(self, drafts: Sequence[str], knots: Sequence[int]) -> CostEvidence | None:
        """The same evidence with its draft columns in ``drafts`` order; None when the knots or
        the set of drafts differ (another engine type's, or another configuration's)."""
        if tuple(knots) != self.knots or sorted(drafts) != sorted(self.drafts):
            return None
        columns = StepColumns(self.knots, self.drafts)
        order = list(range(columns.n_target))
        for d in drafts:
            order.extend(columns.draft_columns(columns.index[d]))
        idx = np.asarray(order)
        return CostEvidence(tuple(drafts), self.knots, self.information[np.ix_(idx, idx)],
                            self.weighted_times[idx], self.squared_times, self.reports,
                            self.steps)


class _Sums:
    """A cost model's evidence, mutable (what ``CostEvidence`` records, unchecked: it
    only ever holds what ``observe`` added or a checked record brought)."""

    def __init__(self, n: int) -> None:
        self.a = np.zeros((n, n))
        self.b = np.zeros(n)
        self.yy = 0.0  # steps-weighted squared mean step times (the noise level)
        self.reports = 0.0
        self.steps = 0.0

    def scale(self, f: float) -> None:
        self.a *= f
        self.b *= f
        self.yy *= f
        self.reports *= f
        self.steps *= f

    def forget_along(self, x: FloatArray, fraction: float) -> None:
        """Forget ``fraction`` of what the evidence knows of the step time at features ``x``
        (x^T theta), and only that: un-observe c = fraction / (x^T A^+ x) steps of shape x at
        the evidence's own fit there, so the information on x^T theta falls to (1 - fraction)
        of itself while the fit, its squared residuals and what other shapes' steps measured
        stay (the counts too: the residuals' mean square is the noise, not recency). A shape
        the evidence knows nothing of forgets nothing."""
        if fraction <= 0.0:
            return
        diag = np.diag(self.a)
        if np.any((diag <= 0.0) & (x != 0.0)):
            return  # a feature no step measured: nothing is known of x^T theta yet
        # A^+ through the unit-diagonal scaling (features run from 1 to millions of tokens).
        d = np.where(diag > 0.0, 1.0 / np.sqrt(np.where(diag > 0.0, diag, 1.0)), 0.0)
        scaled = self.a * d[:, None] * d[None, :] + _FORGET_RIDGE * np.eye(d.size)
        y = np.linalg.solve(scaled, d * x)
        s = float((d * x) @ y)  # x^T A^+ x: the variance of the evidence's fit at x, per step
        if not s > 0.0:
            return
        fit_at_x = float(y @ (d * self.b))  # x^T A^+ b
        c = fraction / s
        self.a -= c * np.outer(x, x)
        self.b -= (c * fit_at_x) * x
        self.yy = max(self.yy - c * fit_at_x * fit_at_x, 0.0)

    def add_point(self, x: FloatArray, seconds: float, steps: float) -> None:
        self.a += steps * np.outer(x, x)
        self.b += steps * x * seconds
        self.yy += steps * seconds**2
        self.reports += 1.0
        self.steps += steps

    def add(self, ev: CostEvidence) -> None:
        m = ev.weighted_times.size
        self.a[:m, :m] += ev.information
        self.b[:m] += ev.weighted_times
        self.yy += ev.squared_times
        self.reports += ev.reports
        self.steps += ev.steps

    def grow(self, n: int) -> None:
        """Zero columns for drafts added since."""
        m = self.b.size
        a, b = np.zeros((n, n)), np.zeros(n)
        a[:m, :m], b[:m] = self.a, self.b
        self.a, self.b = a, b

    def drop(self, columns: Sequence[int]) -> None:
        """Remove ``columns`` (a forgotten draft's): its steps' other features stay."""
        keep = np.setdiff1d(np.arange(self.b.size), np.asarray(columns, dtype=np.int64))
        self.a, self.b = self.a[np.ix_(keep, keep)], self.b[keep]

    def plus(self, other: _Sums) -> _Sums:
        out = _Sums(self.b.size)
        out.a, out.b = self.a + other.a, self.b + other.b
        out.yy, out.reports = self.yy + other.yy, self.reports + other.reports
        out.steps = self.steps + other.steps
        return out

    def record(self, drafts: tuple[str, ...], knots: tuple[int, ...]) -> CostEvidence:
        return CostEvidence(drafts, knots, self.a.copy(), self.b.copy(), self.yy,
                            self.reports, self.steps)


@dataclass(frozen=True)
class StepShape:
    """Mean shape of a step: what the model predicts seconds for."""

    batch_size: float
    verified_tokens: float
    draft: str = ""
    draft_passes: float = 0.0
    draft_tokens: float = 0.0
    context_tokens: float = 0.0  # mean KV length per sequence before the step; 0: unknown
    prefill_tokens: float = 0.0  # prompt tokens prefilled beside the decoding

    @classmethod
    def for_arm(cls, batch_size: int, k: int, draft: str, draft_is_model: bool,
                sunk_draft: SunkDraft | None = None, context_tokens: float = 0.0) -> StepShape:
        """A step in which every one of ``batch_size`` sequences verifies K drafts of ``draft``,
        each over ``context_tokens`` of context.

        ``sunk_draft`` (name, passes): a model drafter that runs every step whatever K is chosen
        (an engine in per-request K mode only cuts drafts after drafting them).
        """
        tokens = batch_size * (1 + k)
        if sunk_draft is not None:
            name, passes = sunk_draft
            return cls(batch_size, tokens, name, passes, batch_size * passes, context_tokens)
        if k == 0 or not draft_is_model:
            return cls(batch_size, tokens, context_tokens=context_tokens)
        return cls(batch_size, tokens, draft, k, batch_size * k, context_tokens)


@dataclass(frozen=True)
class Extent:
    """How far the shapes a cost model timed itself (start-up profile and live steps) reach: the
    largest batch size, sequences, and the most verified tokens of a step."""

    batch_size: float
    tokens: float

    def including(self, shape: StepShape) -> Extent:
        return Extent(max(self.batch_size, shape.batch_size),
                      max(self.tokens, shape.verified_tokens))


def nearest_satisfying(theta: FloatArray, rows: FloatArray, spread: FloatArray) -> FloatArray:
    """The weights w nearest ``theta`` in the metric P (the posterior's precision) with
    ``rows`` @ w >= 0, by active sets: ``spread`` is P^-1 rows^T. Each pass enforces the most
    violated row as an equality, w = theta + spread_W nu with nu >= 0 the multipliers (a row
    whose multiplier turns negative is released); a handful of rows, so a few passes."""
    active: list[int] = []
    w = theta
    for _ in range(4 * len(rows) + 1):
        if active:
            gram = rows[active] @ spread[:, active]
            nu = -np.linalg.lstsq(gram, rows[active] @ theta, rcond=None)[0]
            if float(nu.min()) < 0.0:
                active.pop(int(np.argmin(nu)))
                continue
            w = theta + spread[:, active] @ nu
        else:
            w = theta
        values = rows @ w
        worst = int(np.argmin(values))
        if values[worst] >= -_PHYSICAL_SLACK or worst in active:
            break
        active.append(worst)
    return np.asarray(w, dtype=np.float64)


class PricedCosts:
    """Step-time predictions under one weight vector (the posterior mean, or one draw of it),
    with the curve cache of that vector: the policy asks for the same few curves for every class,
    so one set of weights serves a whole decide round."""

    def __init__(self, model: StepCostModel, theta: FloatArray,
                 extent: Extent | None = None) -> None:
        self._model = model
        self.theta = theta
        # What the model timed: beyond it, shapes are priced from its edge (``_from_edge``).
        self.extent = extent
        self._curve_cache: dict[tuple[int, str, int, SunkDraft | None, float], FloatArray] = {}
        self._arrays: PricingArrays | None = None

    def _fit(self, shape: StepShape) -> float:
        return max(float(self._model.features(shape) @ self.theta), MIN_STEP_SECONDS)

    def _from_edge(self, batch_size: float, tokens: FloatArray,
                   fit: Callable[[float, FloatArray], FloatArray]) -> FloatArray:
        """Seconds of steps of ``batch_size`` sequences verifying ``tokens`` (one entry each),
        ``fit(batch, tokens)`` giving the fit's: the fit inside the extent; beyond it, priced on
        from its edge. A larger batch goes on from the largest one timed at the same tokens per
        sequence, at the mean price of one more such sequence over the batch sizes timed; more
        tokens than any step verified go on at the edge's mean price per token above a plain
        step. Means, not the last segment's slopes, which the fit's hinges bend either way; at
        least 0: continuous at the edge, and never cheaper than it."""
        ext = self.extent
        if ext is None or (batch_size <= ext.batch_size and tokens.max() <= ext.tokens):
            return fit(batch_size, tokens)
        per_sequence = tokens / batch_size
        b = min(batch_size, ext.batch_size)

        def at(batch: float) -> FloatArray:
            """The price at ``batch`` <= the edge batch, of the same tokens per sequence."""
            want = per_sequence * batch
            t = np.minimum(want, ext.tokens)
            edge = fit(batch, t)
            plain = np.full_like(t, batch)
            mean = (edge - fit(batch, plain)) / np.maximum(t - plain, 1.0)
            last = edge - fit(batch, t - 1.0)
            slope = np.maximum(np.where(t > plain, mean, last), 0.0)
            return np.asarray(edge + slope * (want - t), dtype=np.float64)

        priced = at(b)
        if batch_size > b:
            # One more sequence at the mean price of one over the batch sizes timed (from one
            # sequence up), as with tokens: the last one alone follows the fit's bends.
            low = 1.0 if b > 1.0 else 0.0
            per_sequence_price = (priced - at(low)) / (b - low)
            priced = priced + np.maximum(per_sequence_price, 0.0) * (batch_size - b)
        inside = (batch_size <= ext.batch_size) & (tokens <= ext.tokens)
        return np.asarray(np.where(inside, fit(batch_size, tokens), priced), dtype=np.float64)

    def predict(self, shape: StepShape) -> float:
        def fit(b: float, t: FloatArray) -> FloatArray:
            return np.array([self._fit(replace(shape, batch_size=b, verified_tokens=float(x)))
                             for x in t])

        return float(self._from_edge(shape.batch_size, np.array([shape.verified_tokens]),
                                     fit)[0])

    def predict_mixed(self, batch_size: float, verified_tokens: npt.ArrayLike,
                      drafting: dict[str, FloatArray], passes: dict[str, FloatArray],
                      draft_tokens: dict[str, FloatArray], *,
                      context_tokens: float | None = None) -> FloatArray:
        """Step seconds of mixed steps, one per entry of ``verified_tokens``; ``drafting``,
        ``passes`` and ``draft_tokens`` give each model draft's chance of running at all, its
        (expected) passes and its proposed tokens per entry. Drafts without a cost column
        (n-gram, unknown) cost nothing. ``context_tokens`` per sequence; None: the context
        steps of this batch size run at (``StepCostModel.context_at``)."""
        if self._arrays is None:
            self._arrays = self._model.columns.arrays(self.theta)
        if context_tokens is None:
            context_tokens = self._model.context_at(batch_size)
        arrays, context = self._arrays, context_tokens

        def fit(b: float, t: FloatArray) -> FloatArray:
            return arrays.seconds_by_name(b, t, passes, draft_tokens, drafting, context)

        return self._from_edge(batch_size, np.asarray(verified_tokens, dtype=np.float64), fit)

    def predict_arm(self, batch_size: int, k: int, draft: str, draft_is_model: bool,
                    sunk_draft: SunkDraft | None = None,
                    context_tokens: float | None = None) -> float:
        return float(self.predict_curve(batch_size, draft, draft_is_model, k, sunk_draft,
                                        context_tokens)[k])

    def pricing(self) -> StepPricing:
        """These weights as plain coefficients (what an engine prices its steps with:
        ``specpilot.contract.pricing``)."""
        return self._model.columns.pricing(self.theta)

    def predict_curve(self, batch_size: int, draft: str, draft_is_model: bool, max_k: int,
                      sunk_draft: SunkDraft | None = None,
                      context_tokens: float | None = None) -> FloatArray:
        """Step seconds for K = 0..max_k with ``draft`` at ``batch_size`` (read-only array),
        each sequence over ``context_tokens`` (None: ``StepCostModel.context_at``)."""
        context = (self._model.context_at(batch_size) if context_tokens is None
                   else context_tokens)
        key = (batch_size, draft if draft_is_model else "", max_k, sunk_draft, context)
        curve = self._curve_cache.get(key)
        if curve is None:
            shapes = [StepShape.for_arm(batch_size, k, draft, draft_is_model, sunk_draft, context)
                      for k in range(max_k + 1)]

            def fit(b: float, t: FloatArray) -> FloatArray:
                return np.array([self._fit(replace(sh, batch_size=b, verified_tokens=float(x)))
                                 for sh, x in zip(shapes, t, strict=True)])

            seconds = self._from_edge(batch_size,
                                      np.array([sh.verified_tokens for sh in shapes]), fit)
            # More verified tokens never make a step faster: the running maximum keeps a noisy
            # fit (or a draw) from rewarding longer drafts with cheaper steps.
            curve = np.maximum.accumulate(np.maximum(seconds, MIN_STEP_SECONDS))
            curve.setflags(write=False)
            self._curve_cache[key] = curve
        return curve


@dataclass
class CostChangeTest:
    """A two-sided CUSUM of observations' log ratios to their prediction, in steps: ``observe``
    says when the engine's step costs have changed (the sums pass ``threshold_steps``), and
    restarts. Deviations within ``tolerance`` (the fit's own error) never add up. Tested only
    once the model holds ``threshold_steps`` of its own evidence: before, predictions are the
    prior's, and being wrong is what they are for."""

    tolerance: float
    threshold_steps: float
    up: float = 0.0
    down: float = 0.0

    def observe(self, log_ratio: float, steps: float) -> bool:
        self.up = max(0.0, self.up + steps * (log_ratio - self.tolerance))
        self.down = max(0.0, self.down + steps * (-log_ratio - self.tolerance))
        if max(self.up, self.down) <= self.threshold_steps:
            return False
        self.up = self.down = 0.0
        return True


class StepCostModel:
    def __init__(
        self,
        knots: Sequence[int],
        prior: CostPrior,
        half_life_steps: float,
        design_batch_sizes: Sequence[int],
        design_max_k: int,
        context_at: Callable[[float], float] | None = None,
        change_test: CostChangeTest | None = None,
    ) -> None:
        if prior.ridge_tokens not in knots:
            raise ValueError("prior ridge_tokens must be one of the knots")
        self.prior = prior
        # The mean context per sequence steps of a batch size run at (what arms are priced at
        # unless a call names one); None: 0, context unpriced.
        self.context_at: Callable[[float], float] = context_at or (lambda _batch: 0.0)
        self.half_life_steps = half_life_steps
        # None: no change test (the evidence follows drift by directional forgetting alone).
        self.change_test = change_test
        self._design_batch_sizes = list(design_batch_sizes)
        self._design_max_k = design_max_k
        # The weights' columns; model drafts get their own as engines announce them.
        self.columns = StepColumns(knots, ())
        self._own = _Sums(self.n_features)  # this model's observations
        self._fleet = _Sums(self.n_features)  # the other sidecars' (set_fleet)
        self._mean: PricedCosts | None = None
        self._factored: tuple[FloatArray, FloatArray] | None = None
        self._spread_cache: dict[tuple[object, ...], FloatArray] = {}
        self._extent: Extent | None = None  # what this model's own observations reached
        self._ratio_range: tuple[float, float] | None = None
        self._profile: tuple[tuple[StepShape, float], ...] = ()  # (shape, seconds): set_profile
        self._rebuild_prior()

    # --- features ---------------------------------------------------------------------------
    @property
    def n_features(self) -> int:
        return self.columns.size

    @property
    def drafts(self) -> tuple[str, ...]:
        """Model drafts with cost columns, in column order."""
        return self.columns.drafts

    def features(self, shape: StepShape) -> FloatArray:
        return self.columns.features(shape.batch_size, shape.verified_tokens, shape.draft,
                                     shape.draft_passes, shape.draft_tokens,
                                     shape.context_tokens, shape.prefill_tokens)

    def _prior_theta(self) -> FloatArray:
        p = self.prior
        above = [0.0] * len(self.knot_tokens)
        above[self.knot_tokens.index(p.ridge_tokens)] = p.seconds_per_token_above_ridge
        draft = DraftPricing(p.draft_seconds_fixed, p.draft_seconds_per_pass,
                             p.draft_seconds_per_token)
        # Prefill is compute-bound: a prompt token is priced as a verified token above the
        # ridge. A speculating sequence starts at nothing; the profile and live steps price it.
        return self.columns.weights(p.base_seconds, 0.0, p.seconds_per_token, above,
                                    dict.fromkeys(self.drafts, draft),
                                    p.seconds_per_context_token, 0.0,
                                    p.seconds_per_token + p.seconds_per_token_above_ridge)

    def _rebuild_prior(self) -> None:
        """Prior information = ``strength_steps`` virtual steps spread over a design of shapes."""
        shapes = [
            StepShape.for_arm(b, k, d, True)
            for b in self._design_batch_sizes
            for k in range(self._design_max_k + 1)
            for d in (self.drafts or ("",))
        ]
        xs = np.array([self.features(s) for s in shapes])
        w = self.prior.strength_steps / len(shapes)
        # The context column's prior is its own (the design's shapes read it at
        # _PRIOR_CONTEXT_TOKENS, uncoupled from the other weights): a step reported without
        # context (feature 0) then never moves it through the prior's correlations.
        xs[:, CONTEXT_COLUMN] = _PRIOR_CONTEXT_TOKENS * xs[:, 2]
        scale = np.maximum(np.abs(xs).max(axis=0), 1.0)
        context = xs[:, CONTEXT_COLUMN].copy()
        xs[:, CONTEXT_COLUMN] = 0.0
        # What the prior holds of step costs is their shape: how a step's price moves with its
        # sequences, tokens and draft work, each design shape's virtual steps about their mean
        # shape (``strength_steps`` in all). Of their level it holds only
        # ``_PRIOR_LEVEL_STEPS`` virtual steps at that mean shape: a served engine's steps cost
        # a per-step overhead (its server, sampler and scheduler) that neither the generic
        # prior nor a start-up profile's dummy steps carry, and held as firmly as the shape
        # the levels of the large batch sizes nothing has run yet stayed at the profile's while
        # batch-1 evidence lifted the small ones: a plain step priced cheaper at batch 32 than
        # at batch 1, and speculation free at the start of every burst.
        mean = xs.mean(axis=0)
        centred = xs - mean
        self._prior_a = (w * centred.T @ centred + _PRIOR_LEVEL_STEPS * np.outer(mean, mean)
                         + _RIDGE * np.diag(scale**2))
        self._prior_a[CONTEXT_COLUMN, CONTEXT_COLUMN] += w * float(context @ context)
        # The prefill column's prior is its own too (no design shape prefills).
        self._prior_a[PREFILL_COLUMN, PREFILL_COLUMN] += (
            _PRIOR_PREFILL_STEPS * _PRIOR_PREFILL_TOKENS**2)
        # In a step that verifies every token it drafted (every arm) a verified token and a
        # drafted one come together, so their split, and the per-sequence weight with it, is in
        # no such step's time: it is the prior's, held as firmly as the prior holds the rest,
        # until steps whose drafts are cut (fewer verified than drafted) separate them. Left to
        # the ridge it wandered to opposite signs that priced a verification slot below nothing.
        for i in range(len(self.drafts)):
            col = self.columns.draft_columns(i)[2]
            self._prior_a[col, col] += w * float(xs[:, col] @ xs[:, col])
        self._prior_b = self._prior_a @ self._prior_centre()
        self._invalidate()

    def _prior_centre(self) -> FloatArray:
        """The weights the prior's virtual steps are placed on: the generic prior's, or, with a
        start-up profile, the fit of the generic prior plus the profile's points at
        ``profile_center_steps`` each (directions the profile does not identify, such as tokens
        without drafter passes, stay where the generic prior puts them). Points timing a draft
        without cost columns are left out: their passes would be priced as the target's."""
        theta = self._prior_theta()
        points = [(sh, t) for sh, t in self._profile
                  if not sh.draft_passes or sh.draft in self.columns.index]
        w = self.prior.profile_center_steps
        if not points or w <= 0:
            return theta
        xs = np.array([self.features(sh) for sh, _ in points])
        times = np.array([t for _, t in points])
        a = self._prior_a + w * xs.T @ xs
        b = self._prior_a @ theta + w * xs.T @ times
        return np.asarray(np.linalg.solve(a, b), dtype=np.float64)

    def set_profile(self, points: Sequence[tuple[StepShape, float]]) -> None:
        """An engine's start-up step profile (shape, fastest step seconds) that the prior is
        centred on (``profile_center_steps``), replacing the previous engine's; kept so the
        centre follows when draft columns come and go. An empty profile leaves the prior
        generic."""
        self._profile = tuple(points)
        self._rebuild_prior()

    def _invalidate(self) -> None:
        self._mean = None
        self._factored = None
        self._spread_cache.clear()

    @property
    def knot_tokens(self) -> tuple[int, ...]:
        return tuple(int(k) for k in self.columns.knots)

    def ensure_drafts(self, model_drafts: Iterable[str]) -> None:
        """Add cost columns for model drafts not seen before; evidence so far is kept."""
        new = [d for d in dict.fromkeys(model_drafts) if d not in self.columns.index]
        if not new:
            return
        self.columns = StepColumns(self.knot_tokens, (*self.drafts, *new))
        self._own.grow(self.n_features)
        self._fleet.grow(self.n_features)
        self._rebuild_prior()

    def forget_drafts(self, model_drafts: Iterable[str]) -> None:
        """Remove the cost columns of ``model_drafts`` (drafts no engine announces any more), so
        the columns, and the prior that grows with their square, stay bounded across engines
        that come and go with new draft names. Their steps' evidence on the target's terms is
        kept."""
        gone = [d for d in model_drafts if d in self.columns.index]
        if not gone:
            return
        columns = [c for d in gone for c in self.columns.draft_columns(self.columns.index[d])]
        self._own.drop(columns)
        self._fleet.drop(columns)
        self.columns = StepColumns(self.knot_tokens, [d for d in self.drafts if d not in gone])
        self._rebuild_prior()

    # --- fitting ----------------------------------------------------------------------------
    def observe_profile(self, points: Sequence[tuple[StepShape, float]], steps: float) -> None:
        """An engine's start-up profile as observed steps, ``steps`` a point: what it says of
        how the step cost moves between its shapes, not of its level (its points taken about
        their mean, as a fit with a level of its own would read them). The dummy steps lack the
        served engine's per-step overhead, and their level, observed as is, bent the fit to a
        plain step cheaper at a large batch than at batch 1 once live steps of one batch size
        set theirs. Never tested for a change."""
        if not points or steps <= 0:
            return
        xs = np.array([self.features(sh) for sh, _ in points])
        times = np.array([t for _, t in points])
        xc, tc = xs - xs.mean(axis=0), times - times.mean()
        self._own.a += steps * xc.T @ xc
        self._own.b += steps * xc.T @ tc
        self._own.yy += steps * float(tc @ tc)
        self._own.reports += len(points)
        self._own.steps += steps * len(points)
        self._invalidate()
        for shape, seconds in points:
            self._note_timed(shape, seconds)
        # Each point's ratio was priced (and the prices cached) before the later points
        # widened the extent: price afresh within the whole profile's.
        self._invalidate()

    def _note_timed(self, shape: StepShape, seconds: float) -> None:
        """Widen what the model timed (``Extent``) and the ratios of speculative steps it saw
        (``measured_ratio_range``) by a timed shape."""
        if speculates(shape.batch_size, shape.verified_tokens) or shape.draft_passes > 0:
            plain = self.predict(StepShape(shape.batch_size, shape.batch_size,
                                           context_tokens=shape.context_tokens,
                                           prefill_tokens=shape.prefill_tokens))
            ratio = seconds / plain
            lo, hi = self._ratio_range or (ratio, ratio)
            self._ratio_range = (min(lo, ratio), max(hi, ratio))
        self._extent = (Extent(shape.batch_size, shape.verified_tokens) if self._extent is None
                        else self._extent.including(shape))

    def observe(self, shape: StepShape, mean_step_seconds: float, steps: float,
                predicted: float | None = None) -> bool:
        """Add ``steps`` steps of this mean shape whose mean wall time was ``mean_step_seconds``,
        forgetting along its features first; True when the change test fired on it (most of the
        evidence was then forgotten). ``predicted``: what the model predicted for the shape
        before the report it came in (None: now)."""
        x = self.features(shape)
        changed = False
        if (self.change_test is not None
                and self._own.steps >= self.change_test.threshold_steps):
            before = self.predict(shape) if predicted is None else predicted
            ratio = mean_step_seconds / max(before, MIN_STEP_SECONDS)
            if ratio > 0 and self.change_test.observe(float(np.log(ratio)), steps):
                self._own.scale(_FORGET_ON_CHANGE)
                self._ratio_range = None
                changed = True
        self._own.forget_along(x, 1.0 - 2.0 ** (-steps / self.half_life_steps))
        self._note_timed(shape, mean_step_seconds)
        self._own.add_point(x, mean_step_seconds, steps)
        self._invalidate()
        return changed

    @property
    def measured_ratio_range(self) -> tuple[float, float] | None:
        """The smallest and largest ratio of a timed speculative step's seconds to those of a
        step without speculation at its batch size and context (by the fit when it was timed):
        the range a speculative step's price was seen in; None before any was timed. Start-up
        profile points count; evidence taken from the fleet or restored after a restart does
        not (nor does it widen the ``Extent``)."""
        return self._ratio_range

    @property
    def observed_steps(self) -> float:
        """This model's own observed steps (0 before any data; a detected change forgets most)."""
        return self._own.steps

    # --- sharing (specpilot.controller.core.fleet) ------------------------------------------------
    def export(self) -> CostEvidence:
        """This model's own evidence (never the fleet's)."""
        return self._own.record(self.drafts, self.knot_tokens)

    def restore(self, evidence: CostEvidence) -> bool:
        """Take back this model's own evidence (its last flush before a restart: the hardware's
        step costs, as valid as they were); False when its columns are not this model's."""
        ev = evidence.aligned(self.drafts, self.knot_tokens)
        if ev is None:
            return False
        self._own.add(ev)
        self._invalidate()
        return True

    def set_fleet(self, evidence: CostEvidence | None) -> None:
        """The other sidecars' evidence with this model's columns (``CostEvidence.aligned``),
        replacing the previous fleet view; None forgets it."""
        self._fleet = _Sums(self.n_features)
        if evidence is not None:
            self._fleet.add(evidence)
        self._invalidate()

    def _evidence(self) -> _Sums:
        return self._own.plus(self._fleet)

    def _factor(self) -> tuple[FloatArray, FloatArray]:
        """The precision P = D^-1 L L^T D^-1: the Cholesky factor L of P scaled to a unit
        diagonal (D = diag(P)^-1/2), and the diagonal of D. Features run from 1 (the base) to
        millions of tokens and evidence weighs up to 10^12 steps: unscaled, P's condition number
        passed 10^16 at the largest plausible shapes and every decide round failed to factorize
        it. Hinge columns are nearly collinear far above the knots; then a jitter keeps the
        scaled P positive definite. Kept until the next observation."""
        if self._factored is not None:
            return self._factored
        p = self._precision()
        d = np.asarray(1.0 / np.sqrt(np.diag(p)), dtype=np.float64)
        scaled = p * d[:, None] * d[None, :]
        try:
            chol = np.linalg.cholesky(scaled)
        except np.linalg.LinAlgError:
            chol = np.linalg.cholesky(scaled + _JITTER * np.eye(d.size))
        self._factored = np.asarray(chol, dtype=np.float64), d
        return self._factored

    @property
    def mean(self) -> PricedCosts:
        """Predictions by the posterior mean weights, made physical (``_physical``; cached
        until the next observation)."""
        if self._mean is None:
            evidence = self._evidence()
            self._mean = PricedCosts(
                self, self._physical(self._free_mean(evidence), evidence), self._extent)
        return self._mean

    def _measured_knots(self, evidence: _Sums) -> int:
        """How many of the knots (from the first) some step of the evidence, own and the
        fleet's, passed: its information on their hinge columns is not zero."""
        hinges = np.diag(evidence.a)[TARGET_COLUMNS : self.columns.n_target] > 0.0
        return int(np.flatnonzero(hinges).max() + 1) if hinges.any() else 0

    def _free_mean(self, evidence: _Sums) -> FloatArray:
        """The posterior mean of the weights given ``evidence`` (own and the fleet's),
        unconstrained."""
        chol, d = self._factor()
        y = np.linalg.solve(chol, d * (self._prior_b + evidence.b))
        return np.asarray(d * np.linalg.solve(chol.T, y), dtype=np.float64)

    def _physical(self, theta: FloatArray, evidence: _Sums) -> FloatArray:
        """``theta`` if it prices every step physically (``StepColumns.physical_rows``), else
        the nearest weights that do in the posterior's own metric (the precision): a fit of a
        few shapes can bend a hinge or the speculating column below zero where nothing pins
        them, and priced by such weights a longer draft costs less than a shorter one; the
        running maximum of the curves then priced every K as no speculation (speculation free
        at the peak)."""
        rows = self.columns.physical_rows(self._measured_knots(evidence))
        if float((rows @ theta).min()) >= -_PHYSICAL_SLACK:
            return theta
        chol, d = self._factor()
        # P^-1 A^T, with P = D^-1 L L^T D^-1: one pair of triangular solves for all the rows.
        spread = d[:, None] * np.linalg.solve(chol.T, np.linalg.solve(chol, d[:, None] * rows.T))
        return nearest_satisfying(theta, rows, spread)

    @property
    def theta(self) -> FloatArray:
        return self.mean.theta

    def _precision(self) -> FloatArray:
        return np.asarray(self._prior_a + self._evidence().a, dtype=np.float64)

    def noise_variance(self) -> float:
        """Variance of one step's time around the fit, seconds^2: the prior level blended with
        the reports' steps-weighted squared residuals. Per report, not per step: a report's mean
        over n steps weighs n, so its weighted squared residual estimates one step's variance
        (and a misfit or correlated noise shows up instead of averaging away)."""
        th = self.theta
        ev = self._evidence()
        residual = max(float(ev.yy - 2.0 * th @ ev.b + th @ ev.a @ th), 0.0)
        prior = _NOISE_PRIOR_REPORTS * self.prior.noise_seconds**2
        return (prior + residual) / (_NOISE_PRIOR_REPORTS + ev.reports)

    def draw(self, rng: np.random.Generator) -> PricedCosts:
        """Predictions by one draw of the weights from their posterior, N(mean, s^2 sigma^2
        precision^-1) with s = ``sample_scale``: one Cholesky factor of the precision. Where no
        step was observed the prior's spread remains, so an arm priced by extrapolation is
        sometimes priced cheap enough to be tried (and so corrected). An engine's start-up
        profile enters as observed steps, so the shapes it timed are not explored this way."""
        scale = self.prior.sample_scale * float(np.sqrt(self.noise_variance()))
        if scale == 0.0:
            return self.mean
        chol, d = self._factor()
        # precision = D^-1 L L^T D^-1  ->  D L^-T z ~ N(0, precision^-1)
        u = d * np.linalg.solve(chol.T, rng.standard_normal(self.n_features))
        return PricedCosts(self, self.mean.theta + scale * u, self._extent)

    def arm_spread(self, batch_size: int, drafts: Sequence[DraftSpec], max_k: int,
                   sunk_draft: SunkDraft | None = None) -> FloatArray:
        """The relative posterior covariance, Cov(t_a, t_b) / (t_a t_b), of the step seconds of
        every arm of ``drafts`` at ``batch_size`` (off, then each draft's K = 1..max, every
        sequence on the arm, at the context steps of this batch size run at): how well the
        model knows what each arm costs, and how alike its errors are (cached until the next
        observation)."""
        context = self.context_at(batch_size)
        key = (batch_size, tuple((d.name, d.pass_draft, min(max_k, d.max_k)) for d in drafts),
               sunk_draft, context)
        spread = self._spread_cache.get(key)
        if spread is None:
            shapes = [StepShape.for_arm(batch_size, 0, "", False, sunk_draft, context)]
            for d in drafts:
                shapes.extend(StepShape.for_arm(batch_size, k, d.pass_draft, bool(d.pass_draft),
                                                sunk_draft, context)
                              for k in range(1, min(max_k, d.max_k) + 1))
            xs = np.array([self.features(sh) for sh in shapes])
            fit = np.maximum(xs @ self.theta, MIN_STEP_SECONDS)
            spread = self.covariance(shapes) / np.outer(fit, fit)
            spread.setflags(write=False)
            self._spread_cache[key] = spread
        return spread

    def covariance(self, shapes: Sequence[StepShape]) -> FloatArray:
        """The posterior covariance of the fit's step seconds at ``shapes`` (seconds^2, a row
        and a column per shape): sigma^2 X precision^-1 X^T, sigma^2 the noise variance. How
        well the model knows what a shape costs: wide where nothing near it was timed."""
        chol, d = self._factor()
        xs = np.array([self.features(s) for s in shapes]).reshape(len(shapes), self.n_features)
        # precision^-1 = D L^-T L^-1 D  ->  X precision^-1 X^T = (L^-1 D X^T)^T (L^-1 D X^T)
        v = np.linalg.solve(chol, d[:, None] * xs.T)
        return np.asarray(self.noise_variance() * (v.T @ v), dtype=np.float64)

    def predict(self, shape: StepShape) -> float:
        return self.mean.predict(shape)

    def predict_mixed(self, batch_size: float, verified_tokens: npt.ArrayLike,
                      drafting: dict[str, FloatArray], passes: dict[str, FloatArray],
                      draft_tokens: dict[str, FloatArray], *,
                      context_tokens: float | None = None) -> FloatArray:
        return self.mean.predict_mixed(batch_size, verified_tokens, drafting, passes,
                                       draft_tokens, context_tokens=context_tokens)

    def predict_arm(self, batch_size: int, k: int, draft: str, draft_is_model: bool,
                    sunk_draft: SunkDraft | None = None,
                    context_tokens: float | None = None) -> float:
        return self.mean.predict_arm(batch_size, k, draft, draft_is_model, sunk_draft,
                                     context_tokens)

    def predict_curve(self, batch_size: int, draft: str, draft_is_model: bool, max_k: int,
                      sunk_draft: SunkDraft | None = None,
                      context_tokens: float | None = None) -> FloatArray:
        """Step seconds for K = 0..max_k with ``draft`` at ``batch_size`` by the posterior mean
        (read-only array)."""
        return self.mean.predict_curve(batch_size, draft, draft_is_model, max_k, sunk_draft,
                                       context_tokens)
