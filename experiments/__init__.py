"""Experiments: the sweep over TOML configs, the figures (from results/ alone), the policy study, tools/."""
import kernels_triton  # noqa: F401  first: it chooses Triton's interpreter before anything imports triton
