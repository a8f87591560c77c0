"""A server's options checked before anything is built: ValueError naming the bad one."""
from __future__ import annotations

from hisparse.host_pool import as_int
from hisparse.runtime import FamilyRuntime


def check_options(mode: str, modes: tuple, prefill: str, prefetch: bool, disaggregated: bool, prefill_overlap: bool,
                  graph_off_gpu: bool, max_context, prefill_chunk, max_batch, prefix_cache: bool = False
                  ) -> tuple[int, int, int]:
    """A server's mode and prefill options checked, ValueError naming the bad one; its sizes as ints
    (max_context, prefill_chunk, max_batch)."""
    if graph_off_gpu:
        raise ValueError("graph=True needs the model on a CUDA GPU")
    if mode not in modes:
        raise ValueError(f"mode must be one of {modes}, got {mode!r}")
    if prefill not in ("model", "reference"):
        raise ValueError(f"prefill must be 'model' or 'reference', got {prefill!r}")
    if not isinstance(disaggregated, bool):
        raise ValueError(f"disaggregated must be True or False, got {disaggregated!r}")
    if disaggregated and prefill_overlap:
        raise ValueError("disaggregated=True prefills elsewhere: prefill_overlap (beside the decode steps) does not "
                         "apply")
    if not isinstance(prefix_cache, bool):
        raise ValueError(f"prefix_cache must be True or False, got {prefix_cache!r}")
    if disaggregated and prefix_cache:
        raise ValueError("disaggregated=True with prefix_cache=True: every prompt comes prefilled by a prefill worker "
                         "(emulated: off the clock), so a cache on the decode server would save nothing a run "
                         "measures; the workers would need it, and they keep none yet")
    if prefetch and mode != "hisparse":
        raise ValueError(f"prefetch applies to mode 'hisparse' (it overlaps copies), not {mode!r}")
    return (as_int(max_context, "max_context must be an int >= 2 (tokens a request may hold)", 2),
            as_int(prefill_chunk, "prefill_chunk must be an int >= 1 (prompt tokens an iteration)", 1),
            as_int(max_batch, "max_batch must be an int >= 1 (lanes at most)", 1))


def check_overlap(runtime: FamilyRuntime, prefill_overlap: bool, prefill_layers: int,
                  prefill_sms: int | None) -> tuple[int, int | None]:
    """(prefill_layers, prefill_sms) checked: ValueError naming the bad one."""
    if not isinstance(prefill_overlap, bool):
        raise ValueError(f"prefill_overlap must be True or False, got {prefill_overlap!r}")
    prefill_layers = as_int(prefill_layers, "prefill_layers must be an int >= 1 (layers of a prefill piece an "
                            "iteration, with prefill_overlap)", 1)
    if prefill_overlap and not runtime.prefill_beside_decode:
        raise ValueError(f"prefill_overlap=True is built for DSA models, whose empty lanes' decode writes "
                         f"land where no request reads; {runtime.family}'s still write into the lane a "
                         f"prefill fills (Quest's dense lanes at token 0, NSA's window): use prefill_overlap=False")
    if prefill_sms is not None:
        prefill_sms = as_int(prefill_sms, "prefill_sms must be an int >= 1 (SMs the prefill pieces may use, "
                             "with prefill_overlap)", 1)
        if not prefill_overlap:
            raise ValueError(f"prefill_sms={prefill_sms} confines the prefill pieces of prefill_overlap=True "
                             f"to that many SMs; without overlap a prefill runs alone: leave it None")
    return prefill_layers, prefill_sms
