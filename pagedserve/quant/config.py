"""Which weights are FP8: the checkpoint's ``quantization_config`` or ``--quantization fp8``.

Accepted ``quantization_config`` (top level of config.json, or inside ``text_config``)::

    {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
     "activation_scheme": "dynamic", "modules_to_not_convert": [...]}

Anything else is rejected at start-up, naming the value. ``activation_scheme`` is accepted
only as ``"dynamic"`` (no stored activation scales): on CUDA, steps of many rows quantize
the activations per token and 128-column group as they run (``kernels/fp8_matmul.py``);
steps of few rows, and the CPU, keep them in the model dtype (docs/fp8.md).

``--quantization fp8`` on an unquantized checkpoint converts, while loading, the same
modules Qwen's published FP8 checkpoints convert: every linear projection of the decoder
layers except the GDN ``in_proj_a`` and ``in_proj_b``; embeddings and ``lm_head`` stay in
the model dtype. Of the MTP draft head (``mtp.*``) the decoder layer's projections are
converted and ``mtp.fc`` stays in the model dtype, as published low-precision checkpoints
keep it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.quant import fp8
from pagedserve.quant.names import QUANTIZATIONS

# Module names (prefix-free) kept in the model dtype by ``--quantization fp8``.
ONLINE_NOT_CONVERTED = ("lm_head", "in_proj_a", "in_proj_b", "mtp.fc")


@dataclass(frozen=True)
class Fp8Config:
    """FP8 block weights.

    Attributes:
        serialized: the checkpoint stores FP8 tensors (else bf16 ones quantized on load).
        modules_to_not_convert: module names, or dotted prefixes or suffixes of them, kept in
            the model dtype (``is_converted``).
    """

    serialized: bool
    modules_to_not_convert: tuple[str, ...]

    def is_converted(self, module: str) -> bool:
        """Whether linear module ``module`` (a checkpoint name without ``.weight``) is FP8.

        An entry matches the module it names, any module under it (``entry.``), and any
        module whose name ends in ``.entry`` -- transformers' rule, on dotted boundaries
        and without regular expressions.
        """
        for entry in self.modules_to_not_convert:
            if module == entry or module.startswith(entry + ".") or module.endswith("." + entry):
                return False
        return True


def parse_quantization(raw: dict[str, Any], requested: str | None) -> Fp8Config | None:
    """The FP8 config for checkpoint config ``raw`` under ``--quantization requested``.

    Raises ``ValueError`` naming the unsupported method, format, block size or scheme.
    """
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(f"quantization {requested!r} is not supported; accepted: {QUANTIZATIONS}")
    text = raw.get("text_config") or {}
    qc = raw.get("quantization_config") or text.get("quantization_config")
    if qc is None:
        return None if requested is None else Fp8Config(False, ONLINE_NOT_CONVERTED)
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported; accepted: 'fp8' "
            "(or use the bf16 weights)"
        )
    checks = (("fmt", "e4m3"), ("activation_scheme", "dynamic"))
    for key, accepted in checks:
        if qc.get(key, accepted) != accepted:
            raise ValueError(
                f"quantization_config.{key} {qc[key]!r} is not supported; accepted: {accepted!r}"
            )
    block = qc.get("weight_block_size")
    if block is None or list(block) != [fp8.BLOCK, fp8.BLOCK]:
        raise ValueError(
            f"quantization_config.weight_block_size {block!r} is not supported; accepted: "
            f"[{fp8.BLOCK}, {fp8.BLOCK}]"
        )
    skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    return Fp8Config(True, tuple(str(m) for m in skip))
