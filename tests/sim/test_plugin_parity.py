"""The simulator's specpilot and the engine plugin apply one policy the same way: for the same
request ids, in the same probe epoch, the same requests probe and the same requests are scored
counterfactually (one hash, one pick rule: ``specpilot.engine_plugin.policy``), and each
request's drafts are cut to the same length by the policy's token cut."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from benchmarks.sim import policies
from benchmarks.sim.engine import SimEngine
from benchmarks.sim.scenario import Scenario
from benchmarks.sim.specpilot_policy import SpecPilotPolicy
from benchmarks.sim.step import StepView, TokenSlots
from specpilot.contract.confidence import N_CONFIDENCE_BUCKETS
from specpilot.contract.engine_stream import policy_update_from_proto
from specpilot.contract.records import CalibrationRows, DraftKind, PolicyUpdate, TokenCut
from specpilot.engine_plugin.classify import Classifier
from specpilot.engine_plugin.config import PluginConfig
from specpilot.engine_plugin.ngram import NGRAM_DRAFT
from specpilot.engine_plugin.pilot import EngineSpec, Pilot, announce
from specpilot.engine_plugin.policy.points import probe_point
from specpilot.engine_plugin.policy.view import PROBE_EPOCH_SECONDS, PolicyView
from specpilot.v1 import engine_pb2
from tests.plugin.test_pilot import _Params, _Request, load

N = 400
NOW = 1234.5  # simulated seconds, and the plugin's clock
PROBE_RATE = 0.3


def _update(view: PolicyView, cut: TokenCut | None = None) -> PolicyUpdate:
    """"easy" on the model draft; "hard" off, probing requests at K=2 of the model draft; with
    ``cut``, the token cut."""
    update = engine_pb2.PolicyUpdate(version=99, fail_static_timeout_seconds=1e9)
    for bucket in range(len(view.bucket_bounds) + 1):
        update.decisions.add(traffic_class="easy", batch_bucket=bucket, draft="small", k=3)
        update.decisions.add(traffic_class="hard", batch_bucket=bucket, k=0, probe_k=2,
                             probe_draft="small", probe_rate=PROBE_RATE)
    return replace(policy_update_from_proto(update), cut=cut)


def _classes() -> list[str]:
    return ["easy" if i % 3 == 0 else "hard" for i in range(N)]


def _simulator(tiny: Scenario) -> tuple[set[str], set[str]]:
    """The requests that probe, and those scored counterfactually, in one simulated step."""
    policy = policies.build("specpilot", SimEngine(tiny))
    assert isinstance(policy, SpecPilotPolicy)
    policy.view.apply(_update(policy.view))
    names = list(policy.info.classes)
    classes = np.array([names.index(c) for c in _classes()], dtype=np.int64)
    a = policy.assign(StepView(NOW, N, 0, np.arange(N, dtype=np.int64), classes))
    small = policy.info.drafts.index("small")
    probed = {str(i) for i in range(N) if _classes()[i] == "hard" and a.k[i] == 2
              and a.draft[i] == small}
    assert a.score is not None
    return probed, {str(i) for i in np.flatnonzero(a.score)}


def _engine() -> EngineSpec:
    return EngineSpec(model="m", tokenizer="target", drafter="small",
                        drafter_kind=DraftKind.MODEL, drafter_tokenizer="same", max_k=6,
                        async_scheduling=False, greedy_draft_sampling=True, ngram_min=2,
                      ngram_max=4, max_model_len=128, max_num_seqs=N)


def _pilot(cut: TokenCut | None = None) -> tuple[Pilot, dict[str, _Request]]:
    """A batch_max engine on the simulator's drafts, with the policy in force, and its
    requests, keyed by the simulator's ids."""
    engine = _engine()
    config = PluginConfig(k_mode="batch_max")
    pilot = Pilot(engine, config, Classifier(), announce(engine, config, load))
    pilot.view._clock = lambda: NOW
    pilot.view.apply(_update(pilot.view, cut))
    requests = {}
    for i, cls in enumerate(_classes()):
        r = _Request(i)
        r.request_id = str(i)
        r.sampling_params = _Params(cls)  # type: ignore[assignment]
        requests[r.request_id] = r
        pilot.on_add_request(r)  # type: ignore[arg-type]
    return pilot, requests


def _plugin() -> tuple[set[str], set[str]]:
    """The same in the plugin."""
    pilot, requests = _pilot()
    pilot.on_schedule_start()
    pilot.batch_k(requests.values())  # type: ignore[arg-type]
    lookup = pilot._lookup(N)
    probed = {i for i in requests if pilot._choice(i, lookup).probe}
    scored: list[str] = []
    pilot.counterfactual[NGRAM_DRAFT].step = (  # type: ignore[method-assign]
        lambda req_id, *_: scored.append(req_id))
    pilot.after_output(requests, list(requests), running=N)  # type: ignore[arg-type]
    pilot.close()
    return probed, set(scored)


def test_the_simulator_and_the_plugin_probe_and_score_the_same_requests(tiny: Scenario) -> None:
    sim_probed, sim_scored = _simulator(tiny)
    plugin_probed, plugin_scored = _plugin()
    assert sim_probed == plugin_probed
    assert sim_scored == plugin_scored
    # The one hash: a request probes while its point in the epoch is below the rate.
    epoch = int(NOW // PROBE_EPOCH_SECONDS)
    hard = [str(i) for i, c in enumerate(_classes()) if c == "hard"]
    assert sim_probed == {i for i in hard if probe_point(f"{i}#{epoch}") < PROBE_RATE}
    # The control: some requests probe and some do not; both classes are scored.
    assert 0 < len(sim_probed) < len(hard)
    assert {_classes()[int(i)] for i in sim_scored} == {"easy", "hard"}


def _cut() -> TokenCut:
    """A calibration per class, at random, and a survival to reach that cuts some drafts."""
    gen = np.random.default_rng(11)
    rows = tuple(CalibrationRows(c, "small", False, 6,
                                 tuple(gen.uniform(0.2, 1.0, 6 * N_CONFIDENCE_BUCKETS).tolist()))
                 for c in ("easy", "hard"))
    return TokenCut((0.35,) * 12, rows)


def test_the_simulator_and_the_plugin_cut_the_same_drafts(tiny: Scenario) -> None:
    confidences = np.random.default_rng(12).uniform(0.01, 0.99, (N, 6))
    policy = policies.build("specpilot", SimEngine(tiny))
    assert isinstance(policy, SpecPilotPolicy) and policy.reads_confidence
    policy.view.apply(_update(policy.view, _cut()))
    names = list(policy.info.classes)
    classes = np.array([names.index(c) for c in _classes()], dtype=np.int64)
    small = policy.info.drafts.index("small")
    a = policy.assign(StepView(NOW, N, 0, np.arange(N, dtype=np.int64), classes,
                               TokenSlots(small, confidences, confidences)))
    pilot, requests = _pilot(_cut())
    for r in requests.values():
        r.spec_token_ids = [5] * 6  # the drafter drafted max K: the step has a K-6 request
    pilot.on_schedule_start()
    pilot.batch_k(requests.values())  # type: ignore[arg-type]
    pilot.on_drafts(requests, list(requests), N, None,  # type: ignore[arg-type]
                    confidences.tolist())
    pilot.close()
    assert a.k.tolist() == [len(requests[str(i)].spec_token_ids) for i in range(N)]
    # What the drafter drafted: each request's K before the cut.
    assert a.drafted is not None
    assert a.drafted.tolist() == [3 if c == "easy" else 2 if k else 0
                                  for c, k in zip(_classes(), a.drafted.tolist(), strict=True)]
    # The control: the cut shortened some drafts of both classes, and left some whole.
    cut = a.k < a.drafted
    assert {_classes()[i] for i in np.flatnonzero(cut)} == {"easy", "hard"}
    assert np.any(~cut & (a.drafted > 0))
