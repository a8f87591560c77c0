"""DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`): MLA with the lightning indexer (DSA).

Semantics are those of transformers' eager `DeepseekV32ForCausalLM` / `GlmMoeDsaForCausalLM`:
prefill attends, for every query, to the top-`index_topk` earlier tokens its indexer picked;
`glm_moe_dsa` layers marked "shared" reuse the selection of the last "full" layer and have no
indexer weights; the indexer's RoPE is half-split for deepseek_v32 and interleaved for glm_moe_dsa.
Decode runs the indexer and absorbed MLA through `DsaModel.sparse_attention` (see reference.py).
A state made with kv_dtype "fp8" (`new_state`) stores every latent row as hisparse.dsa.fp8's
656-byte row; prefill then attends over those stored rows (the kernel dequantises them, as decode does).
With index_dtype "fp8" it stores the indexer keys as hisparse.dsa.fp8_index's e4m3 keys, and every
indexer (prefill and decode, kernels and torch) scores them with an e4m3 query, as DeepSeek-V3.2 does.
"""
import torch
from torch import nn

from hisparse.dsa import fp8, fp8_index
from hisparse.dsa.reference import MlaKV, TorchDsaAttention, stable_topk
from hisparse.models.base import CausalLM, DecoderLayer, DecodeState, Step
from hisparse.models.config import DsaConfig
from hisparse.models.layers import (
    GatedMLP,
    RMSNorm,
    Rotary,
    mla_softmax_scale,
    rope_half,
    rope_interleaved,
    softmax_attention,
)
from hisparse.models.moe import MoE
from kernels_triton.dsa_gluon_prefill import prefill_unsupported, sparse_mla_prefill_gluon

PREFILL_QUERIES = 8192       # queries per sparse MLA launch in prefill


def per_head_matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """out[b, s, h] = x[b, s, h] @ w[h] for x [B, S, H, I], w [H, I, O], out [B, S, H, O] (a view of a
    wider buffer is fine): one batched matmul over heads, written in place. The einsum it replaces
    returns a head-major result that a later cat or reshape copies (a 4K-token chunk's absorbed
    queries are 0.6 GB at 128 heads)."""
    b, s, h, _ = x.shape
    torch.bmm(x.reshape(b * s, h, -1).transpose(0, 1), w, out=out.view(b * s, h, -1).transpose(0, 1))


class Indexer(nn.Module):
    def __init__(self, config: DsaConfig):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.rope = rope_interleaved if config.model_type == "glm_moe_dsa" else rope_half
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.softmax_scale = self.head_dim ** -0.5

    def _roped(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.rope(x[..., : self.rope_dim], cos, sin), x[..., self.rope_dim:]], dim=-1)

    def project(self, x, q_resid, cos, sin):
        """Roped queries [B, S, Hi, Di], roped keys [B, S, Di], float32 head weights [B, S, Hi]."""
        b, s, _ = x.shape
        q = self._roped(self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim), cos[:, :, None], sin[:, :, None])
        k = self._roped(self.k_norm(self.wk(x)), cos, sin)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
        return q, k, weights

    def prefill_topk(self, q, keys, weights, causal, scales=None):
        """Top-k token ids [B, S, min(topk, T)] per query; causal [S, T] True where allowed. FP8 keys
        (e4m3 [B, T, Di] with scales [B, T]): `fp8_index.fp8_scores_ref`, the queries quantised."""
        if scales is not None:
            index_scores = fp8_index.fp8_scores_ref(q, weights * self.softmax_scale, keys, scales)   # [B, S, T]
        else:
            scores = torch.relu(torch.matmul(q.float(), keys.float().transpose(-1, -2)[:, None]) * self.softmax_scale)
            index_scores = torch.matmul(weights[:, :, None, :], scores).squeeze(-2)  # [B, S, T]
        index_scores = index_scores.masked_fill(~causal, float("-inf"))
        return stable_topk(index_scores, min(self.topk, keys.shape[1]))


class MlaAttention(nn.Module):
    def __init__(self, config: DsaConfig, layer_idx: int, rotary: Rotary, owner: "DsaModel"):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.dn, self.dr, self.dv = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.dc = config.kv_lora_rank
        bias = config.attention_bias
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.n_heads * (self.dn + self.dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.dc + self.dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.dc, 1e-6)
        self.kv_b_proj = nn.Linear(self.dc, self.n_heads * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.dv, config.hidden_size, bias=bias)
        self.indexer = Indexer(config) if config.indexer_types[layer_idx] == "full" else None
        self.scaling = mla_softmax_scale(config.rope_parameters, self.dn + self.dr)
        self._rotary = (rotary,)  # a tuple: shared by every layer, not a submodule
        self._owner = (owner,)

    def new_kv(self, batch: int, capacity: int, device, dtype, kv_dtype: str = "bf16",
               index_dtype: str = "bf16") -> MlaKV:
        """Zero state; latents in `dtype`, or with kv_dtype "fp8" as uint8 656-byte rows; index keys in
        `dtype`, or with index_dtype "fp8" as e4m3 values and float32 scales (`fp8_index`)."""
        if fp8.check_kv_dtype(kv_dtype) == "fp8":
            latent = torch.zeros(batch, capacity, fp8.ROW_BYTES, device=device, dtype=torch.uint8)
        else:
            latent = torch.zeros(batch, capacity, self.dc + self.dr, device=device, dtype=dtype)
        keys = scales = None
        if self.indexer is not None and fp8_index.check_index_dtype(index_dtype) == "fp8":
            keys = torch.zeros(batch, capacity, self.indexer.head_dim, device=device, dtype=fp8_index.FP8)
            scales = torch.zeros(batch, capacity, device=device, dtype=torch.float32)
        elif self.indexer is not None:
            keys = torch.zeros(batch, capacity, self.indexer.head_dim, device=device, dtype=dtype)
        return MlaKV(latent=latent, index_keys=keys, index_scales=scales)

    def forward(self, x: torch.Tensor, step: Step, kv: MlaKV) -> torch.Tensor:
        b, s, _ = x.shape
        cos, sin = self._rotary[0](step.positions, x.dtype)  # [B, S, Dr]
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.dc, self.dr], dim=-1)
        index_k = None
        if self.indexer is not None:
            index_q, index_k, index_w = self.indexer.project(x, q_resid, cos, sin)
        latent = torch.cat([self.kv_a_layernorm(c), rope_interleaved(k_rot, cos, sin)], dim=-1)
        kv.write(step.positions, latent, index_k)
        if step.decode and self.indexer is not None:
            step.shared["selection"] = self._owner[0].sparse_attention.select(
                self.layer_idx, index_q[:, 0], index_w[:, 0], kv, step.lengths, self.indexer.topk,
                self.indexer.softmax_scale)
        q = self.q_b_proj(q_resid).view(b, s, self.n_heads, self.dn + self.dr)
        q_nope, q_rot = q[..., : self.dn], rope_interleaved(q[..., self.dn:], cos[:, :, None], sin[:, :, None])
        if step.decode:
            out = self._decode_attention(q_nope[:, 0], q_rot[:, 0], kv, step.lengths, step.shared["selection"])
        elif step.fast:
            end = step.start + s
            if self.indexer is not None:            # relu(scale * q.k) = scale * relu(q.k): the scale in the weights
                weights = index_w * self.indexer.softmax_scale
                scales = kv.index_scales
                step.shared["selection"] = torch.stack([                                 # [B, S, k] int32
                    fp8_index.prefill_select_stored(index_q[row], weights[row], kv.index_keys[row, :end],
                                                    step.start, self.indexer.topk,
                                                    None if scales is None else scales[row, :end])
                    for row in range(b)])
            out = self._prefill_absorbed(q_nope, q_rot, kv.latent[:, :end], step.shared["selection"], step.backend)
        else:
            end = step.start + s
            causal = step.positions[0, :, None] >= torch.arange(end, device=x.device)[None, :]  # [S, T]
            if self.indexer is not None:
                scales = None if kv.index_scales is None else kv.index_scales[:, :end]
                step.shared["selection"] = self.indexer.prefill_topk(index_q, kv.index_keys[:, :end], index_w, causal,
                                                                     scales)
            out = self._prefill_attention(q_nope, q_rot, kv.latent[:, :end], causal, step.shared["selection"])
        return self.o_proj(out.reshape(b, s, self.n_heads * self.dv))

    def _prefill_attention(self, q_nope, q_rot, latent, causal, topk_ids):
        """Expanded MLA (as transformers) under the causal and top-k masks: [B, S, H, Dv] (FP8 rows
        dequantised to q's dtype first)."""
        if latent.dtype == torch.uint8:
            latent = fp8.from_rows(latent, q_nope.dtype)
        b, t, _ = latent.shape
        k_nope, v = self.kv_b_proj(latent[..., : self.dc]).view(b, t, self.n_heads, -1).split([self.dn, self.dv], -1)
        k_rot = latent[:, :, None, self.dc:].expand(-1, -1, self.n_heads, -1)
        keys = torch.cat([k_nope, k_rot], dim=-1).transpose(1, 2)  # [B, H, T, Dqk]
        query = torch.cat([q_nope, q_rot], dim=-1).transpose(1, 2)  # [B, H, S, Dqk]
        selected = torch.zeros(b, *causal.shape, dtype=torch.bool, device=latent.device)
        mask = selected.scatter(-1, topk_ids, True) & causal  # [B, S, T]
        out = softmax_attention(query, keys, v.transpose(1, 2), self.scaling, mask[:, None])
        return out.transpose(1, 2)

    def _prefill_absorbed(self, q_nope, q_rot, latent, selection, backend: str):
        """Absorbed MLA of each query over its own selected latents, through the decode kernel (one
        query per row list, PREFILL_QUERIES at a time: the kernel's grid holds at most 65535 rows):
        q_nope [B, S, H, Dn], latent [B, T, Dc + Dr] (or uint8 [B, T, 656] FP8 rows, through the FP8
        kernel), selection [B, S, k] int32 (-1 pads) -> [B, S, H, Dv]. The latents are the ones
        written once per token, never expanded."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.dn + self.dv, self.dc)
        b, s, h, _ = q_nope.shape
        q = torch.empty(b, s, h, self.dc + self.dr, dtype=q_nope.dtype, device=q_nope.device)   # [B, S, H, Dc + Dr]
        per_head_matmul(q_nope, w[:, : self.dn], q[..., : self.dc])     # absorbed in place: no [B, S, H, Dc] copy
        q[..., self.dc:] = q_rot
        out = torch.empty(b, s, h, self.dc, dtype=q.dtype, device=q.device)                   # [B, S, H, Dc]
        for row in range(b):
            for start in range(0, s, PREFILL_QUERIES):
                part = slice(start, start + PREFILL_QUERIES)
                q_part, rows = q[row, part], selection[row, part]
                if backend == "auto" and prefill_unsupported(q_part, latent[row], rows) is None:  # Hopper, bf16
                    sparse_mla_prefill_gluon(q_part, latent[row], rows, self.scaling, out=out[row, part])
                else:
                    fp8.sparse_mla_decode_stored(q_part, latent[row], rows, self.scaling, d_v=self.dc,
                                                 out=out[row, part], backend=backend)
        values = torch.empty(b, s, h, self.dv, dtype=q.dtype, device=q.device)                # [B, S, H, Dv]
        per_head_matmul(out, w[:, self.dn:].transpose(1, 2), values)
        return values

    def _decode_attention(self, q_nope, q_rot, kv: MlaKV, lengths, selection):
        """Absorbed MLA for one token: q_nope [B, H, Dn] -> [B, 1, H, Dv]."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.dn + self.dv, self.dc)
        q_latent = torch.einsum("bhn,hnc->bhc", q_nope, w[:, : self.dn])
        out_latent = self._owner[0].sparse_attention.attend(self.layer_idx, q_latent, q_rot, kv, lengths,
                                                              selection, self.scaling)
        return torch.einsum("bhc,hvc->bhv", out_latent, w[:, self.dn:])[:, None]


class DsaModel(CausalLM):
    """`DeepseekV32ForCausalLM` / `GlmMoeDsaForCausalLM` weights; `sparse_attention` is swappable."""

    keep_in_float32 = ("indexer.weights_proj.", "mlp.gate.")

    def __init__(self, config: DsaConfig):
        rotary = Rotary(config.rope_parameters, config.qk_rope_head_dim)
        layers = []
        for i in range(config.num_hidden_layers):
            mlp = MoE(config) if config.mlp_layer_types[i] == "sparse" else GatedMLP(config.hidden_size,
                                                                                      config.intermediate_size)
            layers.append(DecoderLayer(MlaAttention(config, i, rotary, self), mlp, config.hidden_size,
                                       config.rms_norm_eps))
        super().__init__(config, layers)
        self.rotary = rotary
        self.sparse_attention = TorchDsaAttention()

    def new_state(self, batch: int, capacity: int, kv_dtype: str = "bf16", index_dtype: str = "bf16") -> DecodeState:
        """An empty state; kv_dtype "fp8" stores the latents as FP8 rows, index_dtype "fp8" the indexer
        keys as FP8 keys (`MlaAttention.new_kv`)."""
        fp8_index.check_index_dtype(index_dtype)
        if fp8.check_kv_dtype(kv_dtype) == "fp8":
            fp8.check_fp8_geometry(self.config)
        weight = self.model.embed_tokens.weight
        kvs = [layer.self_attn.new_kv(batch, capacity, weight.device, weight.dtype, kv_dtype, index_dtype)
               for layer in self.model.layers]
        return DecodeState(layers=kvs, capacity=capacity,
                           lengths=torch.zeros(batch, dtype=torch.int64, device=weight.device))
