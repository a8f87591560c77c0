"""NSA (Native Sparse Attention): compressed blocks and the window resident, 64-token selection blocks
hierarchical, one stream per (request, layer, KV head). README.md documents its checkpoint format.

ops.py        launchers of the compression, three-branch attention, selection and gate kernels (Triton)
reference.py  the same in plain torch, and the model's torch decode attention (TorchNsaAttention)
model.py      the NSA decoder (our own `nsa` checkpoints)
runtime.py    the engine's NSA side: KernelNsaAttention over the resident pool or the hierarchical cache
"""
