"""Attention-op benchmark of issue 3: paged vs contiguous decode, against torch SDPA.

One run on one GPU measures, side by side (Qwen3.5/3.6 attention: D=256, Hq=24, Hkv=4,
16-token blocks; workloads from shared/BENCHMARKS.md):

- the device copy bandwidth (bytes read + written), the denominator of every fraction;
- with ``--sweep``, a small tuning sweep of the decode launch per K/V type (tile, warps,
  stages, quantized-dot mode, table reads, partition size, occupancy), whose winner runs
  that type's cases; without it, the library's defaults (``default_config``, what the
  engine launches) run them. The sweep scores a geometric mean over three cases, so its
  winner can lose elsewhere on the grid: it proposes, side-by-side probes
  (``probe_decode.py``) decide the defaults;
- uniform batches n_seq {1,2,4,8} x context {4K,16K,64K,128K} x K/V {q4_0,q8_0,f16}:
  paged and contiguous time, paged / contiguous throughput, GB/s on live K/V bytes and
  its fraction of copy bandwidth; for f16 also torch SDPA (``enable_gqa=True``);
- ragged 128K + 7 x 8K at q4_0 and f16 over shuffled physical blocks: paged, contiguous
  (padded to 128K), and for f16 SDPA padded with a mask and SDPA once per sequence;
- the K/V capacity projection (``pagedserve.plan.workload_report``).

Every timed output is checked against the torch reference (max error / max |ref| <= 5e-3),
so a wrong-but-fast configuration cannot pass. Timing method: ``benchmarks/_common.py``.

    python benchmarks/bench_attention.py [--quick] [--sweep] [--out DIR]

Writes DIR/attention.{md,json,png} (default docs/benchmarks), copies them to $OUT when set,
and prints a short table last. ``--dry-run`` runs the whole pipeline at toy sizes on the
CPU under ``TRITON_INTERPRET=1`` (wall-clock timing, numbers meaningless) to check the
script itself without a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import _report  # noqa: E402

from pagedserve.kernels import paged_decode, reference  # noqa: E402
from pagedserve.kernels.decode_plan import (  # noqa: E402
    CONTIGUOUS_TILE_TOKENS,
    WIDE_MAX_BATCH,
    WIDE_MAX_TOKENS,
    DecodeConfig,
    DecodeWorkspace,
    default_config,
    default_occupancy,
)
from pagedserve.kv import formats  # noqa: E402
from pagedserve.kv.formats import KVBlockStorage  # noqa: E402
from pagedserve.kv.memory import KVFootprint  # noqa: E402
from pagedserve.plan import workload_report  # noqa: E402

HQ, HKV, D, BS = 24, 4, 256, 16
SCALE = D**-0.5
TYPES = ("q4_0", "q8_0", "f16")
CHECK_BOUND = 5e-3
RAGGED = (131072,) + (8192,) * 7

# Coordinate descent in this order: the quantized-dot mode first, since it decides how
# many registers a tile holds; then the register cap and programs per SM, since a
# quantized tile loop is a long chain of dependent instructions and hides its latency
# only with enough resident warps.
SWEEP_SPACE = (
    ("quant_dot", ("element", "packed")),
    ("maxnreg", (None, 168)),
    ("occupancy", (1.0, 2.0, 3.0, 4.0, 8.0)),
    ("table_read", ("row", "block")),
    ("table_ahead", (True, False)),
    ("block_n", (32, 64, 128)),
    ("num_warps", (4, 8)),
    ("num_stages", (1, 2, 3)),
    ("min_partition", (128, 256, 512)),
)


@dataclass(frozen=True)
class Sizes:
    """The workloads of one run."""

    n_seqs: tuple[int, ...]
    contexts: tuple[int, ...]
    ragged: tuple[int, ...]
    sweep_cases: tuple[tuple[int, ...], ...]
    sweep_space: tuple
    max_copies: int = 48  # rotating input copies per case


FULL = Sizes((1, 2, 4, 8), (4096, 16384, 65536, 131072), RAGGED,
             (RAGGED, (4096,), (16384,) * 8), SWEEP_SPACE)
QUICK = Sizes((1, 8), (4096, 131072), RAGGED, (RAGGED, (4096,)),
              tuple(s for s in SWEEP_SPACE
                    if s[0] in ("quant_dot", "maxnreg", "occupancy", "table_read", "block_n",
                                "num_warps")))
DRY = Sizes((1, 2), (64, 96), (256,) + (32,) * 7, ((256,) + (32,) * 7, (64,)),
            (("quant_dot", ("element", "packed")), ("block_n", (16, 32))), max_copies=1)


@dataclass
class Inputs:
    """One copy of a case's inputs (cases rotate over several copies)."""

    q: torch.Tensor  # [B, Hq, D] f16
    out: torch.Tensor  # [B, Hq, D] f16
    k: KVBlockStorage
    v: KVBlockStorage
    tables: torch.Tensor  # int32 [B, max_blocks]
    lens: torch.Tensor  # int32 [B]
    lens_list: list[int]
    mask: torch.Tensor | None = None  # bool [B, 1, 1, L]: SDPA over padded K/V
    ref: torch.Tensor | None = None  # float32 [B, Hq, D]: the reference output, once


def _fill(cache: KVBlockStorage, gen: torch.Generator) -> None:
    """Valid random values of the cache's type (dequantized magnitudes around 1)."""
    shape, dev = cache.data.shape, cache.data.device
    if cache.kv_type in ("f16", "bf16"):
        cache.data.normal_(generator=gen)
    elif cache.kv_type == "q8_0":
        cache.data.copy_(torch.randint(-127, 128, shape, generator=gen, device=dev,
                                       dtype=torch.int8))
        cache.scales.uniform_(0.004, 0.012, generator=gen)
    else:
        cache.data.copy_(torch.randint(0, 256, shape, generator=gen, device=dev,
                                       dtype=torch.uint8))
        cache.scales.uniform_(0.06, 0.18, generator=gen)


def placement(num_blocks: int, window: int, gen: torch.Generator) -> torch.Tensor:
    """Physical block of each logical block (``paged_inputs``' ``window``)."""
    noise = torch.randperm(num_blocks, generator=gen)
    if window == 0:
        return noise
    # Sorted by window first, by the random noise within one.
    return torch.argsort(torch.arange(num_blocks) // window * num_blocks + noise)


def paged_inputs(kv_type: str, lens: tuple[int, ...], seed: int, device: str,
                 window: int = 0, block_size: int = BS) -> Inputs:
    """A pool holding exactly the sequences' blocks, in shuffled physical order.
    ``window`` (a what-if of ``probe_decode.py``): 0 shuffles the whole pool; N >= 1
    shuffles only within each run of N consecutive blocks (1: each sequence's blocks
    consecutive, in order). ``block_size``: tokens per block (a what-if too)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    perm = placement(sum(need), window, torch.Generator().manual_seed(seed))
    tables = torch.full((len(lens), max(need)), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[start:start + n].to(torch.int32)
        start += n
    k, v = KVBlockStorage.allocate_pair(kv_type, kv_type, sum(need), block_size, HKV, D,
                                        device=device)  # the library's layout
    _fill(k, gen)
    _fill(v, gen)
    q = torch.randn(len(lens), HQ, D, generator=gen, device=device, dtype=torch.float16)
    return Inputs(q, torch.empty_like(q), k, v, tables.to(device),
                  torch.tensor(lens, dtype=torch.int32, device=device), list(lens))


def contiguous_of(src: Inputs, pad_len: int) -> Inputs:
    """The same values, one block of ``pad_len`` rows per sequence (the padded layout)."""
    B, device = src.tables.shape[0], src.q.device
    bs = src.k.block_size
    pad_len = -(-pad_len // bs) * bs  # whole blocks (only what-if block sizes round up)
    caches = KVBlockStorage.allocate_pair(src.k.kv_type, src.v.kv_type, B, pad_len, HKV, D,
                                          device=device)  # the library's layout, as paged
    for cache, c in zip((src.k, src.v), caches):
        for b in range(B):
            n = -(-src.lens_list[b] // bs)
            ids = src.tables[b, :n].long()
            for dst, part in ((c.data, cache.data), (c.scales, cache.scales)):
                if part is not None:
                    dst[b, :, :n * bs] = part[ids].permute(1, 0, 2, 3).reshape(HKV, n * bs, -1)
    table = torch.arange(B, dtype=torch.int32, device=device)[:, None]
    return Inputs(src.q, torch.empty_like(src.q), caches[0], caches[1], table, src.lens,
                  src.lens_list)


def live_bytes(kv_type: str, lens: tuple[int, ...]) -> int:
    return sum(lens) * HKV * 2 * formats.bytes_per_row(kv_type, D)


def copies_for(nbytes: int, l2_bytes: int, sizes: Sizes) -> int:
    """Input copies so that one round reads at least 4x the L2 cache."""
    return max(1, min(sizes.max_copies, math.ceil(4 * l2_bytes / max(nbytes, 1))))


@dataclass(frozen=True)
class Launch:
    """A decode launch choice: tile config plus the workspace's occupancy. ``config``
    ``None``: the library's choice per call (``default_config`` by type and size)."""

    config: DecodeConfig | None
    occupancy: float

    def as_dict(self) -> dict:
        return {**(asdict(self.config) if self.config else {}), "occupancy": self.occupancy}


def library_launch(kv_type: str) -> tuple[Launch, dict]:
    """The library's launch for ``kv_type`` K and V, and its description: per layout, the
    config from each batch and size on where ``default_config`` changes it (``occupancy``:
    the workspace's, which a config's own lowers)."""
    occupancy = default_occupancy(kv_type, kv_type)
    desc: dict = {}
    for paged, layout in ((True, "paged"), (False, "contiguous")):
        last = None
        for batch in (1, WIDE_MAX_BATCH + 1):
            for n in sorted({0, *(t + 1 for t in WIDE_MAX_TOKENS.values()),
                             CONTIGUOUS_TILE_TOKENS}):
                cfg = default_config(kv_type, kv_type, n, paged=paged, batch=batch)
                if cfg != last:
                    desc[f"{layout}, batch >= {batch}, tokens >= {n}"] = asdict(cfg)
                    last = cfg
    configs = list(desc.values())
    if all(c == configs[0] for c in configs):  # one launch for every case
        desc = configs[0]
    return Launch(None, occupancy), {**desc, "occupancy": occupancy}


class Runner:
    """Runs the op on ``Inputs``, with one workspace per occupancy."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._ws: dict[float, DecodeWorkspace] = {}

    def ours(self, inp: Inputs, launch: Launch) -> None:
        ws = self._ws.get(launch.occupancy)
        if ws is None:
            ws = self._ws[launch.occupancy] = DecodeWorkspace(
                8, HQ, HKV, D, self.device, occupancy=launch.occupancy)
        paged_decode.paged_decode_attention(inp.q, inp.k, inp.v, inp.tables, inp.lens, SCALE,
                                            workspace=ws, out=inp.out, config=launch.config,
                                            validate=False)


def sdpa(inp: Inputs, mode: str) -> torch.Tensor:
    """torch SDPA over contiguous f16 ``[B, Hkv, L, D]``: ``full`` (every sequence fills
    L), ``mask`` (padded, masked) or ``per_seq`` (one call per sequence)."""
    k4, v4 = inp.k.data, inp.v.data
    q4 = inp.q.unsqueeze(2)  # [B, Hq, 1, D]
    if mode == "full":
        return F.scaled_dot_product_attention(q4, k4, v4, scale=SCALE, enable_gqa=True)
    if mode == "mask":
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=inp.mask, scale=SCALE,
                                              enable_gqa=True)
    return torch.cat([
        F.scaled_dot_product_attention(q4[b:b + 1], k4[b:b + 1, :, :n], v4[b:b + 1, :, :n],
                                       scale=SCALE, enable_gqa=True)
        for b, n in enumerate(inp.lens_list)
    ])


def rel_err(out: torch.Tensor, inp: Inputs) -> float:
    """max |out - ref| / max |ref| against the torch reference on ``inp``'s paged K/V."""
    if inp.ref is None:
        inp.ref = reference.paged_decode_attention(
            inp.q.float(), inp.k, inp.v, inp.tables, inp.lens, SCALE).float()
    out = out.reshape(inp.ref.shape).float()
    return float((out - inp.ref).abs().max() / inp.ref.abs().max().clamp_min(1e-6))


def timed(sides: dict[str, list], methods) -> dict[str, dict]:
    """``{side: {method: us}}``: each method times all sides side by side
    (``_common.time_sides``); a failure is recorded and the run goes on."""
    res: dict[str, dict] = {name: {} for name in sides}
    for m in methods:
        try:
            for name, us in _common.time_sides(sides, m).items():
                res[name][m] = us
        except Exception as exc:  # record and go on: one run must give all it can
            for name in sides:
                res[name][m] = None
                res[name][f"{m}_error"] = repr(exc)[:300]
    return res


# ---- tuning sweep -------------------------------------------------------------------------


def _launch_of(params: dict) -> Launch:
    p = dict(params)
    occupancy = p.pop("occupancy")
    p["min_partition"] = max(p["min_partition"], p["block_n"])
    p["min_partition"] -= p["min_partition"] % p["block_n"]
    return Launch(DecodeConfig(**p), occupancy)


class Bench:
    """The measured cases of one run (sizes, device, timing methods)."""

    def __init__(self, sizes: Sizes, device: str, methods: tuple[str, ...], l2: int):
        self.sizes, self.device, self.methods, self.l2 = sizes, device, methods, l2
        self.runner = Runner(device)

    def copies(self, kv_type: str, lens: tuple[int, ...], seed: int = 0,
               window: int = 0, block_size: int = BS) -> list[Inputs]:
        n = copies_for(live_bytes(kv_type, lens), self.l2, self.sizes)
        return [paged_inputs(kv_type, lens, seed + i, self.device, window, block_size)
                for i in range(n)]

    def sweep(self, kv_type: str) -> tuple[Launch, list[dict]]:
        """Coordinate descent over the sweep space; score = geometric mean of the first
        timing method over the sweep cases; a candidate missing the bound scores inf."""
        inputs = [self.copies(kv_type, lens, seed=100) for lens in self.sizes.sweep_cases]
        params = {**asdict(default_config(kv_type, kv_type)),
                  "occupancy": default_occupancy(kv_type, kv_type)}
        log, scores = [], {}

        def score(p: dict) -> float:
            launch = _launch_of(p)
            key = tuple(sorted(launch.as_dict().items()))
            if key not in scores:
                scores[key] = self._score(launch, inputs, kv_type, log)
            return scores[key]

        for name, values in self.sizes.sweep_space:
            if name == "quant_dot" and kv_type in ("f16", "bf16"):
                continue
            params[name] = min(values, key=lambda v: score({**params, name: v}))
        return _launch_of(params), log

    def _score(self, launch: Launch, inputs: list[list[Inputs]], kv_type: str,
               log: list[dict]) -> float:
        times, err = [], None
        try:
            for copies in inputs:
                calls = [lambda i=i: self.runner.ours(i, launch) for i in copies]
                times.append(_common.time_calls(calls, self.methods[0], min_rounds=8,
                                                min_seconds=0.04))
            err = max(rel_err(copies[0].out, copies[0]) for copies in inputs)
            value = math.exp(sum(map(math.log, times)) / len(times))
            value = value if err <= CHECK_BOUND else math.inf
        except Exception as exc:
            value, times = math.inf, [repr(exc)[:200]]
        log.append({"type": kv_type, **launch.as_dict(), "geomean_us": value,
                    "case_us": times, "max_err": err})
        return value

    def uniform_point(self, kv_type: str, n: int, ctx: int, launch: Launch) -> dict:
        lens = (ctx,) * n
        paged = self.copies(kv_type, lens)
        contig = [contiguous_of(p, ctx) for p in paged]
        row = {"kv_type": kv_type, "n_seq": n, "ctx": ctx,
               "live_bytes": live_bytes(kv_type, lens), "copies": len(paged)}
        run = self.runner.ours
        sides = {"paged": [lambda p=p: run(p, launch) for p in paged],
                 "contig": [lambda c=c: run(c, launch) for c in contig]}
        if kv_type == "f16":
            sides["sdpa"] = [lambda c=c: sdpa(c, "full") for c in contig]
        for name, us in timed(sides, self.methods).items():
            row[f"{name}_us"] = us
        row["paged_err"] = rel_err(paged[0].out, paged[0])
        row["contig_err"] = rel_err(contig[0].out, paged[0])
        if kv_type == "f16":
            row["sdpa_err"] = rel_err(sdpa(contig[0], "full"), paged[0])
        return row

    def ragged_case(self, kv_type: str, launch: Launch) -> dict:
        lens = self.sizes.ragged
        paged = paged_inputs(kv_type, lens, 7, self.device)
        contig = contiguous_of(paged, max(lens))
        row = {"kv_type": kv_type, "lens": list(lens), "live_bytes": live_bytes(kv_type, lens),
               "paged_pool_bytes": paged.k.nbytes + paged.v.nbytes,
               "contig_bytes": contig.k.nbytes + contig.v.nbytes}
        run = self.runner.ours
        sides = {"paged": [lambda: run(paged, launch)], "contig": [lambda: run(contig, launch)]}
        if kv_type == "f16":
            col = torch.arange(max(lens), device=self.device)
            contig.mask = (col[None, :] < paged.lens[:, None])[:, None, None, :]  # [B,1,1,L]
            for mode in ("mask", "per_seq"):
                sides[f"sdpa_{mode}"] = [lambda m=mode: sdpa(contig, m)]
        for name, us in timed(sides, self.methods).items():
            row[f"{name}_us"] = us
        row["paged_err"] = rel_err(paged.out, paged)
        row["contig_err"] = rel_err(contig.out, paged)
        if kv_type == "f16":
            for mode in ("mask", "per_seq"):
                row[f"sdpa_{mode}_err"] = rel_err(sdpa(contig, mode), paged)
        return row


def capacity() -> dict:
    kv = KVFootprint(num_layers=16, num_kv_heads=HKV, head_dim=D, cache_type_k="q4_0",
                     cache_type_v="q4_0", block_size=BS)
    return workload_report(kv, list(RAGGED)).as_dict()


def _empty_cache(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def _save_partial(res: dict, path: Path) -> None:
    """Results so far, so that an interrupted run still returns what it measured."""
    text = json.dumps(res, default=str)
    path.write_text(text)
    extra = os.environ.get("OUT")
    if extra and Path(extra).resolve() != path.parent.resolve():
        Path(extra).mkdir(parents=True, exist_ok=True)
        (Path(extra) / path.name).write_text(text)


def run(sizes: Sizes, device: str, methods: tuple[str, ...], sweep: bool,
        partial: Path) -> dict:
    t0 = time.time()
    meta = _common.run_meta()
    print(f"{meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  {meta['commit']}")
    res: dict = {"meta": meta, "shape": dict(Hq=HQ, Hkv=HKV, D=D, block_size=BS),
                 "check_bound": CHECK_BOUND, "methods": list(methods)}
    res["copy_bandwidth_gbs"] = _common.copy_bandwidth_gbs(1 << 31 if device == "cuda" else
                                                           1 << 24)
    print(f"copy bandwidth {res['copy_bandwidth_gbs']:.0f} GB/s")
    bench = Bench(sizes, device, methods, meta["l2_bytes"])

    # One sweep per storage type: q8_0 moves twice q4_0's bytes per value, so its best
    # tile need not be q4_0's.
    launches, res["sweep"], res["launch"] = {}, [], {}
    for kv_type in TYPES:
        if not sweep:
            launches[kv_type], res["launch"][kv_type] = library_launch(kv_type)
            continue
        launches[kv_type], log = bench.sweep(kv_type)
        _empty_cache(device)
        res["sweep"] += log
        res["launch"][kv_type] = launches[kv_type].as_dict()
        print(f"sweep {kv_type}: {res['launch'][kv_type]}  ({time.time() - t0:.0f} s)")
    _save_partial(res, partial)

    res["uniform"] = []
    for kv_type in TYPES:
        launch = launches[kv_type]
        for ctx in sizes.contexts:
            for n in sizes.n_seqs:
                row = bench.uniform_point(kv_type, n, ctx, launch)
                _empty_cache(device)
                res["uniform"].append(row)
                _save_partial(res, partial)
                print(f"uniform {kv_type:5s} n={n} ctx={ctx:6d}  paged {row['paged_us']}  "
                      f"contig {row['contig_us']}  ({time.time() - t0:.0f} s)")
    res["ragged"] = []
    for kv_type in ("q4_0", "f16"):
        launch = launches[kv_type]
        res["ragged"].append(bench.ragged_case(kv_type, launch))
        _empty_cache(device)
        print(f"ragged {kv_type}: paged {res['ragged'][-1]['paged_us']}")
    res["capacity"] = capacity()
    res["targets"] = _report.targets(res)
    res["elapsed_s"] = time.time() - t0
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller grid and sweep")
    ap.add_argument("--sweep", action="store_true",
                    help="tune the launch per type first (else the library's defaults)")
    ap.add_argument("--dry-run", action="store_true",
                    help="toy sizes on the CPU under TRITON_INTERPRET=1 (checks the script)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output directory (default docs/benchmarks; dry run: /tmp)")
    args = ap.parse_args(argv)
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--dry-run needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        sizes, device, methods = DRY, "cpu", ("eager",)
        out = args.out or Path("/tmp/pagedserve_bench_dry_run")
    elif not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    else:
        sizes, device, methods = (QUICK if args.quick else FULL), "cuda", _common.METHODS
        out = args.out or Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    res = run(sizes, device, methods, sweep=args.sweep,
              partial=out / "attention.partial.json")
    paths = _common.write_outputs(out, "attention", res, _report.markdown(res),
                                  lambda p: _report.figure(res, p))
    (out / "attention.partial.json").unlink(missing_ok=True)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "attention.partial.json").unlink(missing_ok=True)
    print("wrote " + ", ".join(str(p) for p in paths))
    print(_report.short_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
