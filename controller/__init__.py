"""The specpilot controller sidecar (``specpilot.controller.core`` is its pure, I/O-free part)."""
