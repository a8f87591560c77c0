"""Gluon and its Hopper API, imported once for the Gluon kernels (dsa_gluon, dsa_fp8_gluon,
dsa_gluon_prefill): where this Triton lacks them, GLUON_IMPORT_ERROR says why, the names are None, and
the kernel modules still import (their launchers refuse before any launch, naming the reason)."""
from __future__ import annotations

GLUON_IMPORT_ERROR: str | None = None
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except Exception as exc:  # noqa: BLE001 - an older/newer Triton without this Gluon API: import still works
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    gluon = gl = async_copy = fence_async_shared = mbarrier = warpgroup_mma = warpgroup_mma_wait = None
