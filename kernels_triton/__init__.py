"""The @triton.jit (and Gluon) kernels, one file per concern; their launchers and torch references
live in hisparse/. Nothing here imports hisparse.

Without a CUDA GPU the kernels run in Triton's interpreter. Triton chooses when a kernel is defined,
so the choice is made here, once, before any kernel module is imported: every entry point inherits
it (CUDA_VISIBLE_DEVICES= runs a GPU machine's process on the CPU, interpreted).

Two ways the choice comes too late are refused here, saying what to do (the kernels would otherwise
fail later with a Triton InterpreterError that gives no hint): triton imported before this package,
and `hisparse` found as a folder without __init__.py. Python finds that folder where it starts in
the folder above a clone named hisparse: the clone is then `hisparse`, a namespace package, and
hisparse/__init__.py, which imports this package first, never runs. Without an installed package
`python -m hisparse.generate` there stops before any of our code, at "No module named
hisparse.generate"; with one (pip install -e .), the modules come from the install and this check
speaks."""
import importlib.util
import os
import sys

_TRITON_FIRST = "triton" in sys.modules and "TRITON_INTERPRET" not in os.environ

import torch  # noqa: E402  after the look at sys.modules: torch may import triton itself


def _namespace_hisparse() -> str | None:
    """The folder that `import hisparse` takes for the package where it is one without __init__.py."""
    try:
        spec = importlib.util.find_spec("hisparse")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is not None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


if (_folder := _namespace_hisparse()) is not None:
    raise ImportError(f"`import hisparse` finds {_folder}, a folder without __init__.py, not the package (Python "
                      f"started in the folder above a clone named hisparse?): run from the repository root "
                      f"{_folder}, or from any other folder after `pip install -e .` there")
if not torch.cuda.is_available():
    if _TRITON_FIRST:
        raise ImportError("triton was imported before kernels_triton, which chooses Triton's interpreter where no "
                          "CUDA GPU is visible (as here): the kernels would fail in it. Import hisparse (or "
                          "kernels_triton) before triton, or set TRITON_INTERPRET=1")
    os.environ.setdefault("TRITON_INTERPRET", "1")
