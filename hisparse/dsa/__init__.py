"""DSA (DeepSeek-V3.2 sparse attention; GLM-5's shared indexers): one stream per (request, layer), token units.

ops.py        launchers of the indexer, top-k and sparse MLA decode kernels (Triton; Gluon on Hopper)
reference.py  the same in plain torch, and the model's torch decode attention (TorchDsaAttention)
fp8.py        the 656-byte FP8 row (kv_dtype "fp8"): quantise / dequantise, the sparse MLA decode over it
model.py      the DeepSeek-V3.2 / GLM-5 decoder (deepseek_v32, glm_moe_dsa checkpoints)
runtime.py    the engine's DSA side: KernelDsaAttention over the resident pool or the hierarchical cache
"""
