"""Request bodies to prompt token ids, checked as the engine will be given them."""

from __future__ import annotations

import json

from pydantic import TypeAdapter, ValidationError

from ..errors import RequestError

UNPARSED_TEMPLATE = "this server's chat template does not parse; send the prompt's token ids to /v1/completions"
BODY_BYTES_PER_TOKEN = 64  # a body's bound: a token id is at most 8 bytes of JSON, a token's text escaped rarely 64
BODY_SLACK = 1 << 20  # and the rest of the body: messages' roles, the model's name, options
FLAGS = ("add_generation_prompt", "continue_final_message", "return_token_ids", "echo", "stream", "add_special_tokens")
# OpenAI parameters the server cannot honour, with the values that ask nothing of it: no text is generated,
# one answer per request, no stream, no log-probabilities
UNHONOURED = {
    "n": (None, 1), "best_of": (None, 1), "stream": (None, False), "echo": (None, False), "logprobs": (None, False),
    "top_logprobs": (None, 0), "prompt_logprobs": (None,), "suffix": (None, ""), "stream_options": (None,),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None,), "logit_bias": (None, {}),
}  # fmt: skip
# Sampling options change nothing here (no text is generated), but a value vLLM's server refuses is refused
NUMBERS = {"max_tokens": int, "max_completion_tokens": int, "min_tokens": int, "top_k": int, "seed": int,
           "temperature": float, "top_p": float, "min_p": float, "frequency_penalty": float,
           "presence_penalty": float, "repetition_penalty": float}  # fmt: skip
AS = {int: TypeAdapter(int | None), float: TypeAdapter(float | None)}  # read as vLLM's request models read them:
# pydantic's lax mode, where "1", 1.0 and true are 1


def _same(value, fine) -> bool:
    if type(fine) is int and value is not None:
        try:
            return AS[int].validate_python(value) == fine  # n: 1.0 is n: 1, as vLLM reads it
        except ValidationError:
            return False
    return value == fine and type(value) is type(fine)


def _encodable(text: str, param: str, where: str) -> None:
    """JSON may carry a lone UTF-16 surrogate (`"\\ud800"`), which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(
            f"{where}: the text holds a lone surrogate (U+{ord(text[exc.start]):04X} at character {exc.start}), "
            "which is no Unicode character; send it paired, or leave it out",
            param=param,
        ) from None


def body_limit(longest: int) -> int:
    """The bytes a body may have: what a prompt of the server's `longest` tokens needs."""
    return longest * BODY_BYTES_PER_TOKEN + BODY_SLACK


def too_large(size: int, longest: int) -> str:
    return (f"the request body has {size:,} bytes, more than the {body_limit(longest):,} a prompt of this server's "
            f"longest ({longest} tokens) needs")  # fmt: skip


class Requests:
    """Checks a request body and turns it into prompt token ids, as the engine will be given them."""

    def __init__(self, name: str, tokenizer, longest: int, bytes_per_token: int, vocab: int,
                 unparsed: str | None = None) -> None:  # fmt: skip
        self.name, self.tokenizer, self.longest = name, tokenizer, longest
        self.vocab, self.bytes_per_token = vocab, bytes_per_token  # vocab: the embedding's rows
        self.unparsed = unparsed  # the chat template does not parse: every chat request's answer

    def parse(self, raw: bytes) -> dict:
        """A request body as a JSON object, with no parameter the server would have to ignore."""
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise RequestError("the request body is not valid JSON (or nests too deeply)") from None
        if not isinstance(body, dict):
            raise RequestError("the request body is not a JSON object")
        self.model(body)
        for name in FLAGS:
            if body.get(name) is not None and not isinstance(body[name], bool):
                raise RequestError(f"{name}: give true or false (a JSON boolean), not {json.dumps(body[name])}",
                                   param=name)  # fmt: skip
        for name, kind in NUMBERS.items():
            try:
                AS[kind].validate_python(body.get(name))
            except ValidationError:
                what = "an integer" if kind is int else "a number"
                raise RequestError(f"{name}: give {what}, not {json.dumps(body[name])}", param=name) from None
        for name, fine in UNHONOURED.items():
            if name in body and not any(_same(body[name], value) for value in fine):
                raise RequestError(
                    f"{name}: this server only captures the prompt's hidden states (no text is generated, one answer "
                    f"a request, no stream, no log-probabilities); leave {name} out",
                    param=name,
                )
        return body

    def tokens(self, body: dict, chat: bool) -> list[int]:
        """The prompt's token ids; what the tokenizer or the chat template refuses is the request's fault."""
        try:
            return self.messages(body) if chat else self.prompt(body)
        except RequestError:
            raise
        except (TypeError, ValueError, UnicodeError, RecursionError) as exc:
            said = (str(exc).splitlines() or [""])[0][:200]
            param = "messages" if chat else "prompt"
            raise RequestError(f"{param}: the tokenizer cannot encode it ({type(exc).__name__}: {said}); send the "
                               "prompt's token ids to /v1/completions instead", param=param) from None  # fmt: skip

    def model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.name:
            raise RequestError(f"the model `{model}` does not exist; this server serves `{self.name}`", param="model")

    def prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            _encodable(prompt, "prompt", "prompt")
            special = body.get("add_special_tokens", True) is not False
            ids = self.tokenizer(prompt, add_special_tokens=special)["input_ids"] if prompt else []
        elif isinstance(prompt, list):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise RequestError("prompt: give one list of integer token ids, or one string", param="prompt")
            ids = prompt
        else:
            raise RequestError("prompt: give one list of integer token ids, or one string", param="prompt")
        return self.checked(ids, "prompt")

    def messages(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages: give a non-empty list of {role, content} messages", param="messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content", ""), str):
                raise RequestError(
                    "messages: only text content is served (eagle-extract serve has no multimodal processor); "
                    "give each message's content as a string",
                    param="messages",
                )
        for i, m in enumerate(messages):
            _encodable(m.get("content", ""), "messages", f"messages[{i}].content")
        if self.unparsed:
            raise RequestError(f"messages: {self.unparsed}", param="messages")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages,
                tokenize=True,
                add_generation_prompt=bool(body.get("add_generation_prompt", False)),
                continue_final_message=bool(body.get("continue_final_message", False)),
                return_dict=False,
            )
        except Exception as exc:
            said = " ".join(str(exc).split())[:300]  # jinja2's syntax errors add a line of their own
            raise RequestError(
                f"messages: the chat template refused them ({type(exc).__name__}: {said}); fix the messages, or send "
                "the prompt's token ids to /v1/completions",
                param="messages",
            ) from None
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        return self.checked(list(ids), "messages")

    def checked(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise RequestError(f"{param}: the prompt is empty", param=param)
        bad = next((t for t in ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise RequestError(f"{param}: token id {bad} is outside the vocabulary of {self.vocab}", param=param)
        if len(ids) > self.longest:
            raise RequestError(
                f"{param}: {len(ids)} tokens, longer than the {self.longest} this server takes (--seq-length, and "
                "the model's context less one)",
                param=param,
            )
        return ids
