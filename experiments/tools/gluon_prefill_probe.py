"""Check and time the Gluon prefill sparse MLA kernel (kernels_triton/dsa_gluon_prefill.py) on a Hopper GPU, beside
the Gluon decode kernel the prefill runs today (kernels_triton/dsa_gluon.py through
`hisparse.dsa.ops.launch_gluon_decode`, one split), in one call of under 3 minutes:

    python -m experiments.tools.gluon_prefill_probe [--variants] [--n 4096]

Inputs: N queries (default 4096), 128 heads, k = 2048 rows each, a pool of R = 32768 random bf16 rows (576
values: 512 latent + 64 rope), DeepSeek-V3.2's softmax scale. Each query's rows are its own random 2048 of the
pool, about 10% of them -1; queries 7, 1000 and N - 1 have no valid row, query 3 its first 1000 only.
Checks, each named on its line (PASS or FAIL and why):
- no hang: every launch synchronised under a watchdog (a wrong mbarrier phase deadlocks the kernel; the probe
  then prints FAIL and exits);
- against the torch reference (`hisparse.dsa.reference.sparse_mla_decode_ref`, float32) on 512 of the queries
  (the special ones included), with tests/test_dsa.py's GPU tolerances for the Gluon kernel: out within 2e-2 of
  the largest |out| (bf16), lse within 1e-4 of the largest |lse|, infinities at the same places;
- against the decode kernel on every query, with the same tolerances (not bitwise: the orders differ);
- no valid row: out exactly zero, lse -inf;
- deterministic: a second launch gives the same bits (torch.equal, out and lse);
- row_base, with kv a strided view (row stride 640): request-local rows from row_base give the reference's
  answer and the same bits as the same rows given as global rows of the same pool;
- short selections (k = 40, 64, 100, 320, 2000: less than a tile, one tile, a partial tile, an odd tile count
  with empty first tiles in two queries, 16 rounds) on 256 queries against the reference.
Then both kernels timed with triton.testing.do_bench (ms, TFLOP/s with FLOPs = N * H * k * 2 * (576 + 512),
the ratio); `--variants` also times the prefill kernel's tuning variants (and checks each gives the default's
bits). The last line is PASS or FAIL.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time

import hisparse  # noqa: F401  (imports kernels_triton first, as every entry point must)
import torch
import triton
import triton.testing

from hisparse.dsa import ops as dsa_ops
from hisparse.dsa.reference import sparse_mla_decode_ref
from kernels_triton import dsa_gluon_prefill as pg

SCALE = 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2   # tests/test_dsa.py's DSV32_SCALE
TOL_OUT = 2e-2      # tests/test_dsa.py: TOL[torch.bfloat16], the Gluon kernel's out against the reference
TOL_LSE = 1e-4      # and its lse
H, K, R, D = 128, 2048, 32768, 576
EMPTY = (7, 1000)   # queries with no valid row (and the last one)
SHORT = 3           # a query valid for its first 1000 rows only
VARIANTS = {        # name -> launch_gluon_prefill keywords
    "no consumer fence": {"fence": False},
    "WG1 200 / producer 72 registers": {"consumer_regs": 200, "producer_regs": 72},
    "WG1 216 / producer 56 registers": {"consumer_regs": 216, "producer_regs": 56},
}

failures: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> bool:
    print(f"  {'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        failures.append(name)
    return ok


class Watchdog:
    """Exit the process with FAIL if the block takes longer than `seconds` (a deadlocked kernel never returns)."""

    def __init__(self, what: str, seconds: float = 60.0):
        self.what, self.seconds = what, seconds

    def _fire(self):
        print(f"  FAIL {self.what}: no return after {self.seconds:.0f} s (a deadlocked kernel: barrier phases?)",
              flush=True)
        print("FAIL", flush=True)
        os._exit(3)

    def __enter__(self):
        self.timer = threading.Timer(self.seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()

    def __exit__(self, *exc):
        self.timer.cancel()


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, str]:
    """(max |actual - expected| over max |expected| on the finite entries, "" or what is wrong): tests/test_dsa.py's
    rel_err, with its assertions as messages."""
    actual, expected = actual.float(), expected.float()
    if not torch.equal(torch.isinf(actual), torch.isinf(expected)):
        where = (torch.isinf(actual) != torch.isinf(expected)).nonzero()[:4].tolist()
        return math.inf, f"infinities differ (first at {where})"
    if torch.isnan(actual).any():
        return math.inf, f"NaN in the output (first at {torch.isnan(actual).nonzero()[:4].tolist()})"
    finite = torch.isfinite(expected)
    if not finite.any():
        return 0.0, ""
    err = (actual[finite] - expected[finite]).abs().max() / expected[finite].abs().max().clamp_min(1e-30)
    return err.item(), ""


def check_close(name: str, out, lse, ref_out, ref_lse) -> bool:
    e_out, why_out = rel_err(out, ref_out)
    e_lse, why_lse = rel_err(lse, ref_lse)
    ok = not why_out and not why_lse and e_out < TOL_OUT and e_lse < TOL_LSE
    detail = f"out {e_out:.2e} (tol {TOL_OUT:g}){' ' + why_out if why_out else ''}, " \
             f"lse {e_lse:.2e} (tol {TOL_LSE:g}){' ' + why_lse if why_lse else ''}"
    return check(name, ok, detail)


def reference(q, kv, rows, row_base=None, chunk: int = 64):
    """sparse_mla_decode_ref in chunks of queries (the whole gather would take N * k * 576 float32)."""
    outs, lses = [], []
    for i in range(0, q.shape[0], chunk):
        base = None if row_base is None else row_base[i:i + chunk]
        o, l = sparse_mla_decode_ref(q[i:i + chunk], kv, rows[i:i + chunk], SCALE, row_base=base)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def make_inputs(n: int, k: int, seed: int, pool: torch.Tensor | None = None):
    """q [n, H, 576], kv [R, 576] (or `pool`), rows [n, k] int32: each query's own random k rows of the pool,
    about 10% -1; queries EMPTY and n - 1 none valid and SHORT its first 1000 only, where they exist."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv = pool if pool is not None else torch.randn(R, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    rows = torch.empty(n, k, device="cuda", dtype=torch.int32)
    for i in range(0, n, 512):   # top-k of random keys: k distinct rows a query (512 queries at a time: 64 MiB)
        m = min(512, n - i)
        rows[i:i + m] = torch.rand(m, kv.shape[0], device="cuda", generator=gen).topk(k, dim=1).indices.int()
    rows[torch.rand(n, k, device="cuda", generator=gen) < 0.1] = -1
    for e in EMPTY + (n - 1, ):
        if e < n:
            rows[e] = -1
    if SHORT < n and k > 1000:
        rows[SHORT, 1000:] = -1
    return q, kv, rows


def launch_prefill(q, kv, rows, row_base=None, **tuning):
    out = torch.empty(q.shape[0], q.shape[1], 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(q.shape[0], q.shape[1], device="cuda", dtype=torch.float32)
    pg.launch_gluon_prefill(q, kv, rows, row_base, out, lse, SCALE, **tuning)
    return out, lse


def launch_decode(q, kv, rows, row_base=None):
    out = torch.empty(q.shape[0], q.shape[1], 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(q.shape[0], q.shape[1], device="cuda", dtype=torch.float32)
    dsa_ops.launch_gluon_decode(q, kv, rows, row_base, out, lse, SCALE, 1)
    return out, lse


def synced(what: str, fn, *args, seconds: float = 90.0, **kwargs):
    """fn(*args, **kwargs) synchronised under a watchdog (the first call of a kernel includes its compile)."""
    with Watchdog(what, seconds):
        result = fn(*args, **kwargs)
        torch.cuda.synchronize()
    return result


def correctness(n: int) -> bool:
    print(f"correctness (N {n}, H {H}, k {K}, R {R}):", flush=True)
    # a tiny launch first: compiles the kernel, and a hang shows here in seconds
    q, kv, rows = make_inputs(4, K, seed=1)
    out, lse = synced("first launch (4 queries, compile included)", launch_prefill, q, kv, rows, seconds=120)
    check_close("4 queries against the reference", out, lse, *reference(q, kv, rows))

    q, kv, rows = make_inputs(n, K, seed=2)
    t = time.time()
    out, lse = synced(f"{n} queries", launch_prefill, q, kv, rows)
    print(f"  ({n} queries launched in {time.time() - t:.1f} s)", flush=True)
    special = [i for i in (SHORT, *EMPTY, n - 1) if i < n]
    picked = sorted(set(special) | set(torch.linspace(0, n - 1, 512 - len(special)).long().tolist()))
    idx = torch.tensor(picked, device="cuda")
    t = time.time()
    ref_out, ref_lse = reference(q[idx], kv, rows[idx])
    print(f"  (reference over {len(picked)} queries in {time.time() - t:.1f} s)", flush=True)
    check_close(f"against the reference ({len(picked)} queries, the special ones included)", out[idx], lse[idx],
                ref_out, ref_lse)
    dec_out, dec_lse = synced("decode kernel", launch_decode, q, kv, rows)
    check_close(f"against the Gluon decode kernel (all {n} queries)", out, lse, dec_out, dec_lse)
    empty = [i for i in (*EMPTY, n - 1) if i < n]
    check("no valid row: out zeros, lse -inf",
          bool(torch.all(out[empty] == 0)) and bool(torch.isneginf(lse[empty]).all()),
          f"queries {empty}: max |out| {out[empty].float().abs().max().item():g}, lse {lse[empty].unique().tolist()}")
    out2, lse2 = synced("second launch", launch_prefill, q, kv, rows)
    check("deterministic (a second launch, torch.equal)", torch.equal(out, out2) and torch.equal(lse, lse2),
          f"out differs at {int((out != out2).sum())} places, lse at {int((lse != lse2).sum())}")
    del dec_out, dec_lse, out2, lse2, ref_out, ref_lse

    # row_base over a strided pool: rows local to a region per query (its base), against the global rows' bits
    wide = torch.randn(R, 640, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda")
                       .manual_seed(3))
    pool = wide[:, :D]
    nb = min(n, 1024)
    qb, _, rows_b = make_inputs(nb, K, seed=4, pool=pool[: R // 2])   # rows in [0, R/2): local to the base
    base = torch.randint(0, R // 2 + 1, (nb, ), device="cuda", dtype=torch.int64)
    glob = torch.where(rows_b >= 0, rows_b + base[:, None], -1).int()
    out_b, lse_b = synced("row_base launch", launch_prefill, qb, pool, rows_b, base)
    out_g, lse_g = synced("global rows launch", launch_prefill, qb, pool, glob)
    sub = torch.arange(0, nb, max(1, nb // 128), device="cuda")
    check_close(f"row_base, kv row stride {pool.stride(0)}: against the reference ({len(sub)} queries)",
                out_b[sub], lse_b[sub], *reference(qb[sub], pool, rows_b[sub], row_base=base[sub]))
    check("row_base: the same bits as the same rows given globally",
          torch.equal(out_b, out_g) and torch.equal(lse_b, lse_g),
          f"out differs at {int((out_b != out_g).sum())} places, lse at {int((lse_b != lse_g).sum())}")
    del wide, pool, out_b, lse_b, out_g, lse_g

    for k in (40, 64, 100, 320, 2000):
        qs, kvs, rows_s = make_inputs(256, k, seed=10 + k, pool=kv)
        if k == 320:          # whole empty tiles before valid ones: a round's tile a, then its tile b
            rows_s[0, :64] = -1
            rows_s[1, 64:128] = -1
        o, l = synced(f"k {k}", launch_prefill, qs, kvs, rows_s)
        check_close(f"k {k} (256 queries) against the reference", o, l, *reference(qs, kvs, rows_s))
    return not failures


def timing(n: int, variants: bool) -> None:
    print(f"timing (N {n}, H {H}, k {K}, R {R}; triton.testing.do_bench, median ms):", flush=True)
    q, kv, rows = make_inputs(n, K, seed=5)
    flops = n * H * K * 2 * (D + 512)
    out = torch.empty(n, H, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(n, H, device="cuda", dtype=torch.float32)

    def bench(fn) -> float:
        with Watchdog("timing", 120):
            return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")

    dec = bench(lambda: dsa_ops.launch_gluon_decode(q, kv, rows, None, out, lse, SCALE, 1))
    pre = bench(lambda: pg.launch_gluon_prefill(q, kv, rows, None, out, lse, SCALE))
    print(f"  decode kernel (dsa_gluon, 1 split): {dec:.3f} ms, {flops / dec / 1e9:.1f} TFLOP/s", flush=True)
    print(f"  prefill kernel (dsa_gluon_prefill): {pre:.3f} ms, {flops / pre / 1e9:.1f} TFLOP/s", flush=True)
    print(f"  prefill / decode speed: {dec / pre:.3f}x", flush=True)
    if variants:
        base_out, base_lse = synced("default", launch_prefill, q, kv, rows)
        for name, tuning in VARIANTS.items():
            try:
                o, l = synced(name, launch_prefill, q, kv, rows, **tuning)
                same = torch.equal(o, base_out) and torch.equal(l, base_lse)
                t = bench(lambda: pg.launch_gluon_prefill(q, kv, rows, None, out, lse, SCALE, **tuning))
                print(f"  variant {name}: {t:.3f} ms, {flops / t / 1e9:.1f} TFLOP/s, {dec / t:.3f}x the decode kernel, "
                      f"{'the default bits' if same else 'NOT the default bits'}", flush=True)
                if not same:
                    failures.append(f"variant {name} bits")
            except Exception as exc:  # noqa: BLE001 - a variant that cannot build is reported
                print(f"  variant {name}: failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})", flush=True)
        pre2 = bench(lambda: pg.launch_gluon_prefill(q, kv, rows, None, out, lse, SCALE))
        print(f"  default again: {pre2:.3f} ms", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096, help="queries (default %(default)s)")
    ap.add_argument("--variants", action="store_true", help="also time the prefill kernel's tuning variants")
    args = ap.parse_args(argv)
    start = time.time()
    if not torch.cuda.is_available():
        print("FAIL: no CUDA GPU")
        sys.exit(1)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    probe = torch.empty(1, H, D, device="cuda", dtype=torch.bfloat16)
    reason = pg.prefill_unsupported(probe, torch.empty(1, D, device="cuda", dtype=torch.bfloat16),
                                    torch.empty(1, 1, device="cuda", dtype=torch.int32))
    decode_reason = dsa_ops.gluon_decode_unsupported(probe, 512)
    if reason or decode_reason:
        print(f"  FAIL kernels cannot run here: prefill: {reason}; decode: {decode_reason}")
        print("FAIL")
        sys.exit(1)
    try:
        correct = correctness(args.n)
    except Exception as exc:  # noqa: BLE001 - reported as the failed check
        check("correctness checks ran", False, f"{type(exc).__name__}: {exc}")
        correct = False
    if correct:
        try:
            timing(args.n, args.variants)
        except Exception as exc:  # noqa: BLE001
            check("timing ran", False, f"{type(exc).__name__}: {exc}")
    else:
        print("timing skipped: a correctness check failed", flush=True)
    print(f"({time.time() - start:.0f} s)")
    if failures:
        print(f"failed: {', '.join(failures)}")
    print("FAIL" if failures else "PASS", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
