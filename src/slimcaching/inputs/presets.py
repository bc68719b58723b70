"""Model presets with dimensions taken from the public Hugging Face model configs.

Each preset records the config numbers it is computed from (``source``) and derives:

- ``expert_bytes`` = expert parameters x bytes per weight (biases included where the model has them);
- ``expert_flops`` = 2 x expert parameters (one multiply-add per weight per token);
- ``hidden_bytes`` = hidden size x bytes per activation (activations stay 16-bit below fp32);
- ``dense_bytes``  = every non-routed weight (attention, embeddings, untied LM head, dense FFNs,
  shared experts, routers, norms; for the multimodal MoE-LLaVA also the CLIP ViT-L/14-336 vision
  tower and projector) x bytes per weight;
- ``dense_flops``  = 2 x (non-routed weights a decoded token passes through: attention
  projections, routers, dense FFNs, shared experts, LM head). Embedding look-ups, attention
  score arithmetic (context-length dependent) and the vision tower (once per image, not per
  token) are not counted.

The derived parameter totals are checked in the tests against the published model sizes
(e.g. Mixtral-8x7B 46.7B, OLMoE-1B-7B 6.9B, Qwen3-30B-A3B 30.5B, Switch-base-8 619M).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slimcaching.errors import ScenarioError, did_you_mean

BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}
CLIP_VIT_L14_336 = 303_507_456 + 2 * 1024 * 2560  # vision tower + a 2-layer MLP projector (approx.)


@dataclass(frozen=True)
class Arch:
    """Config numbers of one MoE model (names follow the HF configs)."""

    hf_id: str
    hidden: int
    moe_layers: int
    experts: int
    top_k: int
    expert_params: int
    attention_params_per_layer: int
    total_layers: int
    vocab: int
    tie_embeddings: bool
    dense_ffn_params: int = 0  # all dense (non-MoE) FFN layers together
    shared_params_per_moe_layer: int = 0  # shared experts
    extra_dense_params: int = 0  # e.g. a vision tower: stored, not run per token
    norm_and_bias_params: int = 0
    source: dict = field(default_factory=dict)

    @property
    def router_params(self) -> int:
        return self.moe_layers * self.hidden * self.experts

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    def dense_params(self) -> int:
        out = (
            self.total_layers * self.attention_params_per_layer
            + self.dense_ffn_params
            + self.moe_layers * self.shared_params_per_moe_layer
            + self.router_params
            + self.embedding_params
            + (0 if self.tie_embeddings else self.head_params)
            + self.norm_and_bias_params
            + self.extra_dense_params
        )
        return out

    def dense_token_params(self) -> int:
        """Weights one decoded token is multiplied with outside the routed experts."""
        return (
            self.total_layers * self.attention_params_per_layer
            + self.dense_ffn_params
            + self.moe_layers * self.shared_params_per_moe_layer
            + self.router_params
            + self.head_params
        )

    def total_params(self) -> int:
        return self.dense_params() + self.moe_layers * self.experts * self.expert_params


def _swiglu(h: int, i: int) -> int:
    return 3 * h * i


def _mha(h: int, bias: bool = False) -> int:
    return 4 * h * h + (4 * h if bias else 0)


def _gqa(h: int, heads: int, kv_heads: int, head_dim: int) -> int:
    return h * heads * head_dim * 2 + 2 * h * kv_heads * head_dim


def _switch(e: int) -> Arch:
    h, ff = 768, 3072
    return Arch(
        hf_id=f"google/switch-base-{e}",
        hidden=h,
        moe_layers=12,  # 12 encoder + 12 decoder blocks, every second one sparse
        experts=e,
        top_k=1,
        expert_params=2 * h * ff,
        # decoder blocks have self- and cross-attention: 12 + 2 * 12 = 36 attention blocks over 24
        attention_params_per_layer=_mha(h) * 36 // 24,
        total_layers=24,
        vocab=32128,
        tie_embeddings=True,
        dense_ffn_params=12 * 2 * h * ff,
        norm_and_bias_params=62 * h,
        source={"d_model": 768, "d_ff": 3072, "num_layers": 12, "num_decoder_layers": 12,
                "encoder_sparse_step": 2, "decoder_sparse_step": 2, "num_experts": e,
                "vocab_size": 32128, "num_heads": 12, "d_kv": 64},
    )


def _llama_moe(k: int, e: int) -> Arch:
    h, ff = 4096, 11008
    return Arch(
        hf_id=f"llama-moe/LLaMA-MoE-v1-3_5B-{k}_{e}",
        hidden=h,
        moe_layers=32,
        experts=e,
        top_k=k,
        expert_params=_swiglu(h, ff // e),
        attention_params_per_layer=_mha(h),
        total_layers=32,
        vocab=32000,
        tie_embeddings=False,
        norm_and_bias_params=65 * h,
        source={"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                "num_experts": e, "num_selects": k, "vocab_size": 32000,
                "note": "LLaMA-2-7B FFN split into equal experts"},
    )


def _moe_llava(base: str) -> Arch:
    if base == "phi2":
        h, ff, layers, vocab = 2560, 10240, 32, 51200
        expert = 2 * h * ff + ff + h  # fc1/fc2 with biases
        attn = _mha(h, bias=True)
        tie, hf = False, "LanguageBind/MoE-LLaVA-Phi2-2.7B-4e"
    elif base == "stablelm":
        h, ff, layers, vocab = 2048, 5632, 24, 100352
        expert = _swiglu(h, ff)
        attn = _mha(h)
        tie, hf = False, "LanguageBind/MoE-LLaVA-StableLM-1.6B-4e"
    elif base == "qwen":
        h, ff, layers, vocab = 2048, 5504, 24, 151936  # Qwen-1.8B: intermediate_size 11008 = 2 x 5504
        expert = _swiglu(h, ff)
        attn = _mha(h, bias=True)
        tie, hf = False, "LanguageBind/MoE-LLaVA-Qwen-1.8B-4e"
    else:  # pragma: no cover - internal
        raise ValueError(base)
    moe = layers // 2
    return Arch(
        hf_id=hf,
        hidden=h,
        moe_layers=moe,
        experts=4,
        top_k=2,
        expert_params=expert,
        attention_params_per_layer=attn,
        total_layers=layers,
        vocab=vocab,
        tie_embeddings=tie,
        dense_ffn_params=(layers - moe) * expert,
        extra_dense_params=CLIP_VIT_L14_336,
        norm_and_bias_params=(2 * layers + 1) * h,
        source={"hidden_size": h, "intermediate_size": ff, "num_hidden_layers": layers,
                "num_experts": 4, "top_k_experts": 2, "moe_layers_idx": "every other layer",
                "vocab_size": vocab, "vision_tower": "openai/clip-vit-large-patch14-336"},
    )


def _mixtral() -> Arch:
    h = 4096
    return Arch(
        hf_id="mistralai/Mixtral-8x7B-v0.1", hidden=h, moe_layers=32, experts=8, top_k=2,
        expert_params=_swiglu(h, 14336), attention_params_per_layer=_gqa(h, 32, 8, 128),
        total_layers=32, vocab=32000, tie_embeddings=False, norm_and_bias_params=65 * h,
        source={"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                "num_experts_per_tok": 2, "vocab_size": 32000},
    )


def _qwen15_moe() -> Arch:
    h = 2048
    return Arch(
        hf_id="Qwen/Qwen1.5-MoE-A2.7B", hidden=h, moe_layers=24, experts=60, top_k=4,
        expert_params=_swiglu(h, 1408), attention_params_per_layer=_mha(h, bias=True),
        total_layers=24, vocab=151936, tie_embeddings=False,
        shared_params_per_moe_layer=_swiglu(h, 5632) + h,  # shared expert + its gate
        norm_and_bias_params=49 * h,
        source={"hidden_size": 2048, "num_hidden_layers": 24, "num_experts": 60,
                "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                "shared_expert_intermediate_size": 5632, "vocab_size": 151936},
    )


def _deepseek_v2_lite() -> Arch:
    h = 2048
    heads, nope, rope, v, kv_rank = 16, 128, 64, 128, 512
    attn = h * heads * (nope + rope) + h * (kv_rank + rope) + kv_rank * heads * (nope + v) + heads * v * h
    return Arch(
        hf_id="deepseek-ai/DeepSeek-V2-Lite", hidden=h, moe_layers=26, experts=64, top_k=6,
        expert_params=_swiglu(h, 1408), attention_params_per_layer=attn, total_layers=27,
        vocab=102400, tie_embeddings=False, dense_ffn_params=_swiglu(h, 10944),
        shared_params_per_moe_layer=_swiglu(h, 2 * 1408), norm_and_bias_params=56 * h,
        source={"hidden_size": 2048, "num_hidden_layers": 27, "first_k_dense_replace": 1,
                "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2,
                "moe_intermediate_size": 1408, "intermediate_size": 10944,
                "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                "v_head_dim": 128, "num_attention_heads": 16, "vocab_size": 102400},
    )


def _olmoe() -> Arch:
    h = 2048
    return Arch(
        hf_id="allenai/OLMoE-1B-7B-0924", hidden=h, moe_layers=16, experts=64, top_k=8,
        expert_params=_swiglu(h, 1024), attention_params_per_layer=_mha(h), total_layers=16,
        vocab=50304, tie_embeddings=False, norm_and_bias_params=33 * h + 16 * 2 * h,
        source={"hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
                "num_experts": 64, "num_experts_per_tok": 8, "vocab_size": 50304},
    )


def _qwen3_moe() -> Arch:
    h = 2048
    return Arch(
        hf_id="Qwen/Qwen3-30B-A3B", hidden=h, moe_layers=48, experts=128, top_k=8,
        expert_params=_swiglu(h, 768), attention_params_per_layer=_gqa(h, 32, 4, 128),
        total_layers=48, vocab=151936, tie_embeddings=False, norm_and_bias_params=97 * h,
        source={"hidden_size": 2048, "num_hidden_layers": 48, "num_experts": 128,
                "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                "vocab_size": 151936},
    )


def _mla(h: int, heads: int, q_rank: int, kv_rank: int, nope: int, rope: int, v: int) -> int:
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank q and kv projections, their norms."""
    q = h * q_rank + q_rank + q_rank * heads * (nope + rope) if q_rank else h * heads * (nope + rope)
    return q + h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v) + heads * v * h


def _deepseek_v3(name: str, experts: int, heads: int, dense_layers: int, vocab: int, hf_id: str) -> Arch:
    """DeepSeek-V3 architecture (also Kimi-K2): MLA, the first layers dense, one shared expert;
    the multi-token-prediction module of the checkpoint is not used in decoding and not counted."""
    h, layers, inter, moe_inter = 7168, 61, 18432, 2048
    moe = layers - dense_layers
    return Arch(
        hf_id=hf_id, hidden=h, moe_layers=moe, experts=experts, top_k=8, expert_params=_swiglu(h, moe_inter),
        attention_params_per_layer=_mla(h, heads, 1536, 512, 128, 64, 128), total_layers=layers, vocab=vocab,
        tie_embeddings=False, dense_ffn_params=dense_layers * _swiglu(h, inter),
        shared_params_per_moe_layer=_swiglu(h, moe_inter) + experts, norm_and_bias_params=(2 * layers + 1) * h,
        source={"hidden_size": h, "num_hidden_layers": layers, "first_k_dense_replace": dense_layers,
                "n_routed_experts": experts, "num_experts_per_tok": 8, "n_shared_experts": 1,
                "moe_intermediate_size": moe_inter, "intermediate_size": inter, "num_attention_heads": heads,
                "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "v_head_dim": 128, "vocab_size": vocab, "model": name},
    )


def _qwen3_235b() -> Arch:
    h = 4096
    return Arch(
        hf_id="Qwen/Qwen3-235B-A22B", hidden=h, moe_layers=94, experts=128, top_k=8,
        expert_params=_swiglu(h, 1536), attention_params_per_layer=_gqa(h, 64, 4, 128) + 2 * 128,
        total_layers=94, vocab=151936, tie_embeddings=False, norm_and_bias_params=(2 * 94 + 1) * h,
        source={"hidden_size": 4096, "num_hidden_layers": 94, "num_experts": 128, "num_experts_per_tok": 8,
                "moe_intermediate_size": 1536, "num_attention_heads": 64, "num_key_value_heads": 4,
                "head_dim": 128, "vocab_size": 151936},
    )


def _gpt_oss(layers: int, experts: int, hf_id: str) -> Arch:
    """gpt-oss: experts with biases (gate_up [2I] and down [H]), attention with biases and sinks;
    ``presets --precision`` sets the bytes (the published checkpoint stores experts in MXFP4)."""
    h, inter, heads, kv, hd = 2880, 2880, 64, 8, 64
    attn = _gqa(h, heads, kv, hd) + heads * hd + 2 * kv * hd + h + heads
    return Arch(
        hf_id=hf_id, hidden=h, moe_layers=layers, experts=experts, top_k=4,
        expert_params=_swiglu(h, inter) + 2 * inter + h, attention_params_per_layer=attn, total_layers=layers,
        vocab=201088, tie_embeddings=False, norm_and_bias_params=(2 * layers + 1) * h + layers * experts,
        source={"hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
                "num_local_experts": experts, "num_experts_per_tok": 4, "num_attention_heads": heads,
                "num_key_value_heads": kv, "head_dim": hd, "vocab_size": 201088},
    )


def _llama4(experts: int, moe_step: int, hf_id: str) -> Arch:
    """Llama 4 text model: top-1 routed expert plus a shared expert in every MoE layer; with
    ``interleave_moe_layer_step`` 2 every other layer is a dense FFN. The vision encoder is not counted."""
    h, layers, inter, inter_mlp = 5120, 48, 8192, 16384
    moe = layers // moe_step
    return Arch(
        hf_id=hf_id, hidden=h, moe_layers=moe, experts=experts, top_k=1, expert_params=_swiglu(h, inter),
        attention_params_per_layer=_gqa(h, 40, 8, 128), total_layers=layers, vocab=202048, tie_embeddings=False,
        dense_ffn_params=(layers - moe) * _swiglu(h, inter_mlp), shared_params_per_moe_layer=_swiglu(h, inter),
        norm_and_bias_params=(2 * layers + 1) * h,
        source={"hidden_size": h, "num_hidden_layers": layers, "num_local_experts": experts,
                "num_experts_per_tok": 1, "intermediate_size": inter, "intermediate_size_mlp": inter_mlp,
                "interleave_moe_layer_step": moe_step, "num_attention_heads": 40, "num_key_value_heads": 8,
                "head_dim": 128, "vocab_size": 202048},
    )


def _mixtral_8x22b() -> Arch:
    h = 6144
    return Arch(
        hf_id="mistralai/Mixtral-8x22B-v0.1", hidden=h, moe_layers=56, experts=8, top_k=2,
        expert_params=_swiglu(h, 16384), attention_params_per_layer=_gqa(h, 48, 8, 128),
        total_layers=56, vocab=32000, tie_embeddings=False, norm_and_bias_params=(2 * 56 + 1) * h,
        source={"hidden_size": 6144, "intermediate_size": 16384, "num_hidden_layers": 56,
                "num_attention_heads": 48, "num_key_value_heads": 8, "num_local_experts": 8,
                "num_experts_per_tok": 2, "vocab_size": 32000},
    )


def _glm45_air() -> Arch:
    """GLM-4.5-Air: first layer dense, one shared expert, attention with q/k/v biases; its
    multi-token-prediction layer is not used in decoding and not counted."""
    h, layers, heads, kv, hd = 4096, 46, 96, 8, 128
    return Arch(
        hf_id="zai-org/GLM-4.5-Air", hidden=h, moe_layers=layers - 1, experts=128, top_k=8,
        expert_params=_swiglu(h, 1408), attention_params_per_layer=_gqa(h, heads, kv, hd) + heads * hd + 2 * kv * hd,
        total_layers=layers, vocab=151552, tie_embeddings=False, dense_ffn_params=_swiglu(h, 10944),
        shared_params_per_moe_layer=_swiglu(h, 1408) + 128, norm_and_bias_params=(2 * layers + 1) * h,
        source={"hidden_size": h, "num_hidden_layers": layers, "first_k_dense_replace": 1,
                "n_routed_experts": 128, "num_experts_per_tok": 8, "n_shared_experts": 1,
                "moe_intermediate_size": 1408, "intermediate_size": 10944, "num_attention_heads": heads,
                "num_key_value_heads": kv, "head_dim": hd, "vocab_size": 151552},
    )


ARCHS: dict[str, Arch] = {
    **{f"switch-base-{e}": _switch(e) for e in (8, 16, 32, 64, 128, 256)},
    "llama-moe-3.5b-2-8": _llama_moe(2, 8),
    "llama-moe-3.5b-4-16": _llama_moe(4, 16),
    "moe-llava-phi2": _moe_llava("phi2"),
    "moe-llava-stablelm": _moe_llava("stablelm"),
    "moe-llava-qwen": _moe_llava("qwen"),
    "mixtral-8x7b": _mixtral(),
    "qwen1.5-moe-a2.7b": _qwen15_moe(),
    "deepseek-v2-lite": _deepseek_v2_lite(),
    "olmoe-1b-7b": _olmoe(),
    "qwen3-30b-a3b": _qwen3_moe(),
    "qwen3-235b-a22b": _qwen3_235b(),
    "deepseek-v3": _deepseek_v3("DeepSeek-V3 / R1", 256, 128, 3, 129280, "deepseek-ai/DeepSeek-V3"),
    "kimi-k2": _deepseek_v3("Kimi-K2", 384, 64, 1, 163840, "moonshotai/Kimi-K2-Instruct"),
    "gpt-oss-20b": _gpt_oss(24, 32, "openai/gpt-oss-20b"),
    "gpt-oss-120b": _gpt_oss(36, 128, "openai/gpt-oss-120b"),
    "llama-4-scout": _llama4(16, 1, "meta-llama/Llama-4-Scout-17B-16E"),
    "llama-4-maverick": _llama4(128, 2, "meta-llama/Llama-4-Maverick-17B-128E"),
    "mixtral-8x22b": _mixtral_8x22b(),
    "glm-4.5-air": _glm45_air(),
}


# expert groups of group-limited routing (the config's ``n_group``), which DeepSeek's EPLB keeps on one node
EXPERT_GROUPS = {"deepseek-v3": 8}


def decoder_layout(name: str) -> tuple[int, tuple[int, ...]] | None:
    """How a serving engine counts a preset's layers: (decoder layers, the decoder index of each
    MoE layer), for presets whose dense layers come first (DeepSeek's ``first_k_dense_replace``) or
    that have no dense layer; None where the MoE layers interleave (Switch, Llama 4)."""
    arch = ARCHS.get(name.strip().lower())
    if arch is None:
        return None
    if arch.total_layers != arch.moe_layers and "first_k_dense_replace" not in arch.source:
        return None
    dense = arch.total_layers - arch.moe_layers
    return arch.total_layers, tuple(range(dense, arch.total_layers))


def resolve_preset(name: str, precision: str = "bf16", field_name: str = "preset") -> dict:
    """Return the SI model fields of a preset at a weight precision."""
    key = name.strip().lower()
    if key not in ARCHS:
        raise ScenarioError(field_name, f"unknown model preset{did_you_mean(name, ARCHS)} (known: {', '.join(ARCHS)})",
                            name)
    if precision not in BYTES_PER_WEIGHT:
        raise ScenarioError(
            "precision", f"unknown precision (known: {', '.join(BYTES_PER_WEIGHT)})", precision
        )
    arch = ARCHS[key]
    bw = BYTES_PER_WEIGHT[precision]
    act = 4.0 if precision == "fp32" else 2.0
    return {
        "layers": arch.moe_layers,
        "experts": arch.experts,
        "top_k": arch.top_k,
        "expert_bytes": float(arch.expert_params * bw),
        "expert_flops": float(2 * arch.expert_params),
        "hidden_bytes": float(arch.hidden * act),
        "dense_bytes": float(arch.dense_params() * bw),
        "dense_flops": float(2 * arch.dense_token_params()),
    }
