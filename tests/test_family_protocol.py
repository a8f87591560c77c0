"""The family side of serving is declared: each family's runtime has every attribute and method
`FamilyRuntime` declares, with the declared parameters; its lane prefill has `LanePrefill`'s; and
the serving package uses no runtime member the protocol does not declare (read from its source)."""
import ast
import inspect
import pathlib

import pytest
import torch

from hisparse.engine import family_runtime
from hisparse.models.config import config_from_dict
from hisparse.models.loading import build_model
from hisparse.models.tiny import TINY_CONFIGS
from hisparse.runtime import FamilyRuntime, LanePrefill, LaneStates

SERVING = pathlib.Path(__file__).parents[1] / "hisparse" / "serving"


def declared(protocol) -> dict[str, object]:
    """name -> the protocol's function, or None for a data member."""
    members = {name: None for name in protocol.__annotations__}
    members.update({name: value for name, value in vars(protocol).items()
                    if inspect.isfunction(value) and not name.startswith("_")})
    return members


def conforms(obj, protocol) -> None:
    for name, function in declared(protocol).items():
        assert hasattr(obj, name), f"{type(obj).__name__} lacks {protocol.__name__}.{name}"
        if function is None:
            continue
        want = [p for p in inspect.signature(function).parameters.values() if p.name != "self"]
        have = inspect.signature(getattr(obj, name)).parameters
        for p in want:
            if p.kind is p.VAR_KEYWORD:
                continue
            assert p.name in have, f"{type(obj).__name__}.{name} lacks parameter {p.name}"


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa", "llama", "qwen3", "nsa"])
def test_each_runtime_and_its_lane_prefill_conform(family):
    model = build_model(config_from_dict(TINY_CONFIGS[family])).float()
    runtime = family_runtime(model, token_budget=48 if family in ("llama", "qwen3") else None)
    conforms(runtime, FamilyRuntime)
    for flag in ("prefill_beside_decode", "hybrid_trash_row", "workspace_in_runs", "shared_layers"):
        assert isinstance(getattr(runtime, flag), bool), flag
    assert runtime.row_bytes % runtime.row_dtype.itemsize == 0
    cache = runtime.new_cache(1, 64, max(8, runtime.selection_size))
    lengths = torch.ones(1, dtype=torch.int64)
    layers = runtime.gather_layers("hisparse", cache, runtime.random_rows([torch.zeros(1)], "cpu"), lengths, 64,
                                   False, host_tokens=1)
    lanes = runtime.serving_lanes(layers, torch.zeros(1, dtype=torch.bool))
    assert isinstance(lanes, LaneStates) and lanes.hierarchical and lanes.streams(0)
    for s in lanes.streams(0):
        cache.close_stream(s)
    lanes.clear(0)
    assert lanes.streams(0) == []
    job = runtime.lane_prefill("hisparse", cache, layers, 0, 10, 12)
    conforms(job, LanePrefill)
    job.cancel()


def test_serving_uses_only_declared_runtime_members():
    """Every `runtime.X` (and `self.runtime.X`) in hisparse/serving/ names a member of FamilyRuntime."""
    names = declared(FamilyRuntime)
    used = set()
    for path in SERVING.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and (
                    isinstance(node.value, ast.Name) and node.value.id in ("runtime", "rt")
                    or isinstance(node.value, ast.Attribute) and node.value.attr == "runtime"):
                used.add((path.name, node.attr))
    assert used, "found no runtime use in hisparse/serving/: the check reads nothing"
    undeclared = sorted((f, a) for f, a in used if a not in names)
    assert not undeclared, f"serving uses runtime members FamilyRuntime does not declare: {undeclared}"
