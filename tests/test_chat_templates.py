"""Loss masks for chat-template families written for these tests, against hand-written masks.

Each case gives the template, a multi-turn conversation, the full rendering written out by hand,
and, by hand, the exact text of every run of trained tokens (1 in loss_mask).  The template's
markers are added to the tokenizer as special tokens so token boundaries fall on them
(SmolLM2's bos_token is <|im_start|>).
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from eagle_extract.data.samples import tokenize_conversation

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Qwen3 style: the thinking of assistant turns before the last user question is dropped.
QWEN3 = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}"
    "{% set content = m.content or '' %}{% set reasoning = m.reasoning_content or '' %}"
    "{% if '</think>' in content %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip() %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "{% if loop.index0 > ns.last %}<|im_start|>assistant\n<think>\n{{ reasoning }}\n</think>\n\n{{ content }}"
    "<|im_end|>\n{% else %}<|im_start|>assistant\n{{ content }}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEEPSEEK = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}"
    "{% elif m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% else %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
# A template that marks the assistant's tokens itself.  (transformers renders with trim_blocks,
# which eats a newline written right after a block tag: hence {{ '\\n' }}.)
CHATML_MARKED = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}{{ '\\n' }}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MARKERS = [
    "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<think>", "</think>",
]  # fmt: skip

CASES = {
    "llama3": (
        LLAMA3,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Sky colour?"},
            {"role": "assistant", "content": "Blue."},
        ],
        "<|im_start|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nSky colour?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nBlue.<|eot_id|>",
        ["Hello.<|eot_id|>", "Blue.<|eot_id|>"],
    ),
    "qwen3-thinking": (
        QWEN3,
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
            {"role": "user", "content": "Times 3?"},
            {"role": "assistant", "content": "<think>\n4 times 3.\n</think>\n\n12"},
        ],
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nTimes 3?<|im_end|>\n<|im_start|>assistant\n<think>\n4 times 3.\n</think>\n\n12<|im_end|>\n",
        ["4<|im_end|>", "<think>\n4 times 3.\n</think>\n\n12<|im_end|>"],
    ),
    "deepseek": (
        DEEPSEEK,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Bye."},
        ],
        "<|im_start|>Be brief.<｜User｜>Hi<｜Assistant｜>Hello.<｜end▁of▁sentence｜>"
        "<｜User｜>Bye<｜Assistant｜>Bye.<｜end▁of▁sentence｜>",
        ["Hello.<｜end▁of▁sentence｜>", "Bye.<｜end▁of▁sentence｜>"],
    ),
    "generation-markers": (
        CHATML_MARKED,
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Bye."},
        ],
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\nBye.<|im_end|>\n",
        ["Hello.<|im_end|>", "Bye.<|im_end|>"],
    ),
}


@pytest.fixture(scope="module")
def base_tokenizer(smollm2):
    tok = AutoTokenizer.from_pretrained(smollm2)
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    return tok


def trained_runs(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    runs, current = [], []
    for token, m in zip(ids + [None], mask + [0]):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


@pytest.mark.parametrize("family", CASES)
def test_family_mask_matches_hand_written(base_tokenizer, family):
    template, messages, rendering, runs = CASES[family]
    base_tokenizer.chat_template = template
    ids, mask = tokenize_conversation(base_tokenizer, messages)
    assert base_tokenizer.decode(ids) == rendering
    assert trained_runs(base_tokenizer, ids, mask) == runs
