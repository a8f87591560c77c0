"""The @triton.jit (and Gluon) kernels, one file per concern; their launchers and torch references
live in hisparse/. Nothing here imports hisparse.

Without a CUDA GPU the kernels run in Triton's interpreter. Triton chooses when a kernel is defined,
so the choice is made here, once, before any kernel module is imported: every entry point inherits
it (CUDA_VISIBLE_DEVICES= runs a GPU machine's process on the CPU, interpreted)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
