"""The traffic mix of a batch, and what the rest of a batch costs and yields while one class picks
its arm.

Why: a model drafter runs as many sequential passes as the largest K any sequence of the step asks
of it, so a pass another class already pays for is nearly free for this class, and a class that
lengthens its drafts slows every other sequence's step too. Scoring a class's arms as if the
batch were all that class (the homogeneous view) misses both. With the mix known, a class's arm is
scored by the whole batch's goodput, the other classes held at their current choices: repeated
every decide round, this is coordinate ascent toward the batch optimum.

The mix comes from what the engine already sends: the verification steps of classes that
speculate, as they happen, and for the others the finished-request summaries (a request decoded
for about ``output_tokens - accepted_tokens`` steps: every step emits its accepted drafts plus
one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from specpilot.contract.records import DraftKind, DraftSpec

FloatArray = npt.NDArray[np.float64]
# (batch_size, verified tokens, per model draft: the chance it drafts at all, its expected passes,
# its draft tokens) -> seconds, one entry per element of the verified-tokens array.
MixedSecondsFn = Callable[[float, FloatArray, dict[str, FloatArray], dict[str, FloatArray],
                           dict[str, FloatArray]], FloatArray]
Arm = tuple[str, int]
# Coordinate-ascent sweeps of the joint search (it stops earlier when no class moves).
_JOINT_SWEEPS = 4
# The joint search's bounds (``joint_arms``): classes it moves (the largest shares), and arms
# it prices per call (~4 us an arm on this CPU: ~40 ms of the loop at most). A search of five
# classes and two drafts prices ~3,000.
JOINT_MAX_FREE = 8
JOINT_ARM_BUDGET = 10_000


class ClassMix:
    """Decayed decode request-steps per class: their shares are the batch mix."""

    def __init__(self, half_life_seconds: float) -> None:
        self.half_life_seconds = half_life_seconds
        self._steps: dict[str, float] = {}
        self._at: float | None = None

    def observe(self, traffic_class: str, request_steps: float, now: float) -> None:
        if self._at is not None and now > self._at:
            f = float(2.0 ** (-(now - self._at) / self.half_life_seconds))
            for name in self._steps:
                self._steps[name] *= f
        self._at = now if self._at is None else max(self._at, now)
        self._steps[traffic_class] = self._steps.get(traffic_class, 0.0) + max(request_steps, 0.0)

    def shares(self) -> dict[str, float]:
        total = sum(self._steps.values())
        return {c: s / total for c, s in self._steps.items()} if total > 0 else {}

    def forget(self, traffic_class: str) -> None:
        self._steps.pop(traffic_class, None)


class ServedSpeedup:
    """Measured speedup per class while it speculates: decayed sums over its served (not
    counterfactual) verification steps of the tokens they emitted (1 + accepted) and of their
    step time relative to a step without speculation at the same batch size (by the cost
    model). tokens / relative time is the measured acceptance priced by the modelled cost,
    beside each decision's expected speedup."""

    def __init__(self, half_life_seconds: float) -> None:
        self.half_life_seconds = half_life_seconds
        self._sums: dict[str, tuple[float, float, float]] = {}  # steps, tokens, relative time
        self._at: dict[str, float] = {}

    def observe(self, traffic_class: str, steps: float, tokens: float, relative_seconds: float,
                now: float) -> None:
        """``relative_seconds``: the steps' summed time, in units of a plain step's."""
        s, t, c = self._sums.get(traffic_class, (0.0, 0.0, 0.0))
        at = self._at.get(traffic_class, now)
        if now > at:
            f = float(2.0 ** (-(now - at) / self.half_life_seconds))
            s, t, c = s * f, t * f, c * f
        self._sums[traffic_class] = (s + steps, t + tokens, c + relative_seconds)
        self._at[traffic_class] = max(at, now)

    def tokens_per_step(self, traffic_class: str) -> float | None:
        s, t, _ = self._sums.get(traffic_class, (0.0, 0.0, 0.0))
        return t / s if s > 0 else None

    def speedup(self, traffic_class: str) -> float | None:
        _, t, c = self._sums.get(traffic_class, (0.0, 0.0, 0.0))
        return t / c if c > 0 else None

    def forget(self, traffic_class: str) -> None:
        self._sums.pop(traffic_class, None)
        self._at.pop(traffic_class, None)


@dataclass(frozen=True)
class OtherClass:
    """Another class in the batch as it runs now."""

    share: float
    # The model draft whose passes its arm runs (its own, or the carrier of a substituted
    # n-gram draft); "" when off or when the arm runs no model passes.
    draft: str
    draft_is_model: bool
    k: int
    expected_tokens: float  # E(K) per step of its sequences under its current arm
    # Drafts a step of its sequences verifies (a deterministic draft's proposals may be
    # shorter than K); None: K.
    verified: float | None = None

    @property
    def verified_drafts(self) -> float:
        return float(self.k) if self.verified is None else self.verified


@dataclass(frozen=True)
class BatchOthers:
    """The expected rest of a batch of ``batch_size`` around one sequence of the class deciding.

    ``self_count`` sequences run the deciding class's arm (this one plus its share of the rest);
    the others contribute fixed tokens, verified tokens and draft tokens, and the model drafts'
    passes as a distribution: with probability ``p`` some other sequence needs ``k`` passes.
    """

    batch_size: int
    self_count: float
    tokens: float
    verified_tokens: float
    draft_tokens: dict[str, float]
    # Per model draft: (passes, probability that the others' largest K for it is exactly that).
    passes: dict[str, tuple[tuple[int, float], ...]]
    _pass_cache: dict[str, tuple[FloatArray, FloatArray, float]] = field(
        default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, batch_size: int, own_share: float, others: Iterable[OtherClass]) -> BatchOthers:
        rest = max(batch_size - 1, 0)
        n_self = 1.0 + own_share * rest
        tokens = verified = 0.0
        draft_tokens: dict[str, float] = {}
        present: dict[str, list[tuple[int, float]]] = {}
        for o in others:
            n = o.share * rest
            tokens += n * o.expected_tokens
            verified += n * (1 + o.verified_drafts)
            if o.k > 0 and o.draft_is_model:
                draft_tokens[o.draft] = draft_tokens.get(o.draft, 0.0) + n * o.k
                # P(at least one of the other sequences is of this class).
                present.setdefault(o.draft, []).append((o.k, 1.0 - (1.0 - o.share) ** rest))
        passes: dict[str, tuple[tuple[int, float], ...]] = {}
        for draft, entries in present.items():
            dist, none = [], 1.0
            for k, p in sorted(entries, reverse=True):
                dist.append((k, none * p))
                none *= 1.0 - p
            passes[draft] = tuple(dist)
        return cls(batch_size, n_self, tokens, verified, draft_tokens, passes)

    def _pass_arrays(self, draft: str) -> tuple[FloatArray, FloatArray, float]:
        """``passes[draft]`` as arrays (K, probability) and their total probability; cached,
        as the policy prices a few hundred arms against one BatchOthers per decide round."""
        cache = self._pass_cache
        got = cache.get(draft)
        if got is None:
            dist = self.passes.get(draft, ())
            ks = np.array([k for k, _ in dist], dtype=np.float64)
            ps = np.array([p for _, p in dist], dtype=np.float64)
            got = cache[draft] = (ks, ps, float(ps.sum()))
        return got

    def expected_passes(self, draft: str, own_k: npt.ArrayLike) -> FloatArray:
        """E[max(own K, the others' largest K)] for ``draft``, per own K."""
        own = np.asarray(own_k, dtype=np.float64)
        ks, ps, some = self._pass_arrays(draft)
        if not ks.size:
            return own.copy()
        out = ps @ np.maximum(own[None, :], ks[:, None])
        return np.asarray(out + max(1.0 - some, 0.0) * own, dtype=np.float64)

    def drafting_probability(self, draft: str, own_k: npt.ArrayLike) -> FloatArray:
        """P(``draft`` runs at all in the step), per own K: 1 where own K > 0."""
        own = np.asarray(own_k, dtype=np.float64)
        others = self._pass_arrays(draft)[2]  # P(some other sequence drafts)
        return np.asarray(np.where(own > 0, 1.0, others), dtype=np.float64)


@dataclass(frozen=True)
class ArmRates:
    """Every arm of one class in a mixed batch: row 0 is off, then each draft's K = 1..max."""

    keys: list[Arm]
    expected_tokens: FloatArray  # E(K) of this class's sequences
    step_seconds: FloatArray
    batch_rate: FloatArray  # tokens per second of the whole batch


def arm_keys(drafts: Sequence[DraftSpec], max_k: int) -> list[Arm]:
    """A class's arms in table order: off, then each draft's K = 1..max."""
    keys: list[Arm] = [("", 0)]
    for spec in drafts:
        keys.extend((spec.name, k) for k in range(1, min(max_k, spec.max_k) + 1))
    return keys


def arm_seconds(o: BatchOthers, drafts: Sequence[DraftSpec], max_k: int,
                seconds_fn: MixedSecondsFn,
                verified: Mapping[str, FloatArray] | None = None) -> FloatArray:
    """The step seconds of each arm of the class (``arm_keys`` order), the others fixed: every
    arm priced in one call of ``seconds_fn`` (decide rounds price thousands of these).
    ``verified``: per draft, the drafts a step verifies at K = 0..max asked (absent: K); a
    model drafter still runs K passes."""
    n = o.self_count
    ks_list: list[float] = [0]
    verified_list: list[float] = [0]
    runs: list[str] = [""]  # per arm, the model draft whose passes it runs
    segments: list[slice] = []
    for spec in drafts:
        k_max = min(max_k, spec.max_k)
        segments.append(slice(len(ks_list), len(ks_list) + k_max))
        ks_list.extend(range(1, k_max + 1))
        v = None if verified is None else verified.get(spec.name)
        verified_list.extend(range(1, k_max + 1) if v is None else v[1:k_max + 1].tolist())
        runs.extend([spec.pass_draft] * k_max)
    ks = np.asarray(ks_list, dtype=np.float64)
    run_by = np.asarray(runs)
    own = {d.name: np.where(run_by == d.name, ks, 0.0)
           for d in drafts if d.kind is DraftKind.MODEL}
    t = seconds_fn(o.batch_size, o.verified_tokens + n * (1 + np.asarray(verified_list)),
                   {m: o.drafting_probability(m, own[m]) for m in own},
                   {m: o.expected_passes(m, own[m]) for m in own},
                   {m: o.draft_tokens.get(m, 0.0) + n * own[m] for m in own})
    steps = [t[:1]]
    # More verified tokens never make a step faster (as in the cost model's curves).
    steps.extend(np.maximum.accumulate(np.maximum(t[seg], t[0])) for seg in segments)
    return np.concatenate(steps)


def priced_arm_rates(o: BatchOthers, drafts: Sequence[DraftSpec],
                     curves: Mapping[str, FloatArray], max_k: int, seconds: FloatArray
                     ) -> ArmRates:
    """The whole batch's tokens per second for each arm of the class, the others fixed, with
    the arms' step ``seconds`` (``arm_seconds``)."""
    expected: list[FloatArray] = [np.ones(1)]
    for spec in drafts:
        k_max = min(max_k, spec.max_k)
        expected.append(np.asarray(curves[spec.name][1 : k_max + 1], dtype=np.float64))
    e = np.concatenate(expected)
    return ArmRates(arm_keys(drafts, max_k), e, seconds, (o.self_count * e + o.tokens) / seconds)


def arm_rates(o: BatchOthers, drafts: Sequence[DraftSpec], curves: Mapping[str, FloatArray],
              max_k: int, seconds_fn: MixedSecondsFn,
              verified: Mapping[str, FloatArray] | None = None) -> ArmRates:
    """``priced_arm_rates`` with the arms priced by ``seconds_fn`` (``verified``: see
    ``arm_seconds``)."""
    return priced_arm_rates(o, drafts, curves, max_k,
                            arm_seconds(o, drafts, max_k, seconds_fn, verified))


@dataclass(frozen=True)
class JointClass:
    """One class in the joint search: its share of the batch, its mean E(K) curve per draft,
    the arm it runs now, and whether the search may move it (offline or overridden classes and
    classes without data are held)."""

    name: str
    share: float
    curves: Mapping[str, FloatArray]
    arm: Arm
    free: bool = True
    # Per draft: the drafts a step verifies at K = 0..max asked (absent: K).
    verified: Mapping[str, FloatArray] = field(default_factory=dict)

    def expected(self, arm: Arm) -> float:
        draft, k = arm
        return float(self.curves[draft][k]) if k else 1.0

    def other(self, arm: Arm, drafts: Sequence[DraftSpec]) -> OtherClass:
        """This class at ``arm`` as another class in the batch."""
        draft, k = arm
        v = self.verified.get(draft) if k else None
        return other_class(self.share, arm, self.expected(arm), drafts,
                           None if v is None else float(v[k]))


def _others(classes: Sequence[JointClass], arms: Mapping[str, Arm], skip: str,
            drafts: Sequence[DraftSpec], held: Sequence[OtherClass] = ()) -> list[OtherClass]:
    """The classes other than ``skip`` at ``arms``, after ``held`` (classes the search does
    not move, priced once)."""
    return [*held, *(c.other(arms[c.name], drafts) for c in classes if c.name != skip)]


def other_class(share: float, arm: Arm, expected_tokens: float,
                drafts: Sequence[DraftSpec], verified: float | None = None) -> OtherClass:
    """Another class at ``arm``, priced by the model draft whose passes its arm runs;
    ``verified``: the drafts a step of it verifies (None: K)."""
    draft, k = arm
    spec = next((d for d in drafts if d.name == draft), None)
    pass_draft = spec.pass_draft if spec is not None and k else ""
    return OtherClass(share, pass_draft, bool(pass_draft), k, expected_tokens, verified)


def joint_arms(batch_size: int, classes: Sequence[JointClass], drafts: Sequence[DraftSpec],
               max_k: int, seconds_fn: MixedSecondsFn) -> dict[str, Arm]:
    """The arms that maximise the batch's expected tokens per second, by coordinate ascent
    from several starts: the arms now, all free classes off, and all free classes on one draft
    at K = 1, 2, 4, ... (class-by-class moves alone stall where two classes would only gain
    by lengthening their shared draft together).

    Bounded, so a round never stalls the loop whatever the classes and drafts: only the
    ``JOINT_MAX_FREE`` free classes with the largest shares move (the rest keep their arms,
    as held classes do, and are priced once), and the search stops once it has priced
    ``JOINT_ARM_BUDGET`` arms, keeping the best batch found (starts run in the order above,
    the arms now first). At 256 classes x 16 drafts an unbounded search took 20-27 s a
    bucket; the bounds do not bind at a handful of classes and drafts."""
    movable = sorted((c for c in classes if c.free), key=lambda c: -c.share)[:JOINT_MAX_FREE]
    if not movable:
        return {c.name: c.arm for c in classes}
    moving = {c.name for c in movable}
    held = [c.other(c.arm, drafts) for c in classes if c.name not in moving]
    starts: list[dict[str, Arm]] = [{c.name: c.arm for c in movable}]
    # Uniform starts at a few K per draft (1, 2, 4, ... max): the ascent refines the rest. Every
    # draft, not only model drafts: where n-gram drafts skip the drafter's passes, all classes
    # moving to them together can gain while no single class gains by moving alone.
    uniform: list[Arm] = [("", 0)] + [
        (d.name, k) for d in drafts
        for k in sorted({min(2**i, min(max_k, d.max_k)) for i in range(8)})]
    starts.extend({c.name: arm for c in movable} for arm in uniform)
    budget = JOINT_ARM_BUDGET

    def rates(c: JointClass, arms: Mapping[str, Arm]) -> ArmRates:
        nonlocal budget
        o = BatchOthers.build(batch_size, c.share, _others(movable, arms, c.name, drafts, held))
        r = arm_rates(o, drafts, c.curves, max_k, seconds_fn, c.verified)
        budget -= len(r.keys)
        return r

    reference = movable[0]
    best_arms, best_rate = starts[0], -np.inf
    for start in starts:
        if budget <= 0:
            break
        arms = dict(start)
        for _ in range(_JOINT_SWEEPS):
            moved = False
            for c in movable:
                if budget <= 0:
                    break
                r = rates(c, arms)
                i = int(np.argmax(r.batch_rate))
                if r.keys[i] != arms[c.name] and r.batch_rate[i] > r.batch_rate[
                        r.keys.index(arms[c.name])] * (1 + 1e-9):
                    arms[c.name] = r.keys[i]
                    moved = True
            if not moved or budget <= 0:
                break
        r = rates(reference, arms)
        rate = float(r.batch_rate[r.keys.index(arms[reference.name])])
        if rate > best_rate:
            best_arms, best_rate = arms, rate
    return {**{c.name: c.arm for c in classes}, **best_arms}
