"""Find the decoder layer stack inside whatever model object a vLLM worker holds.

vLLM models nest their decoder differently: `LlamaForCausalLM.model.layers`,
`KimiK25ForConditionalGeneration.language_model.model.layers`, wrappers exposing
`get_language_model()`.  Pipeline stages hold the full `layers` list with placeholder
modules outside `[start_layer, end_layer)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ..errors import ExtractError

# Owners of `.layers` tried in this order before the generic search.
KNOWN_PATHS = ("model", "language_model.model", "language_model", "model.language_model", "transformer")
# What decoders call their token embedding (GptOssModel: `embedding`).
EMBED_NAMES = ("embed_tokens", "embedding", "wte", "word_embeddings")


class DecoderNotFound(RuntimeError):
    """Raised with a one-line message naming the module paths that were seen."""


@dataclass
class DecoderStack:
    path: str  # dotted path of the module that owns `.layers`
    owner: nn.Module
    layers: nn.ModuleList
    start: int  # first layer this pipeline stage runs
    end: int  # one past the last layer this stage runs
    embed: nn.Module | None  # token embedding, None on later pipeline stages

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def is_first_stage(self) -> bool:
        return self.start == 0

    @property
    def is_last_stage(self) -> bool:
        return self.end == self.num_layers


def _is_placeholder(module: nn.Module) -> bool:
    return type(module).__name__ == "PPMissingLayer"


def _resolve(root: nn.Module, path: str) -> nn.Module | None:
    node = root
    for part in path.split(".") if path else ():
        node = getattr(node, part, None)
        if not isinstance(node, nn.Module):
            return None
    return node


def _layer_owners(root: nn.Module, prefix: str = "") -> list[str]:
    """Dotted paths of every module under `root` that owns a non-empty `layers` ModuleList."""
    found = []
    for name, module in root.named_modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            found.append(".".join(p for p in (prefix, name) if p))
    return found


def _stage_bounds(owner: nn.Module, layers: nn.ModuleList) -> tuple[int, int]:
    start, end = getattr(owner, "start_layer", None), getattr(owner, "end_layer", None)
    if isinstance(start, int) and isinstance(end, int):
        return start, end
    real = [i for i, layer in enumerate(layers) if not _is_placeholder(layer)]
    if not real:
        raise DecoderNotFound("every decoder layer is a pipeline placeholder; nothing to hook")
    return real[0], real[-1] + 1


def _stack(root: nn.Module, path: str) -> DecoderStack:
    owner = _resolve(root, path)
    layers = getattr(owner, "layers", None) if owner is not None else None
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        found = ", ".join(_layer_owners(root)) or "none"
        raise DecoderNotFound(
            f"{type(root).__name__} has no decoder layer list at '{path}.layers' (modules with one: {found})"
        )
    start, end = _stage_bounds(owner, layers)
    return DecoderStack(path, owner, layers, start, end, _embedding(owner))


def _embedding(owner: nn.Module) -> nn.Module | None:
    """The decoder's token embedding; None on a later pipeline stage, where it is a placeholder."""
    named = (getattr(owner, name, None) for name in EMBED_NAMES)
    found = next((m for m in named if isinstance(m, nn.Module)), None)
    if found is None:
        found = next((m for m in owner.children() if type(m).__name__.endswith("Embedding")), None)
    return None if found is None or _is_placeholder(found) else found


def refuse_unfound_decoder(installed: list[dict]) -> None:
    """The driver's side of a worker that found no decoder to hook (`eagle_install`): one line, the user's."""
    said = next((w["decoder_not_found"] for w in installed if "decoder_not_found" in w), None)
    if said is not None:
        raise ExtractError(f"{said}; nothing was written")


def find_decoder(model: nn.Module, path: str | None = None) -> DecoderStack:
    """Locate the text decoder's layer list; `path` (e.g. 'language_model.model') overrides the search."""
    if path is not None:
        try:
            return _stack(model, path)
        except DecoderNotFound as exc:
            raise DecoderNotFound(f"--decoder-path {path}: {exc}; pass one of those, or leave it out") from None
    for known in KNOWN_PATHS:
        owner = _resolve(model, known)
        if owner is not None and isinstance(getattr(owner, "layers", None), nn.ModuleList):
            return _stack(model, known)
    # Unknown wrapper: search inside the language model if the wrapper names one, else everywhere.
    scope, prefix = model, ""
    get_lm = getattr(model, "get_language_model", None)
    if callable(get_lm):
        lm = get_lm()
        if isinstance(lm, nn.Module) and lm is not model:
            prefix = next((n for n, m in model.named_modules() if m is lm), "")
            scope = lm
    candidates = _layer_owners(scope, prefix)
    if len(candidates) == 1:
        return _stack(model, candidates[0])
    seen = candidates or [n for n, _ in model.named_children()]
    raise DecoderNotFound(
        f"cannot tell which module holds the decoder layers of {type(model).__name__}; "
        f"candidates: {', '.join(seen) or 'none'}; name one with --decoder-path"
    )
