"""What the engine runs on, in one line: the engine type (with the model and its drafts) whose
step costs the controllers of a fleet share, so a new pod prices K from what pods on the same
hardware measured instead of from a generic prior."""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

from specpilot.contract.validation import MAX_HARDWARE_CHARS
from specpilot.engine_plugin.vllm_types import VllmConfigLike

log = logging.getLogger(__name__)


def describe_hardware(vllm_config: VllmConfigLike) -> str:
    """``"<device> tp<N> pp<M> <dtype>"``, e.g. ``"NVIDIA H100 80GB HBM3 tp1 pp1 bfloat16"`` or
    ``"cpu AMD EPYC 7B13 x2 tp1 pp1 float32"``; "" (with one log line) when it cannot be read,
    and then nothing is shared."""
    try:
        parallel = vllm_config.parallel_config
        dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        name = (f"{_device_name()} tp{int(parallel.tensor_parallel_size)} "
                f"pp{int(parallel.pipeline_parallel_size)} {dtype}")
    except Exception as exc:  # an unknown platform or config shape: share no costs, serve on
        log.info("specpilot: hardware not described (%s); step costs are not shared", exc)
        return ""
    return "".join(c for c in name if c.isprintable())[:MAX_HARDWARE_CHARS]


def _device_name() -> str:
    # vLLM's platform names CUDA devices through NVML, without initialising CUDA here.
    from vllm.platforms import current_platform

    name = str(current_platform.get_device_name(0))
    if name != "cpu":
        return name
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"cpu {_cpu_model()} x{cores}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
