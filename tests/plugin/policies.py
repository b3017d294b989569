"""A policy put in force in a plugin's view directly, as the controller's update would."""

from __future__ import annotations

from collections.abc import Mapping

from engine_plugin.policy_view import PolicyView
from specpilot.v1 import engine_pb2


def put_policy(view: PolicyView, by_class: Mapping[str, tuple[str, int]], version: int = 1
               ) -> None:
    """(draft, K) per class in every batch bucket, kept in force (no fail-static timeout)."""
    update = engine_pb2.PolicyUpdate(version=version, fail_static_timeout_seconds=1e9)
    for bucket in range(len(view.bucket_bounds) + 1):
        for traffic_class, (draft, k) in by_class.items():
            update.decisions.add(traffic_class=traffic_class, batch_bucket=bucket, draft=draft,
                                 k=k)
    view.apply(update)
