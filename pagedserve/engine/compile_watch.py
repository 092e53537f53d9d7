"""Compiles after the warm-up: each one is a request that waited, so each one is logged.

The warm-up (``warmup.py``) runs one of each kind of step so that no request waits for
Triton to compile a kernel, for an autotuner to time its configurations, or for dynamo to
trace a compiled op. A compile after it means a specialization the warm-up did not reach:
a pointer argument's 16-byte alignment, an integer's divisibility by 16, a new autotune
key, a new dtype. The watch names each one in a warning (the kernel with its
specialization, or the traced function), which is what a fix needs, and counts them.

Two process-wide hooks carry it: Triton's ``jit_post_compile_hook`` (each first launch
of a specialization in this process, compiled or read from Triton's disk cache; an
earlier hook keeps running after it; Triton's encoding of the constants for a hook is
made to tolerate Gluon's layout objects) and dynamo's compile-start callback. They report
only while armed: from the end of a warm-up until the next warm-up starts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_installed = False
_armed = False
_count = 0


def arm() -> None:
    """Report compiles from now on (installs the hooks on first use)."""
    global _armed
    _install()
    _armed = True


def disarm() -> None:
    """Stop reporting (a warm-up's own compiles are expected)."""
    global _armed
    _armed = False


def compiles_after_warm_up() -> int:
    """Compiles reported since the process started."""
    return _count


def _report(what: str) -> None:
    global _count
    if not _armed:
        return
    with _lock:
        _count += 1
    log.warning("compile after warm-up (a request waited for it): %s", what)


def _install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    _install_triton()
    _install_dynamo()


def _install_triton() -> None:
    try:
        import triton
    except ImportError:  # no Triton: nothing of ours compiles through it
        return
    _tolerate_unserializable_constants()
    runtime = triton.knobs.runtime
    previous: Callable[..., Any] | None = runtime.jit_post_compile_hook

    def hook(*args: Any, **kwargs: Any) -> Any:
        _report(describe_triton_compile(kwargs))
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_post_compile_hook = hook


def describe_triton_compile(kwargs: dict[str, Any]) -> str:
    """One line naming what a Triton compile specialized on: the kernel, its launch
    options, the argument types, the constexpr values and the per-argument attributes
    (``tt.divisibility`` 16 on a pointer is its 16-byte alignment; on an integer, its
    divisibility by 16). Any of these differing from the warm-up's is the cause."""
    fn = kwargs.get("fn")
    name = getattr(fn, "name", "?")
    compile_info = kwargs.get("compile") or {}
    signature = compile_info.get("signature") or {}
    constants = compile_info.get("constants") or {}
    configs = compile_info.get("configs") or [{}]
    params = list(signature)

    def param(index: Any) -> str:
        i = index[0] if isinstance(index, tuple) and index else index
        return params[i] if isinstance(i, int) and i < len(params) else str(index)

    types = ", ".join(f"{k}: {v}" for k, v in signature.items() if v != "constexpr")
    consts = ", ".join(f"{param(k)}={_short(v)}" for k, v in constants.items())
    attrs = ", ".join(f"{param(k)}: {_short(v)}" for k, v in (configs[0] or {}).items())
    return (f"Triton kernel {name} [num_warps={compile_info.get('num_warps', '?')}, "
            f"num_stages={compile_info.get('num_stages', '?')}] ({types}) "
            f"constexprs {{{consts}}} attrs {{{attrs}}}")


def _short(value: Any, limit: int = 60) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _tolerate_unserializable_constants() -> None:
    """With a compile hook set, Triton JSON-encodes each new specialization's constants
    for it before calling it, and a Gluon kernel's layout constants (such as
    ``DistributedLinearLayout``) are not JSON: the encoding raises, and the launch fails.
    The encoder is wrapped so that such a specialization's data is ``None`` instead (the
    hook above reads the kernel's name and repr, not this data)."""
    from triton.runtime import jit

    encode = jit.serialize_specialization_data
    if getattr(encode, "_tolerant", False):
        return

    def tolerant(*args: Any, **kwargs: Any) -> str | None:
        try:
            return encode(*args, **kwargs)
        except TypeError:
            return None

    tolerant._tolerant = True  # type: ignore[attr-defined]
    jit.serialize_specialization_data = tolerant


def _install_dynamo() -> None:
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # a torch without the callback API: Triton's hook still reports
        return

    def on_start(*args: Any, **kwargs: Any) -> None:
        _report("torch.compile traces a function (a new guard set: shape, dtype or type)")

    callback_handler.register_start_callback(on_start)
