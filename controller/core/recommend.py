"""Recommendations across the fleet of one model: which draft, and which pool (speculative or
plain engines), serves each traffic class best, all compared at one load on the same footing.

Each sidecar summarises what its own engine type achieves (``EngineOptions``, built by
``ControllerCore.engine_options``): per batch bucket, the goodput with speculation off and, per
class and draft, the goodput at that draft's best K, by posterior means, the class alone in the
batch, priced by the sidecar's own cost model (so a draft is judged on the engines that run it).
``recommend`` compares every sidecar's summary at the bucket of the fleet's observed load. A
plain engine's goodput does not depend on the class: its one "off" curve is an option for all.
Pure: the fleet edge moves the summaries through the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SPECULATIVE = "speculative"
PLAIN = "plain"


@dataclass(frozen=True)
class DraftCurve:
    """One class with one draft on one sidecar's engines, per batch bucket."""

    traffic_class: str
    draft: str
    ks: tuple[int, ...]  # the best K >= 1
    goodput: tuple[float, ...]  # tokens/s of the batch at that K
    tries: float  # effective position-1 tries behind the estimate (own and fleet evidence)


@dataclass(frozen=True)
class EngineOptions:
    """What one sidecar's engine type achieves, as of ``at``."""

    sidecar: str
    at: float
    pool: str  # SPECULATIVE when its engines have drafts, else PLAIN
    load: float  # mean running requests of its engines
    batch_sizes: tuple[int, ...]  # per bucket: the batch size the goodputs are priced at
    off: tuple[float, ...]  # per bucket: tokens/s of the batch with speculation off
    cost_steps: float  # decode steps behind its cost model
    curves: tuple[DraftCurve, ...] = ()


@dataclass(frozen=True)
class Option:
    """One way to serve a class, with the evidence behind it."""

    pool: str
    draft: str  # "" : speculation off
    k: int
    goodput: float  # tokens/s of the batch, mean over the sidecars offering it
    tries: float  # position-1 tries behind the acceptance (0 with speculation off)
    sidecars: int  # how many sidecars offer it
    cost_steps: float  # decode steps behind their cost models (summed)


@dataclass(frozen=True)
class Recommendation:
    traffic_class: str
    batch_bucket: int  # the fleet's observed load, where the options are compared
    batch_size: int
    draft: str  # the best draft on speculative engines ("": none beats speculation off there)
    pool: str  # the pool whose best option is best
    options: tuple[Option, ...]  # best first


def compared_bucket(fleet: Sequence[EngineOptions]) -> int:
    """The bucket of the fleet's observed load: the mean running requests of the sidecars that
    have any (bucket 0 when none does)."""
    loads = [o.load for o in fleet if o.load > 0]
    if not fleet or not loads:
        return 0
    load = sum(loads) / len(loads)
    sizes = fleet[0].batch_sizes
    return next((b for b, size in enumerate(sizes) if size >= load), len(sizes) - 1)


def recommend(fleet: Sequence[EngineOptions], min_tries: float) -> tuple[Recommendation, ...]:
    """Per class any speculative sidecar has a draft curve for (with at least ``min_tries``
    position-1 tries), every option at the fleet's load, best first. Sidecars whose buckets
    differ from the first one's are left out (their goodputs are priced at other sizes)."""
    if not fleet:
        return ()
    fleet = sorted(fleet, key=lambda o: o.sidecar)
    fleet = [o for o in fleet if o.batch_sizes == fleet[0].batch_sizes]
    b = compared_bucket(fleet)
    classes = sorted({c.traffic_class for o in fleet if o.pool == SPECULATIVE
                      for c in o.curves if c.tries >= min_tries})
    out = []
    for cls in classes:
        offered: dict[tuple[str, str], list[tuple[int, float, float, float]]] = {}
        for o in fleet:
            offered.setdefault((o.pool, ""), []).append((0, o.off[b], 0.0, o.cost_steps))
            for c in o.curves:
                if c.traffic_class == cls and c.tries >= min_tries and o.pool == SPECULATIVE:
                    offered.setdefault((o.pool, c.draft), []).append(
                        (c.ks[b], c.goodput[b], c.tries, o.cost_steps))
        options = sorted(
            (Option(pool, draft, max(ks := [x[0] for x in xs], key=ks.count),
                    sum(x[1] for x in xs) / len(xs),
                    # Each sidecar's posterior holds the fleet's evidence already: not summed.
                    max(x[2] for x in xs), len(xs), sum(x[3] for x in xs))
             for (pool, draft), xs in offered.items()),
            key=lambda opt: (-opt.goodput, opt.pool, opt.draft))
        speculative = [opt for opt in options if opt.pool == SPECULATIVE]
        out.append(Recommendation(
            cls, b, fleet[0].batch_sizes[b], speculative[0].draft if speculative else "",
            options[0].pool, tuple(options)))
    return tuple(out)
