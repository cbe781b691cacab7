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

What was rendered, tokenized and hashed before is not again: each model has a
`PromptCache` (contracts/prompt_cache.py), walked by `RouteHints.plan` (cheap: dict
lookups, on the caller's thread), or from a chat body's bytes by `RouteHints.plan_body`
(each message keyed by a hash of its bytes, decoded only when the cache lacks it); what it
leaves (`HintsPlan.work` characters to render and tokenize) is done by `HintsPlan.run`, on
a thread when it is large (the tokenizer's batch API releases the GIL).
"""

from __future__ import annotations

import json
import logging
import math
import threading
from array import array
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import msgspec
from tokenizers import Tokenizer

from hpcserve.contracts.prefix_hash import prompt_block_hashes
from hpcserve.contracts.prompt_cache import Boundaries, MessageChunks, PromptCache

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
        self.chat_template = chat_template or ""
        self._template = env.from_string(chat_template) if chat_template else None
        # Tokens never fewer than bytes (a byte-level BPE): a short text's count is bounded.
        pre = json.loads(tokenizer.to_str()).get("pre_tokenizer") or {}
        self.byte_level = pre.get("type") == "ByteLevel" or any(
            step.get("type") == "ByteLevel" for step in pre.get("pretokenizers") or []
        )

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

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        if self._template is None:
            raise ValueError("the model has no chat template")
        msgs = [{**m, "content": _text(m.get("content"))} for m in messages]
        return self._template.render(
            messages=msgs, add_generation_prompt=add_generation_prompt, **self.special, **extra
        )

    def encode_pieces(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids without special tokens added (as the chat path tokenizes),
        in one call of the tokenizer's batch API (it releases the GIL; no offsets kept)."""
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def boundary_candidates(self) -> list[str]:
        """The added tokens the chat template writes (where prompts may be cut)."""
        added = self.tokenizer.get_added_tokens_decoder().values()
        texts = (self.chat_template, *self.special.values())
        return [t.content for t in added if any(t.content and t.content in x for x in texts)]

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


DEFAULT_CACHE_BYTES = 64 << 20
# Rendering by message is checked against rendering the whole prompt on the first
# VERIFY_FIRST requests a model renders that way, then on one in VERIFY_EVERY.
VERIFY_FIRST = 8
VERIFY_EVERY = 1000
_GENERATION = "g"  # (it, the last message's prefix key): the generation prompt after it
# Short new last messages remembered as seen (deferred once, see _ModelHints.chat), per
# model: at most this many, at least the newest half of it.
SEEN_LAST_MAX = 1 << 16
# Tokens per character of a deferred message until the model's own ratio is known.
_TOKENS_PER_CHAR = 0.25
_HINT_ERRORS = (
    ValueError,
    TypeError,
    KeyError,
    AttributeError,
    jinja2.TemplateError,
    msgspec.DecodeError,
)
_encode = msgspec.json.Encoder()
_decode_dict = msgspec.json.Decoder(dict[str, Any]).decode


class _BodyMessages(Sequence[dict[str, Any]]):
    """A chat body's messages (at message_spans' spans), each decoded when first read."""

    __slots__ = ("_body", "_decoded", "_spans")

    def __init__(self, body: bytes, spans: Sequence[tuple[int, int, int]]) -> None:
        self._body = memoryview(body)
        self._spans = spans
        self._decoded: dict[int, dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self._spans)

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        if i < 0:
            i += len(self._spans)
        message = self._decoded.get(i)
        if message is None:
            _, start, stop = self._spans[i]
            message = self._decoded[i] = _decode_dict(self._body[start:stop])
        return message

    def chars_from(self, start: int) -> int:
        """The bytes of messages[start:], about their characters (nothing decoded)."""
        return sum(stop - first for _, first, stop in self._spans[start:])


def _chars(messages: list[Any]) -> int:
    """About how much text `messages` hold (what rendering and tokenizing them costs)."""
    return sum(len(str(m.get("content") or "")) for m in messages if isinstance(m, dict))


def _message_key(message: Any, first: bool) -> tuple[Any, ...]:
    """A message as a trie piece: what its rendering depends on."""
    if not isinstance(message, dict):
        raise TypeError("a message is not an object")
    content = message.get("content")
    if len(message) == 2 and isinstance(content, str) and "role" in message:
        return ("m", first, message["role"], content)
    return ("j", first, _encode.encode(message))


def hash_stride(every_tokens: int, block_size: int) -> int:
    """Blocks per sampled hash for one hash per `every_tokens` prompt tokens (at least 1)."""
    return max(1, every_tokens // block_size)


def hash_fields(hashes: Sequence[int], block_size: int, stride: int) -> dict[str, Any]:
    """Route's block-hash fields for a prompt's chain of full-block `hashes`: every one, or
    with a stride k > 1 every k-th and the last (protocol.Route.hash_stride)."""
    n = len(hashes)
    if stride == 1 or n < 2:
        every = hashes.tolist() if isinstance(hashes, array) else list(hashes)
        return {"block_hashes": every, "block_size": block_size}
    sampled = hashes[stride - 1 :: stride]
    sent = sampled.tolist() if isinstance(sampled, array) else list(sampled)
    if n % stride:
        sent.append(hashes[-1])
    return {
        "block_hashes": sent,
        "block_size": block_size,
        "hash_stride": stride,
        "hashed_blocks": n,
    }


class HintsPlan:
    """One request's hints: `result` when the cache held all of it, else `run()` renders,
    tokenizes and hashes the `work` characters it did not hold (safe on any thread)."""

    __slots__ = ("_finish", "base", "result", "work")

    def __init__(
        self,
        base: dict[str, Any],
        result: dict[str, Any] | None = None,
        finish: Callable[[], dict[str, Any]] | None = None,
        work: int = 0,
    ) -> None:
        self.base = base
        self.result = result if finish is None else None
        self._finish = finish
        self.work = work

    def run(self) -> dict[str, Any]:
        if self._finish is None:
            return self.result if self.result is not None else self.base
        try:
            return {**self.base, **self._finish()}
        except _HINT_ERRORS as err:
            log.debug("no prompt hints: %s", err)
            return self.base


class _ModelHints:
    """One model's tokenizer, block size, prompt cache and how its prompts may be cut."""

    def __init__(
        self,
        name: str,
        tokenizer: PromptTokenizer,
        block_size: int,
        cache_bytes: int,
        defer_chars: int = 0,
        hash_stride: int = 1,
    ) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.hash_stride = hash_stride
        self.cache = PromptCache(block_size, cache_bytes)
        self.defer_chars = defer_chars if cache_bytes else 0
        # Hashes of deferred last messages, in two generations: the newer one is retired
        # whole when it holds SEEN_LAST_MAX / 2 (a dict's oldest key deleted one at a time
        # leaves the dict a scan of its deleted slots to find the next oldest).
        self._seen_last: set[int] = set()
        self._seen_before: set[int] = set()
        self.boundaries = Boundaries(tokenizer.tokenizer, tokenizer.boundary_candidates())
        self.chunks: MessageChunks | None = None
        self.mismatches = 0
        self._rendered = 0
        self._verify_lock = threading.Lock()
        if not cache_bytes:
            return
        if self.boundaries.reason:
            log.info("model %s: prompts cached whole only (%s)", name, self.boundaries.reason)
        elif tokenizer.chat_template:
            chunks = MessageChunks(tokenizer.render_chat)
            if chunks.reason:
                log.info("model %s: chat prompts rendered whole (%s)", name, chunks.reason)
            else:
                self.chunks = chunks

    def _result(self, node: Any, adapter: str) -> dict[str, Any]:
        out = self.hash_fields(node.hashes)
        out["prompt_tokens"] = node.n
        if adapter:
            out["adapter"] = adapter
        return out

    def hash_fields(self, hashes: Sequence[int]) -> dict[str, Any]:
        return hash_fields(hashes, self.block_size, self.hash_stride)

    # -- chat -------------------------------------------------------------------------
    def chat(
        self,
        messages: Any,
        extra: dict[str, Any],
        adapter: str,
        base: dict[str, Any],
        salt: str = "",
    ) -> HintsPlan:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages is not a non-empty list")
        if self.chunks is None or extra:
            work = _chars(messages)
            return HintsPlan(
                base,
                finish=lambda: self._chat_whole(messages, extra, adapter, salt),
                work=work + 1,
            )
        keys: list[Any] = []
        key = 0
        for i, message in enumerate(messages):  # prefix keys, as message_spans' for a body
            key = hash((key, _message_key(message, i == 0)))
            keys.append(("m", key))
        return self._chat_walk(keys, messages, adapter, base, salt)

    def chat_body(
        self,
        body: bytes,
        spans: Sequence[tuple[int, int, int]],
        adapter: str,
        base: dict[str, Any],
        salt: str = "",
    ) -> HintsPlan:
        """`chat` for a chat body whose messages lie at `spans` (message_spans: for each
        message a keyed hash of the bytes of the messages up to it, where it starts and
        stops), which key the prompt cache: a message seen before is neither decoded nor
        rendered again."""
        if self.chunks is None:
            return self.chat(_decode_dict(body).get("messages"), {}, adapter, base, salt)
        keys = [span[0] for span in spans]
        return self._chat_walk(keys, _BodyMessages(body, spans), adapter, base, salt)

    def _chat_walk(
        self,
        keys: list[Any],
        messages: Sequence[Any],
        adapter: str,
        base: dict[str, Any],
        salt: str,
    ) -> HintsPlan:
        """The hints of a chat rendered by message whose prefixes are cached under `keys`
        (prefix keys): from the longest prefix the cache holds, the rest left to the plan's
        run."""
        cache, chunks = self.cache, self.chunks
        assert chunks is not None
        with cache.lock:
            root = cache.root(adapter, salt)
            final = cache.get(root, (_GENERATION, keys[-1]))
            if final is not None:
                cache.touch((final,))
                cache.hit_tokens += final.n
                return HintsPlan(base, {**base, **self._result(final, adapter)})
            start, node = cache.longest(root, keys)
            cache.touch((node,))
            cache.hit_tokens += node.n
            defer = self.defer_chars > 0 and start < len(keys) and self._first_sight(messages)
        if defer and start == len(keys) - 1:  # only the deferred message is new
            hints = self._deferred(node, messages[-1], adapter, chunks)
            return HintsPlan(base, {**base, **hints})
        work = (
            messages.chars_from(start)
            if isinstance(messages, _BodyMessages)
            else _chars(messages[start:])  # type: ignore[arg-type]
        )
        return HintsPlan(
            base,
            finish=lambda: self._chat_chunked(
                root, node, messages, keys, start, adapter, chunks, defer, salt
            ),
            work=work + 1,
        )

    def _first_sight(self, messages: Sequence[Any]) -> bool:
        """Whether the last message is a short {role, content} message after others that
        this gateway has not seen before (call with the cache's lock held).

        Its blocks, and those of the generation prompt after it, can then be in no engine's
        KV cache unless another gateway sent the same message: they are not tokenized (the
        prompt's hashes end with the messages before it, its token count is estimated).
        Seen again (a retry, a regenerated answer), it is tokenized and cached like any
        other message. A hash collision makes a message count as seen: tokenized, exact."""
        message = messages[-1]
        if len(messages) < 2 or not isinstance(message, dict) or len(message) != 2:
            return False
        content = message.get("content")
        if not isinstance(content, str) or len(content) > self.defer_chars:
            return False
        key = hash((message.get("role"), content, len(messages)))
        seen = self._seen_last
        if key in seen or key in self._seen_before:
            return False
        seen.add(key)
        if len(seen) >= SEEN_LAST_MAX // 2:
            self._seen_before, self._seen_last = seen, set()
        return True

    def _deferred(
        self, node: Any, message: dict[str, Any], adapter: str, chunks: MessageChunks
    ) -> dict[str, Any]:
        """The hints of a prompt whose last message is deferred: the full blocks before it,
        and the token count estimated from the model's tokens per character so far."""
        chars = len(node.pending) + len(chunks.chunk(message, False)) + len(chunks.generation)
        cache = self.cache
        ratio = (
            cache.miss_tokens / cache.miss_chars if cache.miss_chars >= 4096 else _TOKENS_PER_CHAR
        )
        estimate = math.ceil(chars * ratio)
        with cache.lock:
            cache.deferred_tokens += estimate
        out = self._result(node, adapter)
        out["prompt_tokens"] = node.n + estimate
        return out

    def _chat_chunked(
        self,
        root: Any,
        node: Any,
        messages: Sequence[Any],
        keys: list[Any],
        start: int,
        adapter: str,
        chunks: MessageChunks,
        defer: bool = False,
        salt: str = "",
    ) -> dict[str, Any]:
        texts: list[str] = []
        pendings: list[str] = []
        pending = node.pending
        for i in range(start, len(messages) - 1 if defer else len(messages)):
            text = pending + chunks.chunk(messages[i], i == 0)
            cut = self.boundaries.last(text)
            texts.append(text[:cut])
            pending = text[cut:]
            pendings.append(pending)
        if not defer:
            texts.append(pending + chunks.generation)
        token_lists = self.tokenizer.encode_pieces(texts)
        cache = self.cache
        for key, tokens, rest in zip(keys[start:], token_lists, pendings, strict=False):
            node = cache.extend(node, key, tokens, rest, under=root)
        with cache.lock:
            cache.miss_tokens += sum(map(len, token_lists))
            cache.miss_chars += sum(map(len, texts))
        if defer:
            return self._deferred(node, messages[-1], adapter, chunks)
        final = cache.extend(node, (_GENERATION, keys[-1]), token_lists[-1], "", under=root)
        if self._verify_due():
            whole = self._verify(messages, adapter, final, salt)
            if whole is not None:
                return whole
        return self._result(final, adapter)

    def _verify_due(self) -> bool:
        with self._verify_lock:
            self._rendered += 1
            n = self._rendered
        return n <= VERIFY_FIRST or n % VERIFY_EVERY == 0

    def _verify(
        self, messages: Sequence[Any], adapter: str, final: Any, salt: str = ""
    ) -> dict[str, Any] | None:
        """Render and tokenize the whole prompt; on a difference, render by message no more
        and return the whole prompt's hints."""
        whole = self.tokenizer.encode_pieces([self.tokenizer.render_chat(list(messages))])[0]
        hashes = prompt_block_hashes(whole, self.block_size, adapter, salt)
        if len(whole) == final.n and hashes == final.hashes.tolist():
            return None
        self.mismatches += 1
        if self.chunks is not None:
            self.chunks = None
            self.cache.clear()
            log.warning(
                "model %s: its chat template renders a conversation differently message by "
                "message than whole (%d tokens whole, %d by message): rendering whole from now "
                "on (hpcserve_gateway_prompt_cache_mismatches_total)",
                self.name,
                len(whole),
                final.n,
            )
        out = self.hash_fields(hashes)
        out["prompt_tokens"] = len(whole)
        if adapter:
            out["adapter"] = adapter
        return out

    def _chat_whole(
        self, messages: list[Any], extra: dict[str, Any], adapter: str, salt: str = ""
    ) -> dict[str, Any]:
        """Render the whole prompt; tokenize only the pieces (between hard boundaries) the
        cache does not hold."""
        text = self.tokenizer.render_chat(messages, **extra)
        cuts = self.boundaries.all(text)
        cache = self.cache
        pieces = [text[a:b] for a, b in zip([0, *cuts], cuts, strict=False)]
        with cache.lock:
            path = cache.walk(cache.root(adapter, salt), [("t", piece) for piece in pieces])
            node = path[-1]
            cache.touch(path)
            cache.hit_tokens += node.n
        rest = pieces[len(path) - 1 :]
        if rest:
            token_lists = self.tokenizer.encode_pieces(rest)
            for piece, tokens in zip(rest, token_lists, strict=True):
                node = cache.extend(node, ("t", piece), tokens, "")
            with cache.lock:
                cache.miss_tokens += sum(map(len, token_lists))
                cache.miss_chars += sum(map(len, rest))
        return self._result(node, adapter)

    # -- completions ----------------------------------------------------------------------
    def completion(
        self, prompt: Any, adapter: str, base: dict[str, Any], salt: str = ""
    ) -> HintsPlan:
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            tokens = self.tokenizer.prompt_tokens(prompt)
            out = self.hash_fields(prompt_block_hashes(tokens, self.block_size, adapter, salt))
            out["prompt_tokens"] = len(tokens)
            if adapter:
                out["adapter"] = adapter
            return HintsPlan(base, {**base, **out})
        if self.tokenizer.byte_level and len(prompt) < self.block_size:
            bound = len(prompt.encode()) + self.tokenizer.tokenizer.num_special_tokens_to_add(False)
            if bound < self.block_size:  # no full block to match: not tokenized
                return HintsPlan(base, {**base, "prompt_tokens": bound})
        cache = self.cache
        key = ("p", prompt)
        with cache.lock:
            root = cache.root(adapter, salt)
            node = cache.get(root, key)
            if node is not None:
                cache.touch([node])
                cache.hit_tokens += node.n
                return HintsPlan(base, {**base, **self._result(node, adapter)})

        def finish() -> dict[str, Any]:
            tokens = self.tokenizer.prompt_tokens(prompt)
            made = cache.extend(root, key, tokens, "")
            with cache.lock:
                cache.miss_tokens += len(tokens)
                cache.miss_chars += len(prompt)
            return self._result(made, adapter)

        return HintsPlan(base, finish=finish, work=len(prompt) + 1)


class RouteHints:
    """Per model: its PromptTokenizer, the replicas' KV block size and a PromptCache.

    `hints(model, payload, headers)` returns keyword fields for protocol.Route; `plan` is
    the same in two steps (cache walk here, the rest where the caller runs it).
    """

    def __init__(self) -> None:
        self._models: dict[str, _ModelHints] = {}
        self._adapters: dict[str, str] = {}

    def add_model(
        self,
        model: str,
        tokenizer: PromptTokenizer,
        block_size: int,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        defer_chars: int = 0,
        hash_stride: int = 1,
    ) -> None:
        """cache_bytes: the model's prompt cache (0: none, every prompt tokenized whole).
        defer_chars: a chat's new last message of at most this many characters is not
        tokenized the first time it is seen (`_ModelHints._first_sight`; 0: always is).
        hash_stride: send every this-many-th block's hash and the last (1: every one)."""
        if block_size <= 0:
            raise ValueError(f"block_size of {model!r} must be > 0, got {block_size}")
        if hash_stride <= 0:
            raise ValueError(f"hash_stride of {model!r} must be > 0, got {hash_stride}")
        self._models[model] = _ModelHints(
            model, tokenizer, block_size, cache_bytes, defer_chars, hash_stride
        )

    def add_adapter(self, adapter: str, base_model: str) -> None:
        self._adapters[adapter] = base_model

    def __contains__(self, model: str) -> bool:
        return model in self._models or model in self._adapters

    def base_model(self, model: str) -> str:
        return self._adapters.get(model, model)

    def block_size(self, model: str) -> int:
        entry = self._models.get(self._adapters.get(model, model))
        return entry.block_size if entry is not None else 0

    def tokens(self, model: str, payload: Mapping[str, Any]) -> list[int]:
        """The prompt's tokens, rendered and tokenized whole (no cache)."""
        tokenizer = self._models[self._adapters.get(model, model)].tokenizer
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

    def plan(
        self,
        model: str,
        payload: Mapping[str, Any],
        headers: Mapping[str, str],
        salt: str = "",
    ) -> HintsPlan:
        """`salt`: the cache salt the gateway set on the request ("": none): the prompt's
        hashes chain from a seed of its own (contracts/cache_salt.py)."""
        return self._plan(model, headers, salt, payload=payload)

    def plan_body(
        self,
        model: str,
        body: bytes,
        spans: Sequence[tuple[int, int, int]] | None,
        headers: Mapping[str, str],
        salt: str = "",
    ) -> HintsPlan:
        """`plan` for a request body as it came: a chat body's messages at `spans`
        (gateway/json_scan.py message_spans) are read from its bytes, and only those the
        prompt cache does not hold are decoded; without spans the body is decoded whole."""
        return self._plan(model, headers, salt, body=body, spans=spans)

    def _plan(
        self,
        model: str,
        headers: Mapping[str, str],
        salt: str,
        payload: Mapping[str, Any] | None = None,
        body: bytes = b"",
        spans: Sequence[tuple[int, int, int]] | None = None,
    ) -> HintsPlan:
        base: dict[str, Any] = {}
        session = headers.get(SESSION_HEADER)
        if session:
            base["session_key"] = session[:256]
        entry = self._models.get(self._adapters.get(model, model))
        if entry is None:
            return HintsPlan(base, base)
        adapter = model if model in self._adapters else ""
        try:
            if spans:
                return entry.chat_body(body, spans, adapter, base, salt)
            if payload is None:
                payload = _decode_dict(body)
            messages = payload.get("messages")
            if messages is not None:
                extra = {"tools": payload["tools"]} if payload.get("tools") else {}
                return entry.chat(messages, extra, adapter, base, salt)
            return entry.completion(payload.get("prompt"), adapter, base, salt)
        except _HINT_ERRORS as err:
            log.debug("no prompt hints for %s: %s", model, err)
            return HintsPlan(base, base)

    def hints(
        self,
        model: str,
        payload: Mapping[str, Any],
        headers: Mapping[str, str],
        salt: str = "",
    ) -> dict[str, Any]:
        return self.plan(model, payload, headers, salt).run()

    def cache_stats(self) -> list[tuple[str, PromptCache, int, bool]]:
        """(model, its cache, rendering mismatches, rendered by message) per model."""
        return [
            (m.name, m.cache, m.mismatches, m.chunks is not None) for m in self._models.values()
        ]


HintsFn = Callable[[str, Mapping[str, Any], Mapping[str, str]], dict[str, Any]]
