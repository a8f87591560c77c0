"""Every command module under benchmarks/ and experiments/ (found by globbing: a new file is covered)
imports on the CPU without running its main(), and every `from <project module> import NAME` in it,
those inside functions too, names something that module has: a function moved elsewhere cannot leave
an import behind it broken, even one kept lazy because it only runs on a GPU.

And the arrows point down: kernels_triton < hisparse < benchmarks < experiments, each importing only
from its own layer and those below (every import in every file, at any depth)."""
import ast
import os
import subprocess
import importlib
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
LAYERS = ("kernels_triton", "hisparse", "benchmarks", "experiments")     # lowest first
COMMANDS = sorted(path for folder in ("benchmarks", "experiments", "experiments/tools")
                  for path in (REPO / folder).glob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import of a project module in the file, at any depth (`import
    a.b` as module a.b without names)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in LAYERS:
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names if alias.name.split(".")[0] in LAYERS]
    return found


def test_the_glob_finds_the_commands():
    names = {module_name(path) for path in COMMANDS}
    assert {"benchmarks.summary", "benchmarks.bench_attention_dsa", "experiments.sweep",
            "experiments.tools.sass_dsa_gluon"} <= names


@pytest.mark.parametrize("path", COMMANDS, ids=lambda path: str(path.relative_to(REPO)))
def test_each_command_module_imports_without_running(path, monkeypatch):
    # a main() run at import would parse this and exit
    monkeypatch.setattr(sys, "argv", [module_name(path), "--not-an-option-of-any-command"])
    try:
        importlib.import_module(module_name(path))
    except SystemExit as exc:
        pytest.fail(f"importing {module_name(path)} ran a command (exit {exc.code})")


@pytest.mark.parametrize("path", COMMANDS, ids=lambda path: str(path.relative_to(REPO)))
def test_each_project_name_a_command_imports_exists(path):
    missing = []
    for line, module, names in project_imports(path):
        imported = importlib.import_module(module)
        for name in names:
            if name == "*" or hasattr(imported, name):
                continue
            try:                                  # `from package import submodule`
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"line {line}: from {module} import {name}")
    assert not missing, f"{path.relative_to(REPO)} imports names its modules do not define: {missing}"


@pytest.mark.parametrize("layer", LAYERS)
def test_no_layer_imports_from_a_layer_above(layer):
    above = LAYERS[LAYERS.index(layer) + 1:]
    upward = [f"{path.relative_to(REPO)}:{line}: {module}" for path in sorted((REPO / layer).rglob("*.py"))
              for line, module, _ in project_imports(path) if module.split(".")[0] in above]
    assert not upward, f"{layer} imports from {', '.join(above)}: {upward}"


# as setuptools' editable install (pip install -e .) finds the project's modules: after the path, by name
EDITABLE_FINDER = """
import sys
from importlib.machinery import PathFinder
sys.meta_path = [f for f in sys.meta_path if "editable" not in getattr(f, "__name__", type(f).__name__).lower()]
sys.path = [p for p in sys.path if "__editable__" not in p]
sys.path_importer_cache.clear()
class Editable:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] not in ("hisparse", "kernels_triton"):
            return None
        parent = name.rpartition(".")[0]
        return PathFinder.find_spec(name, [str(REPO / parent.replace(".", "/")) if parent else str(REPO)])
sys.meta_path.append(Editable)
"""


def run_python(code: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    script = f"from pathlib import Path\nREPO = Path({str(REPO)!r})\n{code}"
    return subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {}))


def test_the_folder_above_a_clone_named_hisparse_is_named_on_import(tmp_path):
    """From there `hisparse` is the clone folder, a namespace package: its __init__ (which chooses Triton's
    interpreter first) never ran, and the first kernel failed with a Triton InterpreterError."""
    (tmp_path / "hisparse").symlink_to(REPO, target_is_directory=True)
    run = run_python(EDITABLE_FINDER + "import hisparse.engine\n", tmp_path)
    assert run.returncode == 1
    assert run.stderr.rstrip().splitlines()[-1] == (
        f"ImportError: `import hisparse` finds {tmp_path / 'hisparse'}, a folder without __init__.py, not the package "
        f"(Python started in the folder above a clone named hisparse?): run from the repository root "
        f"{tmp_path / 'hisparse'}, or from any other folder after `pip install -e .` there")
    run = run_python(EDITABLE_FINDER + "import hisparse.engine\nprint('imported')\n", tmp_path / "hisparse")
    assert run.returncode == 0 and run.stdout == "imported\n", run.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen only where no GPU is visible")
def test_triton_imported_before_the_interpreter_choice_is_named(tmp_path):
    """Its kernels used to fail in the interpreter with "Cannot call @triton.jit'd outside of the scope of a
    kernel"."""
    run = run_python("import triton\nimport hisparse\n", REPO)
    assert run.returncode == 1
    assert run.stderr.rstrip().splitlines()[-1] == (
        "ImportError: triton was imported before kernels_triton, which chooses Triton's interpreter where no CUDA "
        "GPU is visible (as here): the kernels would fail in it. Import hisparse (or kernels_triton) before "
        "triton, or set TRITON_INTERPRET=1")
    assert run_python("import triton\nimport hisparse\n", REPO, {"TRITON_INTERPRET": "1"}).returncode == 0
