"""The compiled elementwise ops on the 27B shape: every dim dynamic against the token dim only.

``elementwise.compiled_ops`` compiles each op with only the token count dynamic
(``elementwise.token_dynamic``); ``torch.compile(dynamic=True)`` makes every dim symbolic.
This times both forms of each op at prefill row counts on the GPU, side by side
(``_common.time_sides``, eager launches) and reports the bytes each moves (inputs read
once, output written once) per second, against the copy bandwidth.

    python benchmarks/tools/probe_elementwise.py [--rows 2048,8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import _common  # noqa: E402

from pagedserve.model import elementwise  # noqa: E402

HIDDEN, INTER, HQ, HKV, D, ROT, HV, DV = 5120, 17408, 24, 4, 256, 64, 48, 128


def cases(t: int) -> dict[str, tuple]:
    """Each op's arguments for ``t`` tokens, as the 27B layers pass them."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    w = torch.nn.Parameter(torch.randn(HIDDEN, **bf), requires_grad=False)
    wd = torch.nn.Parameter(torch.randn(D, **bf), requires_grad=False)
    wv = torch.nn.Parameter(torch.randn(DV, **bf), requires_grad=False)
    q_gate = torch.randn(t, HQ, 2 * D, **bf)
    q, gate = q_gate.chunk(2, dim=-1)  # strided views, as attention passes them
    angle = torch.rand(t, ROT, device="cuda") * 6.3  # RoPE's tables hold cos and sin
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    a = torch.randn(t, HV, **bf)
    a_log = torch.nn.Parameter(torch.randn(HV, device="cuda"), requires_grad=False)
    return {
        "silu_mul": (torch.randn(t, 2 * INTER, **bf),),
        "add_rms_norm": (torch.randn(t, HIDDEN, **bf), torch.randn(t, HIDDEN, **bf), w, 1e-6),
        "rms_norm": (torch.randn(t, HIDDEN, **bf), w, 1e-6),
        "sigmoid_gate": (torch.randn(t, HQ, D, **bf), gate),
        "qk_norm_rope": (q, torch.randn(t, HKV, D, **bf), wd, wd, cos, sin, 1e-6),
        "gated_rms_norm": (torch.randn(t, HV, DV, **bf), torch.randn(t, HV, DV, **bf), wv,
                           1e-6),
        "gdn_gates": (a, a, a_log, a_log),
    }


def moved_bytes(args: tuple, out) -> int:
    outs = out if isinstance(out, tuple) else (out,)
    return sum(x.numel() * x.element_size() for x in (*args, *outs)
               if isinstance(x, torch.Tensor) and x.dim() >= 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="2048,8192")
    args = p.parse_args()
    torch._dynamo.config.recompile_limit = 64
    forms = {
        "all dims dynamic": {n: torch.compile(getattr(elementwise.EAGER, n), dynamic=True,
                                              fullgraph=True) for n in cases(2)},
        "token dim dynamic": {n: elementwise.token_dynamic(getattr(elementwise.EAGER, n))
                              for n in cases(2)},
    }
    copy_gbs = _common.copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth "
          f"{copy_gbs:.0f} GB/s", flush=True)
    for t in (int(x) for x in args.rows.split(",")):
        for name, call_args in cases(t).items():
            want = getattr(elementwise.EAGER, name)(*call_args)
            exact = getattr(elementwise.EAGER, name)(*(  # the oracle: float64 throughout
                x.double() if isinstance(x, torch.Tensor) else x for x in call_args))
            for ops in forms.values():
                out = ops[name](*call_args)
                for o, w in zip(out if isinstance(out, tuple) else (out,),
                                exact if isinstance(exact, tuple) else (exact,)):
                    torch.testing.assert_close(o.double(), w, rtol=2e-2, atol=2e-2)
            us = _common.time_sides(
                {form: [lambda op=ops[name]: op(*call_args)]  # noqa: B023 - timed at once
                 for form, ops in forms.items()}, "eager")
            nbytes = moved_bytes(call_args, want)
            print(f"{name:15s} rows {t:5d}: " + "   ".join(
                f"{form} {us[form]:8.1f} us ({nbytes / us[form] / 1e3:5.0f} GB/s, "
                f"{nbytes / us[form] / 1e3 / copy_gbs:4.0%})" for form in forms), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
