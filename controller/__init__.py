"""The specpilot controller sidecar (``controller.core`` is its pure, I/O-free part)."""
