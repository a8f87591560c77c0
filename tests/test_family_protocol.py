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
from hisparse.runtime import FamilyRuntime, LanePrefill, LaneStates, UnitResolver

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


def instance_attributes(cls) -> set[str]:
    """The attributes a class's __init__ assigns on self."""
    tree = ast.parse(inspect.getsource(cls.__init__).strip())
    return {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


# what serving calls a family's objects, and the declaration each must keep to
RECEIVERS = {"runtime": FamilyRuntime, "lane_prefill": LanePrefill, "lane_states": LaneStates,
             "attention": UnitResolver}


def test_serving_uses_only_declared_family_members():
    """Every `runtime.X`, `lane_prefill.X`, `lane_states.X` and `attention.X` (also as `self.runtime.X`,
    `job.lane_prefill.X`, ...) in hisparse/serving/ names a member its declaration has."""
    names = {key: set(declared(proto)) | (instance_attributes(proto) if proto is UnitResolver else set())
             for key, proto in RECEIVERS.items()}
    used = set()
    for path in SERVING.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            base = node.value
            key = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            if key in RECEIVERS:
                used.add((path.name, key, node.attr))
    assert {key for _, key, _ in used} == set(RECEIVERS), "a receiver is never used: the check reads nothing of it"
    undeclared = sorted((f, k, a) for f, k, a in used if a not in names[k])
    assert not undeclared, f"serving uses family members their declarations lack: {undeclared}"
