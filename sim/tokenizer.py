"""Prompt tokens the way vLLM's OpenAI server makes them, without transformers.

With a model directory (tokenizer.json + tokenizer_config.json, as Hugging Face saves them)
the ids are the model's own, made by the router's ``PromptTokenizer``
(contracts/prompt_tokens.py): chat messages rendered with the chat template of
tokenizer_config.json (jinja2, configured as transformers configures it) and encoded without
special tokens, since the template writes them; a completion prompt encoded with them. So
the token ids in the simulator's KV events are the ids the router computes for the prompt.
Without a model directory a stand-in word tokenizer gives stable ids (a CRC of each word),
for tests that need no real model.

Generated text is a fixed filler sentence cycled token by token (" tok0 tok1 ..." for the
word stand-in), so outputs are deterministic and decode to readable text.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any, Protocol

FILLER = " The quick brown fox jumps over the lazy dog."


class SimTokenizer(Protocol):
    name: str

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]: ...

    def prompt_ids(self, prompt: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def filler_ids(self) -> list[int]: ...


class TokenizerError(ValueError):
    pass


def message_text(content: Any) -> str:
    """OpenAI message content: a string, or parts of which the text parts count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    raise TokenizerError(f"message content must be a string or a list of parts, got {content!r}")


class HFTokenizer:
    """The tokenizer and chat template of a Hugging Face model directory, through the
    router's own ``PromptTokenizer`` (contracts/prompt_tokens.py): engine and router cannot
    disagree on a prompt's ids."""

    def __init__(self, model_dir: str | Path) -> None:
        from hpcserve.contracts.prompt_tokens import PromptTokenizer

        directory = Path(model_dir)
        self.name = str(directory)
        try:
            self._tok = PromptTokenizer.from_dir(directory)
        except Exception as err:  # tokenizers raises its own Exception type
            raise TokenizerError(f"cannot load the tokenizer in {directory}: {err}") from None
        self._filler = self._tok.tokenizer.encode(FILLER, add_special_tokens=False).ids

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        import jinja2

        for m in messages:
            message_text(m.get("content"))  # a clear error for content of the wrong type
        try:
            return self._tok.chat_tokens(messages)
        except (ValueError, jinja2.TemplateError) as err:
            raise TokenizerError(f"chat template of {self.name}: {err}") from None

    def prompt_ids(self, prompt: str) -> list[int]:
        return self._tok.prompt_tokens(prompt)

    def decode(self, ids: list[int]) -> str:
        return self._tok.tokenizer.decode(ids, skip_special_tokens=True)

    def filler_ids(self) -> list[int]:
        return self._filler


class WordTokenizer:
    """No model directory: one id per whitespace-separated word (CRC32 into a vocabulary),
    no template or special tokens. Its text is " tok0 tok1 ...", cycling after 64 tokens."""

    name = "words"
    VOCAB = 32000
    _FIRST = 16  # ids below are "special"

    def __init__(self) -> None:
        self._words: dict[int, str] = {}
        self._filler = self._encode(" ".join(f"tok{i}" for i in range(64)))

    def _encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            i = self._FIRST + zlib.crc32(word.encode()) % (self.VOCAB - self._FIRST)
            self._words.setdefault(i, word)
            ids.append(i)
        return ids

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The words of every message's content: no template, no special tokens."""
        return [i for m in messages for i in self._encode(message_text(m.get("content")))]

    def prompt_ids(self, prompt: str) -> list[int]:
        return self._encode(prompt)

    def decode(self, ids: list[int]) -> str:
        return "".join(" " + self._words[i] for i in ids if i in self._words)

    def filler_ids(self) -> list[int]:
        return self._filler


def load_tokenizer(model_dir: str | None) -> SimTokenizer:
    """The model directory's tokenizer when it has one, else the word stand-in."""
    if model_dir and (Path(model_dir) / "tokenizer.json").exists():
        return HFTokenizer(model_dir)
    return WordTokenizer()
