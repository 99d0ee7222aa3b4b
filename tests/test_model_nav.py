"""Decoder discovery on module trees shaped like vLLM's models (plain, wrapped, pipeline stages)."""

from __future__ import annotations

import pytest
import torch.nn as nn

from eagle_extract.worker.model_nav import DecoderNotFound, find_decoder


class PPMissingLayer(nn.Identity):  # same class name as vLLM's placeholder
    pass


class Decoder(nn.Module):
    def __init__(self, n, stage=None):
        super().__init__()
        start, end = stage or (0, n)
        self.embed_tokens = nn.Embedding(10, 4) if start == 0 else PPMissingLayer()
        self.layers = nn.ModuleList(nn.Linear(4, 4) if start <= i < end else PPMissingLayer() for i in range(n))
        self.norm = nn.LayerNorm(4)


class Vision(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))


def test_plain_decoder():
    root = nn.Module()
    root.model = Decoder(5)
    stack = find_decoder(root)
    assert (stack.path, stack.num_layers, stack.start, stack.end) == ("model", 5, 0, 5)
    assert stack.embed is root.model.embed_tokens


def test_kimi_style_wrapper():
    root, lm = nn.Module(), nn.Module()
    lm.model = Decoder(61)
    root.language_model, root.vision_tower = lm, Vision()
    stack = find_decoder(root)
    assert (stack.path, stack.num_layers) == ("language_model.model", 61)


def test_get_language_model_scopes_the_search():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.vision = Vision()
            self.text = nn.Module()
            self.text.decoder = Decoder(4)

        def get_language_model(self):
            return self.text

    assert find_decoder(Wrapper()).path == "text.decoder"


def test_pipeline_stage_bounds_from_placeholders():
    root = nn.Module()
    root.model = Decoder(8, stage=(4, 8))
    stack = find_decoder(root)
    assert (stack.start, stack.end, stack.embed) == (4, 8, None)
    assert stack.is_last_stage and not stack.is_first_stage


def test_ambiguous_tree_names_candidates_and_the_option():
    root = nn.Module()
    root.vision, root.text = Vision(), Decoder(4)
    with pytest.raises(DecoderNotFound) as err:
        find_decoder(root)
    msg = str(err.value)
    assert "vision.encoder" in msg and "text" in msg and "--decoder-path" in msg and "\n" not in msg
    assert find_decoder(root, "text").num_layers == 4


def test_explicit_path_that_holds_no_layers():
    root = nn.Module()
    root.model = Decoder(2)
    with pytest.raises(DecoderNotFound, match="no decoder layer list at 'norm.layers'"):
        find_decoder(root, "norm")
