"""Benchmarks: `python -m benchmarks.bench_NAME` appends rows to out/NAME.csv (git-ignored; `--out results`:
the committed rows) and prints each figure beside its physical limit; gpu_suite.sh runs them all with the GPU tests."""
import kernels_triton  # noqa: F401  first: it chooses Triton's interpreter before anything imports triton
