"""Quest (llama, qwen3 checkpoints): 16-token pages per KV head, page bounds resident, pages hierarchical.

ops.py        launchers of the page-bound, page-score, selection and paged-attention kernels (Triton)
reference.py  the same in plain torch, and the model's torch decode attention (TorchQuestAttention)
model.py      the Llama / Qwen3 decoder with Quest decode layers
runtime.py    the engine's Quest side: KernelQuestAttention over the resident pool or the hierarchical cache
"""
