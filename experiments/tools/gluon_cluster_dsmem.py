"""The smallest 2-CTA-cluster kernel in Gluon (Triton 3.6, sm_90a) that shares dequantised rows through
distributed shared memory: the building block for an FP8 decode kernel that dequantises each selected row once
for 128 heads instead of once per 64-head program (issue 36; results/notes/fp8.md, "A 2-CTA cluster").

A cluster of 2 CTAs (launch option num_ctas=2) computes S [128, 64] = Q [128, 64] K [64, 64]^T for one request:
CTA r holds query rows r*64 .. r*64+63 (CGA layout [[1, 0]]: split over the pair) and needs all of K, a bf16
tile held whole by both CTAs (CGA layout [[0, 0]]). K arrives as e4m3; each CTA dequantises only K's rows
r*32 .. r*32+31 and writes them into its own tile and into its peer's, then a cluster barrier, then wgmma.
Triton 3.6's Gluon has no API for the cluster rank, a shared buffer's address, remote shared stores or cluster
barriers (newer Triton has `gl.nvidia.hopper.cluster`), so inline PTX does them:
- the rank: %cluster_ctarank;
- the tile's shared address: the module symbol global_smem plus the offset Triton allocated it at (K_OFF; the
  MLIR dump's allocation.offset, checked by `offline`);
- the remote store: mapa.shared::cluster + st.shared::cluster (FlashMLA uses st.async completing the peer's
  mbarrier instead, which needs no memory barrier a step);
- the 128-byte NVMMA swizzle of a bf16 [64, 64] tile by hand: 16-byte unit (col // 8) ^ (row % 8);
- barrier.cluster.arrive.release / wait.acquire.
A store from a layout held whole by both CTAs is predicated to CTA 0, so everything a CTA writes out goes
through a split layout (or inline PTX).

    TRITON_INTERPRET=0 /tmp/t36/bin/python -m experiments.tools.gluon_cluster_dsmem     # compile offline
    python -m experiments.tools.gluon_cluster_dsmem --run                                 # on a Hopper GPU

Offline: the PTX lines that show a cluster launch, the remote stores and the cluster barriers. --run: both
CTAs' K tiles equal the dequantised K bit for bit, and S matches torch.
"""
import argparse
import collections
import os
import re
import subprocess
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from experiments.tools.sass_dsa_gluon import compile_gluon_sm90, sass_text

SPLIT, WHOLE = [[1, 0]], [[0, 0]]     # CGA layouts: dim 0 split over the 2 CTAs; every CTA holds all of it
# module-level constexprs: a cga_layout list written inside a jit function breaks layout equality in 3.6
LOAD_Q = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=SPLIT))     # Q [128, 64]
DEQ = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0], cga_layout=WHOLE))        # K half [32, 64]
LOAD_K = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=WHOLE))     # K [64, 64]
ONE = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0], cga_layout=[[0]]))                   # one value a thread
ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16],
                                             cga_layout=SPLIT))
SHARED_Q = gl.constexpr(gl.NVMMASharedLayout(128, 16, rank=2, cga_layout=SPLIT))
SHARED_K = gl.constexpr(gl.NVMMASharedLayout(128, 16, rank=2, cga_layout=WHOLE))


@gluon.jit
def _cluster_rank(like):
    """This CTA's rank in its cluster, in `like`'s shape and layout."""
    return gl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank;", "=r,r", [like], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _cluster_sync(like):
    """barrier.cluster over every thread of both CTAs, release/acquire at cluster scope (`like`: one value a
    thread, so one asm a thread)."""
    return gl.inline_asm_elementwise(
        "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n\tmov.u32 $0, 0;",
        "=r,r", [like], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _store_here_and_peer(offset, v, peer):
    """8 bf16 (16 bytes) of v at shared byte `offset` (from global_smem) in this CTA and in CTA `peer`
    (offset and peer in v's layout; the first of each 8 is used)."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a, ra;
        mov.u32 a, global_smem;
        add.u32 a, a, $2;
        st.shared.v4.b32 [a], {$10, $11, $12, $13};
        mapa.shared::cluster.u32 ra, a, $14;
        st.shared::cluster.v4.b32 [ra], {$10, $11, $12, $13};
        mov.b32 $0, 0;
        mov.b32 $1, 0;
        }""",
        constraints="=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
        args=[offset, v, peer], dtype=gl.int8, is_pure=False, pack=8)


@gluon.jit
def cluster_dequant_qk(q_ptr, k8_ptr, scale, s_ptr, k_out_ptr, K_OFF: gl.constexpr):
    """q [128, 64] bf16, k8 [64, 64] e4m3 (times `scale`), s [128, 64] float32; k_out [2, 64, 64] bf16: each
    CTA's K tile as it saw it (for the check)."""
    k_s = gl.allocate_shared_memory(gl.bfloat16, [64, 64], SHARED_K)      # first: allocation offset K_OFF
    o_q = gl.arange(0, 128, layout=gl.SliceLayout(1, LOAD_Q))
    c_q = gl.arange(0, 64, layout=gl.SliceLayout(0, LOAD_Q))
    q_s = gl.allocate_shared_memory(gl.bfloat16, [128, 64], SHARED_Q, gl.load(q_ptr + o_q[:, None] * 64 + c_q[None, :]))

    one = gl.arange(0, 128, layout=ONE)
    _cluster_sync(one)                     # the peer runs before anything is written into its shared memory

    r = gl.arange(0, 32, layout=gl.SliceLayout(1, DEQ))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, DEQ))
    rank = _cluster_rank(r[:, None] + c[None, :] * 0)                     # [32, 64]: the same everywhere
    row = rank * 32 + r[:, None]                                           # this CTA's half of K's rows
    v = (gl.load(k8_ptr + row * 64 + c[None, :]).to(gl.float32) * scale).to(gl.bfloat16)
    offset = K_OFF + row * 128 + ((c[None, :] // 8) ^ (row % 8)) * 16     # 128-byte swizzle, bf16 [64, 64]
    _store_here_and_peer(offset, v, 1 - rank)
    fence_async_shared(cluster=True)       # the generic-proxy stores, seen by both CTAs' async proxy (wgmma)
    _cluster_sync(one)                     # both halves are in both tiles

    s = warpgroup_mma(q_s, k_s.permute((1, 0)), gl.zeros([128, 64], gl.float32, ACC))
    o_s = gl.arange(0, 128, layout=gl.SliceLayout(1, ACC))
    c_s = gl.arange(0, 64, layout=gl.SliceLayout(0, ACC))
    gl.store(s_ptr + o_s[:, None] * 64 + c_s[None, :], s)                  # split layout: each CTA its rows
    kk = k_s.load(LOAD_K)
    rk = gl.arange(0, 64, layout=gl.SliceLayout(1, LOAD_K))
    ck = gl.arange(0, 64, layout=gl.SliceLayout(0, LOAD_K))
    me = _cluster_rank(rk[:, None] + ck[None, :] * 0)
    p_out = (k_out_ptr + me * 4096 + rk[:, None] * 64 + ck[None, :]).to(gl.int64, bitcast=True)
    gl.inline_asm_elementwise("st.global.b16 [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,h", [p_out, kk],   # a whole
                              dtype=gl.int32, is_pure=False, pack=1)      # layout's gl.store would be CTA 0's only
    _cluster_sync(one)                     # neither CTA exits while the peer may still write into it


SIGNATURE = {"q_ptr": "*bf16", "k8_ptr": "*fp8e4nv", "scale": "fp32", "s_ptr": "*fp32", "k_out_ptr": "*bf16",
             "K_OFF": "constexpr"}
K_OFF = 0


def compile_offline(k_off: int = K_OFF):
    return compile_gluon_sm90(cluster_dequant_qk, SIGNATURE, {"K_OFF": k_off}, [], num_warps=4, num_ctas=2)


def allocation_offsets() -> dict[str, int]:
    """{buffer: allocation.offset} of the kernel's shared buffers, from the MLIR dump of a compile (a subprocess:
    the dump goes to its stderr)."""
    env = dict(os.environ, MLIR_ENABLE_DUMP="1", TRITON_ALWAYS_COMPILE="1", TRITON_INTERPRET="0")
    code = "from experiments.tools import gluon_cluster_dsmem as t; t.compile_offline()"
    err = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stderr
    return {name: int(off) for name, off in
            re.findall(r"(%\w+) = ttg\.local_alloc[^{]*\{allocation\.offset = (\d+)", err)}


def offline() -> None:
    offsets = allocation_offsets()
    print("shared allocation offsets:", offsets)
    if offsets.get("%k_s") != K_OFF:
        raise SystemExit(f"the K tile sits at {offsets.get('%k_s')}, not K_OFF = {K_OFF}: the remote stores would miss")
    compiled = compile_offline()
    ptx = compiled.asm["ptx"]
    print(f"shared bytes {compiled.metadata.shared}, num_ctas {compiled.metadata.num_ctas}")
    shown = set()
    for line in (line.strip() for line in ptx.splitlines()):
        directive = re.search(r"\.entry|\.explicitcluster|\.reqnctapercluster", line)
        instruction = (line[:1].isalpha() and not line.startswith("ld.param")       # the kernel's name has "cluster"
                       and re.search(r"cluster|mapa|fence\.proxy|wgmma\.mma_async", line))
        if directive or instruction:
            key = re.sub(r"%\w+", "%", line)                    # one line of each kind
            if key not in shown:
                shown.add(key)
                print("  ptx:", line[:140])
    ops = collections.Counter(re.findall(r"\b(MAPA|UCGABAR_\w+|STS\.\w+|ST\.E\.\w+|HGMMA\.\w+)", sass_text(compiled)))
    print("  sass:", dict(ops))


def run() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(128, 64, device="cuda", generator=gen).bfloat16()
    k8 = (torch.randn(64, 64, device="cuda", generator=gen) * 4).to(torch.float8_e4m3fn)
    s = torch.zeros(128, 64, device="cuda")
    k_out = torch.zeros(2, 64, 64, device="cuda", dtype=torch.bfloat16)
    cluster_dequant_qk[(1,)](q, k8, 0.5, s, k_out, K_OFF, num_warps=4, num_ctas=2)
    torch.cuda.synchronize()
    k = (k8.float() * 0.5).bfloat16()
    print("K tile of CTA 0 bitwise:", torch.equal(k_out[0], k), " of CTA 1:", torch.equal(k_out[1], k))
    print("S max abs error against torch:", (s - q.float() @ k.float().T).abs().max().item())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="store_true", help="launch it on this machine's Hopper GPU and check it")
    args = ap.parse_args(argv)
    if args.run:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
            raise SystemExit("--run needs a Hopper GPU (sm_90)")
        run()
    else:
        offline()


if __name__ == "__main__":
    main()
