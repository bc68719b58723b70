"""`slimcaching profile` end to end on tiny randomly initialised models, one per family.

Each model is built from a config, saved to a temporary directory with a small word-level
tokenizer, and loaded back with ``from_pretrained`` by the code under test. The recorded experts
are compared token by token with the router's own output captured by independent hooks: the
top-K of its logits (softmax is monotone) and, for DeepSeek, the gate's returned indices.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from slimcaching.cli import main  # noqa: E402
from slimcaching.errors import ScenarioError  # noqa: E402
from slimcaching.inputs import hf  # noqa: E402
from slimcaching.inputs.profiles import Profile  # noqa: E402

VOCAB = 64
COMMON = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _configs():
    T = transformers
    dsv = dict(COMMON, intermediate_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
               n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3, kv_lora_rank=8,
               qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=4, topk_group=2, num_key_value_heads=2)
    return {
        "mixtral": (T.MixtralConfig, dict(COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
                    T.MixtralForCausalLM),
        "qwen2_moe": (T.Qwen2MoeConfig, dict(COMMON, intermediate_size=32, moe_intermediate_size=16,
                                             shared_expert_intermediate_size=16, num_experts=6,
                                             num_experts_per_tok=2), T.Qwen2MoeForCausalLM),
        "qwen3_moe": (T.Qwen3MoeConfig, dict(COMMON, intermediate_size=32, moe_intermediate_size=16, num_experts=6,
                                             num_experts_per_tok=2, head_dim=8), T.Qwen3MoeForCausalLM),
        "olmoe": (T.OlmoeConfig, dict(COMMON, intermediate_size=16, num_experts=8, num_experts_per_tok=2),
                  T.OlmoeForCausalLM),
        "deepseek_v2": (T.DeepseekV2Config, dict(dsv, q_lora_rank=None, topk_method="group_limited_greedy"),
                        T.DeepseekV2ForCausalLM),
        "deepseek_v3": (T.DeepseekV3Config, dict(dsv, q_lora_rank=8), T.DeepseekV3ForCausalLM),
        "gpt_oss": (T.GptOssConfig, dict(COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                         head_dim=8, layer_types=["sliding_attention", "full_attention"],
                                         sliding_window=8), T.GptOssForCausalLM),
        "phimoe": (T.PhimoeConfig, dict(COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
                   T.PhimoeForCausalLM),
        "switch_transformers": (T.SwitchTransformersConfig, dict(
            vocab_size=VOCAB, d_model=16, d_ff=32, d_kv=8, num_heads=2, num_layers=2, num_decoder_layers=2,
            num_experts=4, expert_capacity=512, encoder_sparse_step=1, decoder_sparse_step=1, pad_token_id=0,
            eos_token_id=2, decoder_start_token_id=0), T.SwitchTransformersForConditionalGeneration),
        "qwen3_vl_moe": (T.Qwen3VLMoeConfig, dict(
            text_config=dict(COMMON, intermediate_size=32, moe_intermediate_size=16, num_experts=6,
                             num_experts_per_tok=2, head_dim=8, rope_scaling={"rope_type": "default",
                                                                              "mrope_section": [1, 1, 2]}),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                               deepstack_visual_indexes=[0]),
            image_token_id=60, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63),
            T.Qwen3VLMoeForConditionalGeneration),
    }


FAMILIES = list(_configs())


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "<s>": 1, "</s>": 2, "[UNK]": 3}
    vocab.update({f"w{i}": i + 4 for i in range(VOCAB - 8)})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]",
                                                eos_token="</s>", bos_token="<s>")


def _build(family, path):
    cfg_cls, kw, model_cls = _configs()[family]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kw)).eval()
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return model


def _prompts(path, n=5, seed=0, jsonl=False):
    rng = np.random.default_rng(seed)
    lines = [" ".join(f"w{int(rng.integers(0, VOCAB - 8))}" for _ in range(int(rng.integers(3, 9)))) for _ in range(n)]
    if jsonl:
        path.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(lines)) + "\n")
    else:
        path.write_text("\n".join(lines) + "\n")
    return lines


def _router_hooks(model, captured):
    """Independent capture of each MoE block's router output (test side)."""
    handles = []
    for li, (_, block, kind) in enumerate(hf.find_moe_layers(model)):
        router = getattr(block, "router", None) or getattr(block, "gate", None)

        def hook(module, args, output, li=li, kind=kind):
            if kind == "switch":
                mask = output[0].reshape(-1, output[0].shape[-1])
                captured.setdefault(li, []).append(("mask", mask.argmax(-1, keepdim=True).numpy()))
            else:
                logits, _, idx = output
                logits = logits.reshape(-1, logits.shape[-1]).float()
                k = idx.shape[-1]
                topk = torch.topk(logits, k, dim=-1).indices
                captured.setdefault(li, []).append(("gate", idx.reshape(-1, k).numpy(), topk.numpy()))

        handles.append(router.register_forward_hook(hook))
    return handles


def _profile_with_router_hooks(monkeypatch, model_dir, prompts, generate):
    """Profile with batch size 1 while independent hooks capture every router's own output."""
    captured: dict = {}
    real_load = hf.load_model

    def load_with_hooks(*a, **k):
        model, cfg = real_load(*a, **k)
        _router_hooks(model, captured)
        return model, cfg

    monkeypatch.setattr(hf, "load_model", load_with_hooks)
    trace = hf.profile_model(str(model_dir), hf.read_prompts(prompts), batch_size=1, generate=generate)
    return trace, captured


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_experts_equal_router_choice_token_by_token(family, tmp_path, monkeypatch):
    d = tmp_path / family
    _build(family, d)
    prompts = tmp_path / "p.txt"
    _prompts(prompts, n=3)
    trace, captured = _profile_with_router_hooks(monkeypatch, d, prompts, generate=2)
    assert trace.meta["family"] == hf.FAMILIES[family]
    assert len(trace.layer_names) == len(captured) > 0
    deepseek = family.startswith("deepseek")
    for li in range(len(trace.layer_names)):
        rec = np.sort(trace.experts[li], axis=1)
        if captured[li][0][0] == "mask":
            ref = np.concatenate([c[1] for c in captured[li]])
        else:
            ref = np.concatenate([c[1] for c in captured[li]])
            top = np.concatenate([c[2] for c in captured[li]])
            if not deepseek:  # the gate's choice is the top-K of the logits
                assert np.array_equal(np.sort(ref, axis=1), np.sort(top, axis=1))
        assert np.array_equal(rec, np.sort(ref, axis=1)), f"layer {li}"
    # prefill and decode tokens are both present (encoder-decoder: encoder layers see the prompt,
    # decoder layers the generated tokens)
    for name, p in zip(trace.layer_names, trace.phase):
        if family == "switch_transformers":
            assert set(p.tolist()) == ({1} if "decoder" in name else {0})
        else:
            assert (p == 0).any() and (p == 1).any()


@pytest.mark.parametrize("family", ["mixtral", "switch_transformers", "deepseek_v2"])
def test_cli_profile_with_padding_and_stats(family, tmp_path):
    d = tmp_path / "m"
    model = _build(family, d)
    prompts = tmp_path / "p.jsonl"
    lines = _prompts(prompts, n=7, jsonl=True)
    out = tmp_path / "prof.json"
    phases = "all" if family == "switch_transformers" else "prefill"
    assert main(["profile", str(d), "--prompts", str(prompts), "-o", str(out), "--batch-size", "3",
                 "--phases", phases, "--name", "tiny"]) == 0
    prof = Profile.load(out)
    n_blocks = len(hf.find_moe_layers(model))
    e, k = hf._moe_shape(model, hf.find_moe_layers(model))
    prof.validate(n_blocks, e, k)
    assert prof.model == "tiny" and prof.meta["model_type"] == family
    tokens = sum(len(t.split()) for t in lines)
    encoder_layers = [i for i, n in enumerate(hf.RoutingTrace.load(tmp_path / "prof.trace.npz").layer_names)
                      if "decoder" not in n]
    for i in encoder_layers:  # padding removed: exactly one record per prompt token
        assert prof.meta["tokens_per_layer"][i] == tokens
    npz = tmp_path / "prof.npz"
    assert main(["profile", str(d), "--prompts", str(prompts), "-o", str(npz), "--max-tokens", "5"]) == 0
    assert 0 < Profile.load(npz).meta["prefill_tokens"] <= 5
    png = tmp_path / "heat.png"
    assert main(["profile-stats", str(out), "--compare", str(npz), "--heatmap", str(png), "--json"]) == 0
    assert png.stat().st_size > 0
    assert main(["profile-fit", str(out), "--tokens", "200", "-o", str(tmp_path / "fit.json")]) == 0
    fit = json.loads((tmp_path / "fit.json").read_text())
    assert {"skew", "coupling"} <= set(fit["params"])


def test_profile_plugs_into_a_scenario(tmp_path):
    d = tmp_path / "m"
    _build("mixtral", d)
    prompts = tmp_path / "p.txt"
    _prompts(prompts, n=6)
    assert main(["profile", str(d), "--prompts", str(prompts), "-o", str(tmp_path / "mix.json"),
                 "--name", "mix"]) == 0
    scen = {
        "models": [{"name": "mix", "layers": 2, "experts": 4, "top_k": 2, "expert_bytes": "1 MB",
                    "expert_flops": "1 GFLOP", "hidden_bytes": 32, "dense_bytes": "10 MB", "dense_flops": "1 GFLOP"}],
        "cloud": {"flops": "100 TFLOPS"},
        "servers": [{"name": "e0", "capacity_bytes": "2 MB", "flops": "10 TFLOPS", "cloud_rate_bps": "100 Mbps",
                     "cloud_rtt_s": "30 ms"}],
        "users": [{"name": "u", "home": "e0", "uplink_bps": "50 Mbps", "downlink_bps": "100 Mbps", "rtt_s": "5 ms",
                   "flops": "1 TFLOPS", "cache_bytes": "1 MB",
                   "workload": [{"model": "mix", "weight": 1, "profile": "mix.json"}]}],
    }
    (tmp_path / "s.json").write_text(json.dumps(scen))
    assert main(["solve", str(tmp_path / "s.json"), "-a", "slimcaching", "-o", str(tmp_path / "pl.json")]) == 0


def test_errors_for_non_moe_and_unknown_family(tmp_path):
    d = tmp_path / "dense"
    cfg = transformers.LlamaConfig(**{k: v for k, v in COMMON.items()}, intermediate_size=32)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    with pytest.raises(ScenarioError, match="unknown MoE family 'llama'"):
        hf.load_model(str(d))
    with pytest.raises(ScenarioError, match="has no MoE layers"):
        hf.RoutingRecorder(transformers.LlamaForCausalLM(cfg))
    with pytest.raises(ScenarioError, match="model"):
        hf.load_model(str(tmp_path / "nothing-here"))


def test_qwen3_vl_moe_with_images(tmp_path, monkeypatch):
    """Images go through the Qwen-VL image processor; image tokens are routed and recorded too."""
    from PIL import Image
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path / "vl"
    cfg_cls, kw, model_cls = _configs()["qwen3_vl_moe"]
    torch.manual_seed(0)
    model_cls(cfg_cls(**kw)).save_pretrained(d)
    specials = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    vocab = {"[PAD]": 0, "<s>": 1, "</s>": 2, "[UNK]": 3}
    vocab.update({f"w{i}": i + 4 for i in range(VOCAB - 8)})
    vocab.update({s: 60 + j for j, s in enumerate(specials)})  # ids as in the config
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]", eos_token="</s>",
                                         additional_special_tokens=specials).save_pretrained(d)
    transformers.Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2,
                                          min_pixels=28 * 28 * 4, max_pixels=56 * 56 * 4).save_pretrained(d)
    img = tmp_path / "img.png"
    Image.fromarray((np.random.default_rng(0).random((56, 56, 3)) * 255).astype("uint8")).save(img)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"text": "w1 w2 w3", "image": str(img)}) + "\n" + json.dumps({"text": "w4"}) + "\n")
    trace, captured = _profile_with_router_hooks(monkeypatch, d, prompts, generate=1)
    # 56x56 image -> 4x4 patches -> 4 image tokens after 2x2 merge, + 2 markers + 3 words; second prompt 1 word
    assert trace.meta["prefill_tokens"] == (4 + 2 + 3) + 1
    for li in range(len(trace.layer_names)):
        rec = trace.experts[li]
        assert len(rec) == trace.meta["prefill_tokens"] + 2  # + one decoded token per prompt
        ref = np.concatenate([c[1] for c in captured[li]])
        assert np.array_equal(np.sort(rec, axis=1), np.sort(ref, axis=1))
