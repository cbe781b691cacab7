"""The prompt's tokens as vLLM will see them, without transformers: the model's own
tokenizer (tokenizer.json, via the `tokenizers` library) and chat template
(tokenizer_config.json, rendered with jinja2 the way Hugging Face renders it).

Chat: the template renders `messages` with add_generation_prompt=True and the special
tokens; the text is tokenized without adding special tokens (vLLM's chat default: the
template already holds them). Completions: a string prompt is tokenized with special
tokens (vLLM's default there); a prompt given as token ids is used as is.

`RouteHints` turns a request body into the Route fields the router's prefix scoring needs
(block hashes, prompt token count, adapter, session key). When the prompt cannot be read
(a content type we do not render, a template error) the hints are empty and the request
is routed on load alone: tokenizing is an optimisation, never a reason to fail a request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from hpcserve.contracts.prefix_hash import prompt_block_hashes

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _special(config: Mapping[str, Any], name: str) -> str:
    value = config.get(name)
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer configs
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _text(content: Any) -> str:
    """Message content as vLLM renders it for a text model: parts' text joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise ValueError(f"content part {part!r} is not text")
        return "\n".join(parts)
    raise ValueError(f"message content of type {type(content).__name__} is not text")


class PromptTokenizer:
    def __init__(
        self, tokenizer: Tokenizer, chat_template: str | None, special: Mapping[str, str]
    ) -> None:
        self.tokenizer = tokenizer
        self.special = dict(special)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent
        )
        self._template = env.from_string(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> PromptTokenizer:
        d = Path(model_dir)
        tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        config_path = d / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = d / "chat_template.jinja"
        if not template and jinja_file.exists():
            template = jinja_file.read_text()
        special = {
            name: _special(config, name)
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        return cls(tokenizer, template if isinstance(template, str) else None, special)

    def render_chat(self, messages: list[dict[str, Any]], **extra: Any) -> str:
        if self._template is None:
            raise ValueError("the model has no chat template")
        msgs = [{**m, "content": _text(m.get("content"))} for m in messages]
        return self._template.render(
            messages=msgs, add_generation_prompt=True, **self.special, **extra
        )

    def chat_tokens(self, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
        text = self.render_chat(messages, **extra)
        # encode_batch releases the GIL (encode does not): the gateway tokenizes long
        # prompts on threads beside its event loop (gateway/app.py prefix_hints).
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def prompt_tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode_batch([prompt], add_special_tokens=True)[0].ids
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        raise ValueError("prompt is neither a string nor a list of token ids")


class RouteHints:
    """Per model: its PromptTokenizer and the replicas' KV block size.

    `hints(model, payload, headers)` returns keyword fields for protocol.Route.
    """

    def __init__(self) -> None:
        self._models: dict[str, tuple[PromptTokenizer, int]] = {}
        self._adapters: dict[str, str] = {}

    def add_model(self, model: str, tokenizer: PromptTokenizer, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size of {model!r} must be > 0, got {block_size}")
        self._models[model] = (tokenizer, block_size)

    def add_adapter(self, adapter: str, base_model: str) -> None:
        self._adapters[adapter] = base_model

    def __contains__(self, model: str) -> bool:
        return model in self._models or model in self._adapters

    def tokens(self, model: str, payload: Mapping[str, Any]) -> list[int]:
        tokenizer, _ = self._models[self._adapters.get(model, model)]
        messages = payload.get("messages")
        if messages is not None:
            extra = {}
            if payload.get("tools"):
                extra["tools"] = payload["tools"]
            return tokenizer.chat_tokens(messages, **extra)
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        return tokenizer.prompt_tokens(prompt)  # type: ignore[arg-type]

    def covers(self, model: str) -> bool:
        """Whether `model`'s prompts are hashed (its tokenizer is known), so the caller decodes
        a request body for `hints` only when it is used."""
        return self._adapters.get(model, model) in self._models

    def hints(
        self, model: str, payload: Mapping[str, Any], headers: Mapping[str, str]
    ) -> dict[str, Any]:
        hints: dict[str, Any] = {}
        session = headers.get(SESSION_HEADER)
        if session:
            hints["session_key"] = session[:256]
        base = self._adapters.get(model, model)
        entry = self._models.get(base)
        if entry is None:
            return hints
        _, block_size = entry
        try:
            tokens = self.tokens(model, payload)
        except (ValueError, TypeError, KeyError, jinja2.TemplateError) as err:
            log.debug("no prompt hints for %s: %s", model, err)
            return hints
        adapter = model if model in self._adapters else ""
        hints.update(
            block_hashes=prompt_block_hashes(tokens, block_size, adapter),
            block_size=block_size,
            prompt_tokens=len(tokens),
        )
        if adapter:
            hints["adapter"] = adapter
        return hints


HintsFn = Callable[[str, Mapping[str, Any], Mapping[str, str]], dict[str, Any]]
