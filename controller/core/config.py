"""The core's configuration: traffic classes, batch buckets, the step-cost model's shape and the
decision log, with the estimator's, the policy's and the cost prior's own settings nested."""

from __future__ import annotations

from dataclasses import dataclass

from specpilot.contract.buckets import DEFAULT_BUCKET_BOUNDS, bucket_of, bucket_upper_size
from specpilot.controller.core.acceptance import EstimatorConfig
from specpilot.controller.core.cost_model import CostPrior
from specpilot.controller.core.policy import PolicyConfig
from specpilot.controller.core.tunable import tunable


@dataclass(frozen=True)
class CoreConfig:
    """Core: traffic classes, batch buckets, the step-cost model's shape and the decision log.

    The nested configs are concerns of their own, each with its own settings."""

    estimator: EstimatorConfig
    """The acceptance estimator's settings."""
    policy: PolicyConfig
    """The decision rule's settings."""
    cost_prior: CostPrior
    """The step-cost model's prior."""
    cost_knots_tokens: tuple[int, ...] = tunable((16, 32, 64, 128, 256, 512, 1024),
                                                 increasing=True)
    """Verified-token counts where the step-cost slope may change (hinge knots)."""
    cost_half_life_steps: float = tunable(20000.0, gt=0)
    """Steps after which what the step-timing evidence says about a step shape is halved by
    newer steps of that shape (shapes the engine stops running keep their evidence: step costs
    are not forgotten on a clock), steps."""
    cost_change_tolerance: float = tunable(0.15, gt=0)
    """Log ratio of a measured step time to its prediction within which the step-cost change
    test counts nothing (the fit's own error; 0.15 is about 16%)."""
    cost_change_threshold_steps: float = tunable(400.0, gt=0)
    """Steps' excess log ratio (beyond the tolerance, summed) at which the step costs are taken
    to have changed and most of their evidence is forgotten, steps (a doubled step time fires
    within about 750 steps, a 30% one within about 3,600)."""
    batch_bucket_upper_bounds: tuple[int, ...] = tunable(DEFAULT_BUCKET_BOUNDS, increasing=True)
    """Inclusive upper bounds of batch-size buckets, sequences; one open bucket follows the
    last."""
    traffic_half_life_seconds: float = tunable(30.0, gt=0)
    """Half-life of what the controller knows of the traffic running now: the class mix of the
    batch and each bucket's mean batch size (a bucket's decisions are priced at it), seconds.
    Short, so that decisions follow a mix or load that moves within minutes."""
    max_classes: int = tunable(16, ge=1, le=256)
    """Distinct class names tracked ('default' and declared classes included); more fold into
    'other'. With several engines connected, each may bring new classes only while it holds
    fewer than its share of the slots left after the declared ones and 'other' (those slots
    over the engines, rounded up), so one engine cannot take them all."""
    max_model_drafts: int = tunable(32, ge=1, le=64)
    """Model drafts the step-cost model prices at once, across engines and reconnects (three
    cost columns each, and its prior grows with their square). A hello naming a new model
    draft when this many are held gives back the columns and estimates of drafts no connected
    engine announces, the longest-held first; when every one is in use the new draft is
    refused (HelloAck.rejected_drafts says why). One engine announces at most MAX_DRAFTS."""
    offline_classes: frozenset[str] = tunable(frozenset())
    """Classes of prefill-dominated batch work (declared: they hold a slot from the start)."""
    declared_classes: frozenset[str] = tunable(frozenset())
    """Classes known before any traffic: each holds a slot from the start and never gives it
    back, and operators may override them before an engine reports them (an override must name
    a declared class or one an engine has reported)."""
    declared_drafts: frozenset[str] = tunable(frozenset())
    """Drafts operators may force (an override's force_draft) beside those the connected engines
    offer, e.g. before any engine has connected; a forced draft the engines do not offer runs
    the class without speculation. Any other draft name is refused."""
    class_idle_seconds: float = tunable(900.0, gt=0)
    """A class no engine has reported for this long, neither declared nor under an override of
    its own, gives its slot back and its estimates are forgotten, seconds. A class whose every
    reporting engine disconnected gives its slot to a new class at once when the table is
    full."""
    name_grace_seconds: float = tunable(300.0, gt=0)
    """A draft no connected engine has announced for this long has its estimates, calibration
    and cost columns forgotten (with their metric series and dashboard rows), and an engine id
    disconnected this long has its share of each class's evidence joined to that of all
    departed engines, seconds. An engine that reconnects sooner finds its evidence as it left
    it."""
    max_absent_drafts: int = tunable(64, ge=0, le=4096)
    """Drafts no connected engine announces whose estimates are kept through
    ``name_grace_seconds``; beyond this many, the longest-absent are forgotten at once. With
    it, the per-(class, draft) metric series are at most 3 x (``max_classes`` + 2) x (the
    connected engines' drafts + this) however many engines come and go."""
    decision_log_size: int = tunable(1000, ge=1, le=10_000)
    """Decisions kept for watch/replay. At most 10,000: a decision held costs ~0.35 KiB, and
    answering a read of the whole log (/api/decisions without a limit) ~2.6 KiB more each
    (benchmarks/sidecar_memory.py: 100,000 peaked at 368 MiB)."""

    @property
    def n_buckets(self) -> int:
        return len(self.batch_bucket_upper_bounds) + 1

    def bucket_batch_size(self, bucket: int) -> int:
        """Upper batch size of a bucket: its upper bound (twice the last for the open bucket);
        the cost prior's design points, and a bucket's price until steps were seen in it."""
        return bucket_upper_size(self.batch_bucket_upper_bounds, bucket)

    def bucket_of(self, batch_size: int) -> int:
        return bucket_of(self.batch_bucket_upper_bounds, batch_size)
