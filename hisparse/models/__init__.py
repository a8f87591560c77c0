"""The three model families with Hugging Face checkpoint names, in plain torch.

    model = load_model(checkpoint_dir, dtype=torch.bfloat16, device="cuda")
    state = model.new_state(batch, capacity)          # per-layer KV, plain tensors
    logits = model.prefill(prompt_ids, state)          # [B, S, V]; chunk_size=... for long prompts
    logits = model.decode(next_tokens, state)          # [B, V], one token per row

Prefill has the family's exact semantics (DSA: per-query indexer top-k as transformers; Quest:
dense; NSA: the three gated branches). Decode calls `model.sparse_attention`, a plain object with the
family's sparse step (dsa_decode.TorchDsaAttention, quest_decode.TorchQuestAttention,
nsa_decode.TorchNsaAttention); assign another object with the same methods to run kernels that read
through the hierarchical cache.
"""
from hisparse.models.loading import build_model, load_model
from hisparse.models.tiny import write_tiny_checkpoint

__all__ = ["build_model", "load_model", "write_tiny_checkpoint"]
