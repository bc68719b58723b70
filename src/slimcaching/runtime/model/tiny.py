"""Small randomly initialised MoE model directories, for trying the runtime without a model hub.

``python -m slimcaching.runtime.model.tiny DIR [--family mixtral] [--hidden 64] [--experts 8] ...``
writes a transformers checkpoint (safetensors, config) plus a word-level tokenizer whose words are
``w0 .. wN``. The weights are random, so the text is nonsense; the runtime's arithmetic, routing,
timing and failure handling are the same as for a real checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slimcaching.errors import missing_extra_line

FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3")


def build_tiny_model(directory: str | Path, family: str = "mixtral", *, hidden: int = 64, intermediate: int = 128,
                     layers: int = 2, experts: int = 8, top_k: int = 2, vocab: int = 256, seed: int = 0) -> Path:
    """Write a tiny random MoE checkpoint of ``family`` into ``directory`` (tests, demos)."""
    import torch  # optional extra (hf)
    import transformers as T  # optional extra (hf)
    from tokenizers import Tokenizer, models, pre_tokenizers  # optional extra (hf)

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, num_experts_per_tok=top_k)
    if family == "mixtral":
        cfg, cls = T.MixtralConfig(**common, intermediate_size=intermediate, num_local_experts=experts), \
            T.MixtralForCausalLM
    elif family == "qwen3_moe":
        cfg, cls = T.Qwen3MoeConfig(**common, intermediate_size=intermediate, moe_intermediate_size=intermediate,
                                    num_experts=experts, head_dim=hidden // 4), T.Qwen3MoeForCausalLM
    elif family == "olmoe":
        cfg, cls = T.OlmoeConfig(**common, intermediate_size=intermediate, num_experts=experts), T.OlmoeForCausalLM
    elif family == "qwen2_moe":
        cfg, cls = T.Qwen2MoeConfig(**common, intermediate_size=intermediate, moe_intermediate_size=intermediate,
                                    shared_expert_intermediate_size=intermediate, num_experts=experts), \
            T.Qwen2MoeForCausalLM
    elif family == "deepseek_v3":
        cfg, cls = T.DeepseekV3Config(**common, intermediate_size=intermediate, moe_intermediate_size=intermediate,
                                      n_routed_experts=experts, n_shared_experts=1, first_k_dense_replace=0,
                                      kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                      v_head_dim=16, n_group=1, topk_group=1), T.DeepseekV3ForCausalLM
    else:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}")
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    out = Path(directory)
    model.save_pretrained(out)
    vocab_map = {"[PAD]": 0, "<s>": 1, "</s>": 2, "[UNK]": 3}
    vocab_map.update({f"w{i}": i + 4 for i in range(vocab - 4)})
    tk = Tokenizer(models.WordLevel(vocab=vocab_map, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    T.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]", eos_token="</s>",
                              bos_token="<s>").save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m slimcaching.runtime.model.tiny DIR``: write the tiny demo model."""
    ap = argparse.ArgumentParser(prog="python -m slimcaching.runtime.model.tiny", description=__doc__.splitlines()[0])
    ap.add_argument("directory")
    ap.add_argument("--family", default="mixtral", choices=FAMILIES)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        d = build_tiny_model(a.directory, a.family, hidden=a.hidden, intermediate=a.intermediate,
                             layers=a.layers, experts=a.experts, top_k=a.top_k, seed=a.seed)
    except ModuleNotFoundError as exc:
        line = missing_extra_line(exc.name or "")
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2
    print(f"wrote {d}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
