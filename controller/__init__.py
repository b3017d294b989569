"""The specpilot controller sidecar (``controller.core`` is its pure, I/O-free part)."""

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    """The installed specpilot version: the controller's and the engine plugin's alike."""
    try:
        return version("specpilot")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"
