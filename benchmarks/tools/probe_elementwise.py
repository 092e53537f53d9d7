"""The compiled elementwise ops on the 27B shape: every dim dynamic against the token dim only.

``elementwise.compiled_ops`` compiles each op with only the token count dynamic
(``elementwise.token_dynamic``); ``torch.compile(dynamic=True)`` makes every dim symbolic.
This times both forms of each op at prefill row counts on the GPU (CUDA events, median of
20 launches after warm-up) and reports the bytes each moves (inputs read once, output
written once) per second, against the copy bandwidth of one ``torch.Tensor.copy_``.

    python benchmarks/tools/probe_elementwise.py [--rows 2048,8192]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from pagedserve.model import elementwise

HIDDEN, INTER, HQ, HKV, D, ROT, HV, DV = 5120, 17408, 24, 4, 256, 64, 48, 128


def median_us(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def cases(t: int) -> dict[str, tuple]:
    """Each op's arguments for ``t`` tokens, as the 27B layers pass them."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    w = torch.nn.Parameter(torch.randn(HIDDEN, **bf), requires_grad=False)
    wd = torch.nn.Parameter(torch.randn(D, **bf), requires_grad=False)
    wv = torch.nn.Parameter(torch.randn(DV, **bf), requires_grad=False)
    q_gate = torch.randn(t, HQ, 2 * D, **bf)
    q, gate = q_gate.chunk(2, dim=-1)  # strided views, as attention passes them
    cos = torch.randn(t, ROT, **bf)
    a = torch.randn(t, HV, **bf)
    a_log = torch.nn.Parameter(torch.randn(HV, device="cuda"), requires_grad=False)
    return {
        "silu_mul": (torch.randn(t, 2 * INTER, **bf),),
        "add_rms_norm": (torch.randn(t, HIDDEN, **bf), torch.randn(t, HIDDEN, **bf), w, 1e-6),
        "rms_norm": (torch.randn(t, HIDDEN, **bf), w, 1e-6),
        "sigmoid_gate": (torch.randn(t, HQ, D, **bf), gate),
        "qk_norm_rope": (q, torch.randn(t, HKV, D, **bf), wd, wd, cos, cos, 1e-6),
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
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() / median_us(lambda: dst.copy_(src)) / 1e3
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth "
          f"{copy_gbs:.0f} GB/s", flush=True)
    for t in (int(x) for x in args.rows.split(",")):
        for name, call_args in cases(t).items():
            line = []
            for form, ops in forms.items():
                out = ops[name](*call_args)
                want = getattr(elementwise.EAGER, name)(*call_args)
                for o, w in zip(out if isinstance(out, tuple) else (out,),
                                want if isinstance(want, tuple) else (want,)):
                    torch.testing.assert_close(o.float(), w.float(), rtol=2e-2, atol=2e-2)
                us = median_us(lambda: ops[name](*call_args))  # noqa: B023 - timed at once
                gbs = moved_bytes(call_args, out) / us / 1e3
                line.append(f"{form} {us:8.1f} us ({gbs:5.0f} GB/s, {gbs / copy_gbs:4.0%})")
            print(f"{name:15s} rows {t:5d}: " + "   ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
