"""What the three families' decoders share: config, checkpoint loading, layers, MoE, tiny checkpoints
(each family's decoder is hisparse/<family>/model.py).

Layers: config.py, layers.py, base.py and moe.py sit below the families (each family's model.py
imports them); loading.py (which family's class a config builds) and tiny.py sit above them, so this
file does not import those two: import them from their modules.

    from hisparse.models.loading import load_model
    model = load_model(checkpoint_dir, dtype=torch.bfloat16, device="cuda")
    state = model.new_state(batch, capacity)          # per-layer KV, plain tensors
    logits = model.prefill(prompt_ids, state)          # [B, S, V]; chunk_size=..., fast=True (kernels)
    logits = model.decode(next_tokens, state)          # [B, V], one token per row
    batch = stack_states([state_a, state_b])           # rows prefilled apart, any lengths

Decode reads positions and lengths from device tensors (`state.lengths`), never from the host, so
once the sparse attention is a kernel the step can be captured in a CUDA graph; the one exception
left is the MoE expert loop (`moe.Experts`), which asks the host which experts were routed to.

Prefill has the family's exact semantics (DSA: per-query indexer top-k as transformers; Quest:
dense; NSA: the three gated branches). Decode calls `model.sparse_attention`, a plain object with the
family's sparse step (the torch references hisparse.dsa.reference.TorchDsaAttention,
hisparse.quest.reference.TorchQuestAttention, hisparse.nsa.reference.TorchNsaAttention); assign
another object with the same methods to run kernels that read through the hierarchical cache.
"""
from hisparse.models.base import DecodeState, stack_states

__all__ = ["DecodeState", "stack_states"]
