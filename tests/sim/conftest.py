"""Small scenarios for the simulator tests (seconds of simulated time, not minutes)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.sim.scenario import Scenario, parse_scenario


def scenario_data(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "tiny",
        "seed": 3,
        "engine": {"max_k": 6, "max_batch": 16},
        "cost": {"base_ms": 20, "per_sequence_ms": 0.1, "per_token_ms": 0.02,
                 "ridge_tokens": 48, "per_token_above_ridge_ms": 0.2, "noise": 0.02},
        "drafts": [{"name": "small", "kind": "model", "per_pass_ms": 3.0, "per_token_ms": 0.02},
                   {"name": "ngram", "kind": "ngram"}],
        "classes": [
            {"name": "easy", "share": 0.5, "prompt_tokens": [50, 200],
             "output_tokens": [50, 200], "acceptance": {"small": 0.9, "ngram": 0.2}},
            {"name": "hard", "share": 0.5, "prompt_tokens": [50, 200],
             "output_tokens": [50, 200], "acceptance": {"small": 0.05, "ngram": 0.05}},
        ],
        "load": [{"duration_seconds": 40, "concurrency": 2}],
    }
    data.update(changes)
    return data


@pytest.fixture
def tiny() -> Scenario:
    return parse_scenario(scenario_data())
