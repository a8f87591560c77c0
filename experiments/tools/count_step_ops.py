"""Count what one decode step launches, per KV mode, on the CPU: torch ops that run a kernel (views and
allocations left out) and Triton launches. A CUDA graph replays exactly these, so the difference
between modes is the work the hierarchy adds to each step, whatever the GPU.

    python -m experiments.tools.count_step_ops [--family deepseek_v32] [--steps 3]

Runs a tiny random checkpoint (hisparse.models.tiny) through the Triton interpreter, with value
checks off as inside a captured step. Counts are of the last decode step. On a GPU machine run it
as `CUDA_VISIBLE_DEVICES= python -m experiments.tools.count_step_ops` (the interpreter is chosen
where no GPU is visible: kernels_triton/__init__.py).
"""
import argparse
import collections
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.interpreter import GridExecutor

from hisparse.cache import HierarchicalKVCache
from hisparse.engine import Engine, family_runtime
from hisparse.models.loading import load_model
from hisparse.models.tiny import TINY_CONFIGS, write_tiny_checkpoint

NO_KERNEL = {"view", "unsqueeze", "slice", "select", "t", "_unsafe_view", "expand", "as_strided", "reshape",
             "permute", "squeeze", "detach", "alias", "transpose", "split", "split_with_sizes", "unbind",
             "chunk", "lift_fresh", "empty", "empty_strided", "is_pinned", "_local_scalar_dense"}


class StepCounter(TorchDispatchMode):
    """Torch ops outside Triton launches (the interpreter's own tensor work is not the kernel's), and
    Triton launches by kernel name."""

    def __init__(self):
        super().__init__()
        self.ops, self.launches, self._inside = collections.Counter(), collections.Counter(), 0
        counter, run = self, GridExecutor.__call__

        def launch(executor, *args, **kwargs):
            counter.launches[executor.fn.__name__] += 1
            counter._inside += 1
            try:
                return run(executor, *args, **kwargs)
            finally:
                counter._inside -= 1
        self._patch = (GridExecutor, run, launch)

    def __enter__(self):
        GridExecutor.__call__ = self._patch[2]
        return super().__enter__()

    def __exit__(self, *exc):
        GridExecutor.__call__ = self._patch[1]
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._inside and name not in NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def count_mode(model, mode: str, steps: int, prompts) -> StepCounter:
    """The last of `steps` decode steps' launches in `mode`."""
    k = family_runtime(model).selection_size
    engine = Engine(model, mode, cache_slots=None if mode == "resident" else 2 * k)
    counter, decode = StepCounter(), model.decode

    def counted_decode(tokens, state):
        nonlocal counter
        counter = StepCounter()
        with counter:
            return decode(tokens, state)
    model.decode = counted_decode
    try:
        engine.generate(prompts, new_tokens=steps + 1, keep_logits=False)   # the prefill makes the first token
    finally:
        model.decode = decode
    return counter


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="deepseek_v32", choices=sorted(TINY_CONFIGS), help="tiny model family")
    ap.add_argument("--steps", type=int, default=3, help="decode steps (the last one is counted; default 3)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: expected at least 1 decode step")
    if torch.cuda.is_available():
        ap.error("counts the interpreter's launches: run with CUDA_VISIBLE_DEVICES= (no GPU visible)")
    model = load_model(write_tiny_checkpoint(args.family, tempfile.mkdtemp(prefix=args.family), seed=0),
                       dtype=torch.float32, device="cpu")
    # value checks are host syncs (and small torch ops): off, as in a captured step
    unchecked = {name: getattr(HierarchicalKVCache, name)
                 for name in ("resolve", "write_newest", "write_newest_token", "replay_plan")}
    for name, method in unchecked.items():
        setattr(HierarchicalKVCache, name,
                lambda self, *a, _method=method, **k: _method(self, *a, **{**k, "check_values": False}))
    prompts = [torch.arange(40) % 97, torch.arange(25) % 97]
    layers = model.config.num_hidden_layers
    print(f"{args.family} (tiny, {layers} layers): one decode step's launches")
    print(f"{'mode':9s} {'torch ops':>9s} {'triton':>7s} | over resident (the step) | Triton kernels")
    base = None
    try:
        for mode in ("resident", "noio", "hisparse"):
            c = count_mode(model, mode, args.steps, prompts)
            ops, launches = sum(c.ops.values()), sum(c.launches.values())
            base = base or (ops, launches)
            print(f"{mode:9s} {ops:9d} {launches:7d} | {ops - base[0]:+5d} torch, {launches - base[1]:+4d} triton  "
                  f"| {dict(c.launches)}")
    finally:
        for name, method in unchecked.items():
            setattr(HierarchicalKVCache, name, method)


if __name__ == "__main__":
    main()
