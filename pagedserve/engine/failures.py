"""Which failures end one request and which end the engine.

A failure is *per-request* when it comes from work done for one request alone -- its
detokenization, stop strings, grammar, or its row of the host-side sampling settings.
That request ends with ``finish_reason: "error"`` (its blocks and slot are freed) and the
others continue. Anything else that escapes a step -- the forward pass, the pools'
bookkeeping, a device error even inside per-request work -- is *fatal*: the engine state
can no longer be trusted, so the loop stops and the server exits non-zero for its
supervisor to restart it.
"""

from __future__ import annotations

import torch

FINISH_ERROR = "error"

# A device error leaves the CUDA context unusable, wherever it surfaces. torch raises
# ``AcceleratorError`` for most; older paths raise a ``RuntimeError`` whose message starts
# with one of these (a prefix, so that client text quoted in a message cannot match).
_DEVICE_ERROR_PREFIXES = ("CUDA error", "CUDA driver error", "CUBLAS_STATUS", "cuDNN error",
                          "NCCL error")


class RequestFailedError(RuntimeError):
    """One request failed inside the engine; the engine and the other requests go on."""


def is_fatal(exc: BaseException) -> bool:
    """Whether ``exc`` must stop the engine even when raised by one request's work."""
    if not isinstance(exc, Exception) or isinstance(exc, MemoryError):
        return True
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and str(exc).startswith(_DEVICE_ERROR_PREFIXES)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
