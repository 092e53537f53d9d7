"""Kernel tests run the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1``; the
interpreter needs one fix with NumPy >= 2.4 (``pagedserve.kernels.interpreter_compat``)."""

from __future__ import annotations

import os

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    from pagedserve.kernels import interpreter_compat

    interpreter_compat.apply()
