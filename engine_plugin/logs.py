"""The plugin's log lines in vLLM's own output.

vLLM configures only its ``vllm`` logger (its handler, format with timestamps, and
``VLLM_LOGGING_LEVEL``), so without this the plugin's INFO lines ("connected to the controller")
never show, and its warnings go through Python's last-resort handler, bare. At registration the
plugin's loggers take vLLM's handlers and level: the lines read like vLLM's and follow
``VLLM_LOGGING_LEVEL``; with ``VLLM_CONFIGURE_LOGGING=0`` (vLLM configures nothing) they are left
to the user's own logging set-up, as vLLM's are.
"""

from __future__ import annotations

import logging

# Every logger the plugin writes to: its named logger and its modules' own
# (``specpilot.engine_plugin.*``).
PLUGIN_LOGGERS = ("specpilot.plugin", "specpilot.engine_plugin")


def follow_vllm_logging() -> None:
    """Give the plugin's loggers vLLM's handlers and level, once, unless the user configured
    them (they have handlers) or vLLM configured nothing."""
    import vllm.logger  # noqa: F401  (configures the ``vllm`` logger on import)

    source = logging.getLogger("vllm")
    if not source.handlers:
        return
    for name in PLUGIN_LOGGERS:
        logger = logging.getLogger(name)
        if logger.handlers:
            continue
        for handler in source.handlers:
            logger.addHandler(handler)
        logger.setLevel(source.level)
