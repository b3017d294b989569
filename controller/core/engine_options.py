"""What this controller's engines achieve, for the fleet's recommendations
(``specpilot.controller.core.recommend``): per batch bucket, the goodput with speculation off and,
per class and draft with evidence, the goodput at that draft's best K. Posterior means and mean
costs, the class alone in the batch; draws nothing, so deciding is unaffected.
"""

from __future__ import annotations

import numpy as np

from specpilot.controller.core.class_table import ClassTable
from specpilot.controller.core.config import CoreConfig
from specpilot.controller.core.engines import EngineRegistry
from specpilot.controller.core.evidence import Evidence
from specpilot.controller.core.goodput import expected_tokens_curve, goodput
from specpilot.controller.core.recommend import PLAIN, SPECULATIVE, DraftCurve, EngineOptions


def engine_options(config: CoreConfig, engines: EngineRegistry, classes: ClassTable,
                   evidence: Evidence, sidecar: str, now: float) -> EngineOptions | None:
    """None while no engine is connected."""
    if not len(engines):
        return None
    drafts = engines.drafts()
    sunk = engines.sunk_draft()
    cost, estimator = evidence.cost, evidence.estimator
    sizes = tuple(config.bucket_batch_size(b) for b in range(config.n_buckets))
    off = tuple(float(n / cost.predict_curve(n, "", False, 0, sunk_draft=sunk)[0])
                for n in sizes)
    curves = []
    for name in classes.names():
        for d in drafts:
            if not estimator.has_data(name, d.name):
                continue
            post = estimator.posterior(name, d.name, now)
            k_max = min(config.policy.max_k, d.max_k)
            expected = expected_tokens_curve(post.mean[:k_max])[1:]
            best = []
            for n in sizes:
                seconds = cost.predict_curve(n, d.pass_draft, bool(d.pass_draft), k_max,
                                             sunk_draft=sunk)[1:]
                values = goodput(expected, n, seconds)
                k = int(np.argmax(values))
                best.append((k + 1, float(values[k])))
            curves.append(DraftCurve(name, d.name, tuple(k for k, _ in best),
                                     tuple(g for _, g in best),
                                     float(post.effective_tries[0])))
    return EngineOptions(sidecar, now, SPECULATIVE if drafts else PLAIN, engines.mean_running(),
                         sizes, off, cost.observed_steps, tuple(curves))
