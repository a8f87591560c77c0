"""The study model "dsa_v32_ep8": DSA's real attention and KV geometry at DeepSeek-V3.2's hidden size,
with a decode step that reads as many bytes of weights as one GPU of an 8-GPU expert-parallel
deployment of DeepSeek-V3.2 does (results/notes/study_model.md).

The deployment (`deployment_parts`, `deployment_step_bytes`): DP attention and EP8 MoE, as DeepSeek
serves it. Each GPU holds its own requests' KV and a whole copy of every layer's attention (MLA and
the indexer), the 3 dense MLPs, the shared experts, the routers, the embeddings and the head; the 256
routed experts of each MoE layer are split 32 a GPU. Linear weights are FP8 (1 byte) with a float32
scale per 128 x 128 block, as the checkpoint stores them; the embeddings, the head, the norms, the
routers and the indexer's head weights are bf16. A decode step at b requests a GPU reads everything
but the embedding table, and of its routed experts those the step's tokens reach: the MoE layers
gather the tokens of all 8 GPUs (8b, each GPU at batch b), each picks 8 of 256 experts, so under
uniform routing a local expert is idle with probability (1 - 8/256)^(8b).

The emulation (`study_config`): the codebase's MoE holds bf16 weights only (hisparse/models/moe.py
has no FP8 path), so the attention at its real geometry reads twice its FP8 bytes. The MLPs make up
the rest in bf16: dense MLPs of half the intermediate size (the same bytes as FP8 at 18432), and MoE
layers of fewer, larger experts (9 of intermediate 2896, 2 a token, one shared of the same size) whose
size brings the step's reads with every expert read to the deployment's at a large batch. 2 of 9 a
token leaves an expert idle with probability 7/9 = 0.778 a token, near (31/32)^8 = 0.776 a GPU's
token, so an eager step's expected reads follow the deployment's curve from b = 8 on; a CUDA-graph
step (`Experts.every_expert`) reads every expert at every batch.
"""
from __future__ import annotations

import math

import torch

GIB = 2 ** 30
STUDY_MODEL = "dsa_v32_ep8"

# DeepSeek-V3.2's published config (Hugging Face names; deepseek-ai/DeepSeek-V3.2-Exp's
# inference/config_671B_v3.2.json gives the same values under its own names)
V32 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
           first_k_dense_replace=3, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
           num_experts_per_tok=8, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
           qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128, index_topk=2048)
GPUS = 8                                      # expert-parallel degree
LOCAL_EXPERTS = V32["n_routed_experts"] // GPUS   # 32 routed experts a GPU and MoE layer
FP8_BLOCK = 128                               # a float32 scale per 128 x 128 block of an FP8 weight
BF16 = 2

# One GPU's memory: the H200's 141 GB (nominal) shows as about 139 GiB usable; the H100's 80 GB as
# about 79.6 GiB. The reserve is what a serving process needs beside weights and KV: the CUDA context,
# cuBLAS workspaces, the decode graphs' pool and the activations of an 8192-token prefill chunk at
# hidden 7168 (study_model.md gives the sum).
GPU_GIB = {"H200": 139.0, "H100": 79.6}
RESERVE_GIB = 8.0
KV_BUDGET_GIB = 36        # the H200's 139 GiB less the weights' 94.7 GiB and the reserve, rounded down

# the emulation's MLP sizes at hidden 7168 (`study_config`; the sizes scale with a smaller hidden)
DENSE_INTERMEDIATE = 9216     # bf16 bytes of DeepSeek-V3.2's FP8 dense MLP (intermediate 18432)
EXPERTS, EXPERTS_PER_TOKEN, EXPERT_INTERMEDIATE = 9, 2, 2896


def fp8_bytes(rows: int, cols: int) -> int:
    """Bytes of an FP8 [rows, cols] weight with its float32 block scales."""
    return rows * cols + math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK) * 4


def deployment_parts() -> dict[str, int]:
    """Bytes one GPU of the EP8 deployment holds, by part (`routed_experts`: its 32 of every MoE layer)."""
    h, c = V32["hidden_size"], V32
    heads, qk = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    mla = (fp8_bytes(c["q_lora_rank"], h) + fp8_bytes(heads * qk, c["q_lora_rank"])
           + fp8_bytes(c["kv_lora_rank"] + c["qk_rope_head_dim"], h)
           + fp8_bytes(heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
           + fp8_bytes(h, heads * c["v_head_dim"]) + (c["q_lora_rank"] + c["kv_lora_rank"]) * BF16)
    ni, di = c["index_n_heads"], c["index_head_dim"]
    indexer = fp8_bytes(ni * di, c["q_lora_rank"]) + fp8_bytes(di, h) + ni * h * BF16 + 2 * di * BF16
    layers, dense = c["num_hidden_layers"], c["first_k_dense_replace"]
    moe = layers - dense
    expert = 3 * fp8_bytes(c["moe_intermediate_size"], h)
    return {
        "attention": layers * (mla + indexer),
        "dense_mlp": dense * 3 * fp8_bytes(c["intermediate_size"], h),
        "shared_experts": moe * c["n_shared_experts"] * expert,
        "routers": moe * (c["n_routed_experts"] * h * BF16 + c["n_routed_experts"] * 4),   # + float32 bias
        "norms": (2 * layers + 1) * h * BF16,
        "lm_head": c["vocab_size"] * h * BF16,
        "embedding": c["vocab_size"] * h * BF16,
        "routed_experts": moe * LOCAL_EXPERTS * expert,
    }


def deployment_held_bytes() -> int:
    return sum(deployment_parts().values())


def distinct_experts(batch: int) -> float:
    """Expected routed experts of one GPU's 32 that a step's tokens reach, per MoE layer: the 8 GPUs'
    8 x batch tokens, 8 of 256 experts each, routed uniformly."""
    idle = (1 - V32["num_experts_per_tok"] / V32["n_routed_experts"]) ** (GPUS * batch)
    return LOCAL_EXPERTS * (1 - idle)


def deployment_step_bytes(batch: int) -> float:
    """Weight bytes one GPU reads in a decode step at `batch` requests a GPU: all but the embedding
    table and the idle routed experts."""
    parts = deployment_parts()
    always = sum(v for k, v in parts.items() if k not in ("embedding", "routed_experts"))
    return always + parts["routed_experts"] * distinct_experts(batch) / LOCAL_EXPERTS


def kv_budget_gib(gpu: str = "H200", reserve_gib: float = RESERVE_GIB) -> float:
    """GiB a GPU has left for KV after the deployment's weights and the reserve (negative: they do not fit)."""
    return GPU_GIB[gpu] - deployment_held_bytes() / GIB - reserve_gib


# -- the emulation -------------------------------------------------------------------------------

def _scaled(size: int, hidden: int) -> int:
    return max(1, round(size * hidden / V32["hidden_size"]))


def study_config(layers: int = 61, hidden: int = 7168) -> dict:
    """The study model's config dict: DSA's real attention and KV geometry (128 heads, 512 + 64
    latents, k = 2048, a 64 x 128 indexer), DeepSeek-V3.2's vocabulary, the first min(3, layers)
    layers dense and the rest MoE, the MLP sizes of the module docstring (scaled with `hidden` where
    it is not 7168, for tests)."""
    for name, value in (("layers", layers), ("hidden", hidden)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{STUDY_MODEL}: {name} = {value!r}: expected a positive integer")
    return dict(model_type="deepseek_v32", vocab_size=V32["vocab_size"], hidden_size=hidden,
                num_hidden_layers=layers, first_k_dense_replace=min(V32["first_k_dense_replace"], layers),
                intermediate_size=_scaled(DENSE_INTERMEDIATE, hidden),
                moe_intermediate_size=_scaled(EXPERT_INTERMEDIATE, hidden), n_routed_experts=EXPERTS,
                num_experts_per_tok=EXPERTS_PER_TOKEN, n_shared_experts=1, n_group=1, topk_group=1,
                **{k: V32[k] for k in ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                       "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
                                       "index_topk")})


def expert_fraction(experts: int, per_token: int, batch: int, every_expert: bool = False) -> float:
    """Expected share of a layer's routed experts that `batch` tokens reach (each picking `per_token`
    of `experts`, uniformly); 1 when every expert runs (a CUDA-graph step)."""
    return 1.0 if every_expert else 1 - (1 - per_token / experts) ** batch


def config_step_bytes(cfg, batch: int, every_expert: bool = False, elem: int = BF16) -> float:
    """Weight bytes a decode step of a DSA model of config `cfg` reads at `batch` (every weight held in
    `elem` bytes): all but the embedding table, and of the routed experts the expected share reached."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    mla = (h * cfg.q_lora_rank + cfg.q_lora_rank * heads * cfg.qk_head_dim
           + h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim
                                                                                        + cfg.v_head_dim)
           + heads * cfg.v_head_dim * h + cfg.q_lora_rank + cfg.kv_lora_rank)
    indexer = (cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + h * cfg.index_head_dim
               + h * cfg.index_n_heads + 2 * cfg.index_head_dim)
    layers = cfg.num_hidden_layers
    moe = sum(t == "sparse" for t in cfg.mlp_layer_types)
    expert = 3 * h * cfg.moe_intermediate_size
    share = expert_fraction(cfg.n_routed_experts, cfg.num_experts_per_tok, batch, every_expert)
    elems = (layers * (mla + indexer + 2 * h) + (layers - moe) * 3 * h * cfg.intermediate_size
             + moe * (cfg.n_shared_experts * expert + cfg.n_routed_experts * (h + 1))   # + the router's bias
             + h + cfg.vocab_size * h)                                                   # final norm, head
    return elem * (elems + moe * cfg.n_routed_experts * expert * share)


def model_step_bytes(model: torch.nn.Module, batch: int, every_expert: bool = False) -> float:
    """The same figure read off a built DSA model's tensors: every parameter and buffer but the
    embedding table, the routed experts' (`mlp.experts.`) times the share reached."""
    cfg, total = model.config, 0.0
    share = expert_fraction(cfg.n_routed_experts, cfg.num_experts_per_tok, batch, every_expert)
    for name, tensor in model.state_dict().items():
        if name == "model.embed_tokens.weight":
            continue
        size = tensor.numel() * tensor.element_size()
        total += size * share if ".mlp.experts." in name else size
    return total
