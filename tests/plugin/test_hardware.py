"""The engine type's hardware name: read from vLLM's platform and config, never fatal."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from specpilot.engine_plugin.config import PluginConfig
from specpilot.engine_plugin.hardware import describe_hardware


def _config(tp: int = 2, dtype: Any = torch.bfloat16) -> Any:
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp,
                                                           pipeline_parallel_size=1),
                           model_config=SimpleNamespace(dtype=dtype))


def test_this_cpu_is_named_with_its_cores_parallelism_and_dtype() -> None:
    name = describe_hardware(_config())
    assert name.startswith("cpu ") and name.endswith(" tp2 pp1 bfloat16")
    assert describe_hardware(_config(tp=1)) != name  # another parallelism is another type


def test_a_config_it_cannot_read_shares_nothing_and_serves_on() -> None:
    assert describe_hardware(SimpleNamespace(model_config=None)) == ""


def test_a_named_hardware_is_bounded_and_printable() -> None:
    assert PluginConfig(hardware="a100-pool-b").hardware == "a100-pool-b"
    for bad in ("x" * 201, "tab\there"):
        with pytest.raises(ValueError, match=r"^SPECPILOT_PLUGIN_HARDWARE: "):
            PluginConfig(hardware=bad)
