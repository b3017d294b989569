"""The installed specpilot version: the controller's and the engine plugin's alike."""

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    try:
        return version("specpilot")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"
