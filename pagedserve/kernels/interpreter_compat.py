"""A fix for the Triton interpreter (``TRITON_INTERPRET=1``), which runs kernels on CPU.

Triton 3.6's interpreter turns scalar tensors into Python ints with ``int(array)`` on
arrays of shape ``(1,)``, which NumPy >= 2.4 rejects; every loop with runtime bounds then
fails. Upstream fixed that line (triton-lang/triton#9171, PR #9172); until a release
carries it, ``apply()`` patches the same line the same way. It changes nothing outside
the interpreter.
"""

from __future__ import annotations


def apply() -> None:
    """Idempotent; safe to call whether or not the interpreter is in use."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_scalar_index_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._scalar_index_fixed = True
    interpreter._patch_lang_tensor = patched
