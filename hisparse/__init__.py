"""HiSparse: an exact hierarchical KV cache for top-k sparse-attention decoding (README.md, DESIGN.md)."""
import kernels_triton  # noqa: F401  first: it chooses Triton's interpreter before anything imports triton
