"""The real benchmark's traffic plan (pure): load phases sized by wall-clock time, each a
closed-loop concurrency held for a number of seconds, fed from its own deterministic sequence of
held-out ShareGPT requests of every class, mixed by the classes' shares.

Every configuration replays the same sequence per phase, so a faster configuration gets further
into it and greedy outputs compare text for text on the requests both reached. A plan is written
``name:concurrency:seconds`` per phase, comma-separated (:func:`parse_plan`), or as a YAML or
JSON file holding a list of ``{name, concurrency, seconds}`` (:func:`load_plan`); it replays.

The demo's traffic (:mod:`benchmarks.real.demo_plan`) still counts requests per phase:
:class:`LoadPhase`, :data:`PHASES` and :func:`build_plan`.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.real.sharegpt import CLASSES, RealClass, TrafficRequest


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class TimedPhase:
    """``concurrency`` closed-loop clients for ``seconds`` of wall-clock time."""

    name: str
    concurrency: int
    seconds: float

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.concurrency}:{_number(self.seconds)}"


# The same wall time in each phase, so the quiet periods where speculation pays weigh as much
# as the busy ones: light, a burst, a peak, light again.
PHASE_SECONDS = 60.0
DEFAULT_PLAN: tuple[TimedPhase, ...] = (
    TimedPhase("light", 1, PHASE_SECONDS), TimedPhase("burst", 16, PHASE_SECONDS),
    TimedPhase("peak", 32, PHASE_SECONDS), TimedPhase("light-again", 1, PHASE_SECONDS))
# Output tokens per request at most (each class's own cap may be lower).
MAX_TOKENS = 128
# Requests per round of a phase's sequence: the classes' shares hold exactly in every round.
ROUND = 20

_EXAMPLE = ",".join(p.spec for p in DEFAULT_PLAN)
_HOW = f"write name:concurrency:seconds per phase, comma-separated, e.g. {_EXAMPLE}"


def plan_spec(phases: Sequence[TimedPhase]) -> str:
    """``phases`` as the inline plan that replays them (``--plan``)."""
    return ",".join(p.spec for p in phases)


def validate_plan(phases: Sequence[TimedPhase]) -> tuple[TimedPhase, ...]:
    """``phases`` as a tuple; raises ValueError saying what to write instead when the plan is
    empty or a phase's name, concurrency or duration is not usable."""
    if not phases:
        raise ValueError(f"the plan has no phases; {_HOW}")
    for i, p in enumerate(phases, 1):
        where = f"phase {i} ({p.name!r})"
        if not p.name.strip() or any(ch in p.name for ch in ":,"):
            raise ValueError(f"{where}: a name must be non-empty, without ':' or ','; "
                             f"e.g. burst:{p.concurrency}:{_number(p.seconds)}")
        if isinstance(p.concurrency, bool) or not isinstance(p.concurrency, int) \
                or p.concurrency < 1:
            raise ValueError(f"{where}: concurrency must be a whole number of requests in "
                             f"flight, at least 1, got {p.concurrency!r}; "
                             f"e.g. {p.name}:16:{_number(p.seconds)}")
        if not math.isfinite(p.seconds) or p.seconds <= 0:
            raise ValueError(f"{where}: seconds must be a positive duration, got "
                             f"{p.seconds!r}; e.g. {p.name}:{p.concurrency}:60")
    return tuple(phases)


def _whole(text: str, what: str, item: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"phase {item!r}: {what} {text!r} is not a number; "
                         f"write e.g. light:1:60") from None
    if not value.is_integer():
        raise ValueError(f"phase {item!r}: {what} must be a whole number, got {text!r}; "
                         f"write e.g. burst:16:60")
    return int(value)


def _seconds(text: str, item: str) -> float:
    # "90", "90s" or "1.5m": seconds unless marked as minutes.
    body, factor = text, 1.0
    if text.endswith("m"):
        body, factor = text[:-1], 60.0
    elif text.endswith("s"):
        body = text[:-1]
    try:
        return float(body) * factor
    except ValueError:
        raise ValueError(f"phase {item!r}: seconds {text!r} is not a duration; write seconds "
                         f"(90, 90s) or minutes (1.5m), e.g. light:1:90") from None


def parse_plan(text: str) -> tuple[TimedPhase, ...]:
    """The inline plan ``name:concurrency:seconds,...`` (seconds may end in ``s``, or in ``m``
    for minutes). Raises ValueError saying what to write instead."""
    phases = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        fields = item.split(":")
        if len(fields) != 3:
            raise ValueError(f"phase {item!r} must be name:concurrency:seconds; {_HOW}")
        name, concurrency, seconds = (f.strip() for f in fields)
        phases.append(TimedPhase(name, _whole(concurrency, "concurrency", item),
                                 _seconds(seconds, item)))
    return validate_plan(phases)


_KEYS = frozenset({"name", "concurrency", "seconds"})


def _phase_from(entry: object, i: int, source: str) -> TimedPhase:
    if not isinstance(entry, Mapping):
        raise ValueError(f"{source}: phase {i} must be a mapping with name, concurrency and "
                         f"seconds, e.g. {{name: light, concurrency: 1, seconds: 60}}")
    keys = set(entry)
    if keys != _KEYS:
        raise ValueError(f"{source}: phase {i} has keys {sorted(map(str, keys))}; write exactly "
                         f"name, concurrency and seconds, e.g. "
                         f"{{name: light, concurrency: 1, seconds: 60}}")
    name, concurrency, seconds = entry["name"], entry["concurrency"], entry["seconds"]
    if isinstance(concurrency, float) and concurrency.is_integer():
        concurrency = int(concurrency)
    if isinstance(seconds, str):
        seconds = _seconds(seconds.strip(), f"{name}:{concurrency}:{seconds}")
    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        raise ValueError(f"{source}: phase {i}: seconds must be a number, got {seconds!r}")
    return TimedPhase(str(name), concurrency, float(seconds))


def load_plan(path: Path) -> tuple[TimedPhase, ...]:
    """A plan file: YAML or JSON (by its suffix; YAML otherwise, a superset of JSON), a list of
    ``{name, concurrency, seconds}`` or a mapping whose ``phases`` is one."""
    import yaml

    text = path.read_text()
    data: Any = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if isinstance(data, Mapping) and set(data) == {"phases"}:
        data = data["phases"]
    if data is None:
        data = []
    if not isinstance(data, list):
        raise ValueError(f"{path}: a plan file holds a list of phases (name, concurrency, "
                         f"seconds) or {{phases: [...]}}")
    return validate_plan([_phase_from(e, i, str(path)) for i, e in enumerate(data, 1)])


PLAN_SUFFIXES = (".json", ".yaml", ".yml")


def read_plan(value: str) -> tuple[TimedPhase, ...]:
    """``--plan``'s value: a plan file when one exists there (or the value names a .json,
    .yaml or .yml file), an inline plan otherwise."""
    path = Path(value).expanduser()
    if path.is_file():
        return load_plan(path)
    if value.strip().lower().endswith(PLAN_SUFFIXES):
        raise ValueError(f"no plan file {value}; give an existing file or an inline plan, "
                         f"e.g. {_EXAMPLE}")
    return parse_plan(value)


def scaled_plan(phases: Sequence[TimedPhase], factor: float) -> tuple[TimedPhase, ...]:
    """``phases`` with ``factor`` times their durations."""
    if not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"--scale must be a positive factor of the phases' durations, got "
                         f"{factor}; e.g. --scale 0.5 for half as long")
    return validate_plan([TimedPhase(p.name, p.concurrency, p.seconds * factor)
                          for p in phases])


def class_counts(classes: Sequence[RealClass], n: int) -> dict[str, int]:
    """``n`` requests split by the classes' shares (largest remainder)."""
    total = sum(c.share for c in classes)
    want = {c.name: c.share / total * n for c in classes}
    counts = {k: int(v) for k, v in want.items()}
    for name in sorted(want, key=lambda k: counts[k] - want[k])[: n - sum(counts.values())]:
        counts[name] += 1
    return counts


def phase_pools(heldout: Mapping[str, Sequence[TrafficRequest]], n_phases: int, seed: int = 0,
                classes: Sequence[RealClass] = CLASSES) -> list[dict[str, list[TrafficRequest]]]:
    """Each phase's own held-out requests per class: every class's requests shuffled (``seed``)
    and dealt round the phases, so no request serves two phases. Raises ValueError when a class
    the mix needs has fewer requests than the plan has phases."""
    rng = random.Random(seed)
    needed = {name for name, n in class_counts(classes, ROUND).items() if n}
    pools: list[dict[str, list[TrafficRequest]]] = [{} for _ in range(n_phases)]
    for c in classes:
        shuffled = rng.sample(list(heldout[c.name]), len(heldout[c.name]))
        if c.name in needed and len(shuffled) < n_phases:
            raise ValueError(f"class {c.name!r} has {len(shuffled)} held-out requests; a plan "
                             f"of {n_phases} phases needs at least one per phase")
        for i in range(n_phases):
            pools[i][c.name] = shuffled[i::n_phases]
    return pools


def phase_requests(heldout: Mapping[str, Sequence[TrafficRequest]], index: int, n_phases: int,
                   seed: int = 0, classes: Sequence[RealClass] = CLASSES
                   ) -> Iterator[TrafficRequest]:
    """Phase ``index``'s request sequence, endless and deterministic in ``seed``: rounds of
    ``ROUND`` requests holding the classes' shares, shuffled; each class takes its phase's pool
    in order and starts it over when it runs out. How many requests a run takes does not change
    the ones it gets (a prefix)."""
    pool = phase_pools(heldout, n_phases, seed, classes)[index]
    rng = random.Random(f"specpilot-real-plan/{seed}/{index}")
    round_ = [name for name, n in class_counts(classes, ROUND).items() for _ in range(n)]
    takes = {name: itertools.cycle(pool[name]) for name in set(round_)}

    def sequence() -> Iterator[TrafficRequest]:
        while True:
            for name in rng.sample(round_, len(round_)):
                yield next(takes[name])

    return sequence()


# The demo's phases, by request count.
@dataclass(frozen=True)
class LoadPhase:
    name: str
    concurrency: int
    requests: int


# Light, a burst, a peak, light again: the regime speculation lives in, then the one it does not.
PHASES: tuple[LoadPhase, ...] = (LoadPhase("light", 1, 3), LoadPhase("burst", 16, 24),
                                 LoadPhase("peak", 32, 32), LoadPhase("light-again", 1, 3))


def build_plan(heldout: Mapping[str, Sequence[TrafficRequest]],
               phases: Sequence[LoadPhase] = PHASES, seed: int = 0,
               classes: Sequence[RealClass] = CLASSES) -> list[list[TrafficRequest]]:
    """The requests of each counted phase: distinct held-out requests, shuffled, deterministic
    in ``seed``. Raises ValueError when a class has too few held-out requests."""
    rng = random.Random(seed)
    pools = {c.name: rng.sample(list(heldout[c.name]), len(heldout[c.name])) for c in classes}
    taken = dict.fromkeys(pools, 0)
    plan: list[list[TrafficRequest]] = []
    for phase in phases:
        chosen: list[TrafficRequest] = []
        for name, count in class_counts(classes, phase.requests).items():
            start = taken[name]
            if start + count > len(pools[name]):
                raise ValueError(f"class {name!r} has {len(pools[name])} held-out requests; "
                                 f"the plan needs more")
            chosen += pools[name][start:start + count]
            taken[name] = start + count
        rng.shuffle(chosen)
        plan.append(chosen)
    return plan
