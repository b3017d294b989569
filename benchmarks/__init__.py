"""Everything that exercises the sidecar without being it: the workload simulator (``sim``), the
demo and the real-engine benchmark (``demo``), benchmark scripts, and the harness pieces the
tests share with them (a controller on a background thread, a synthetic engine client).

The sidecar (``controller``) never imports this package; ``specpilot simulate``, ``demo``,
``models`` and ``bench`` load it only when one of them runs.
"""
