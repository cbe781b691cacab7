"""What a gateway already rendered, tokenized and hashed of its prompts, per model.

Prompts repeat their leading parts: a system prompt, a few-shot header, a document, the
earlier turns of a conversation. `PromptCache` keeps, for each leading part seen, its block
hashes (contracts/prefix_hash.py), its token count, the tokens of its last partial block
and the text after its last hard boundary (not tokenized yet), as nodes keyed by where they
hang (a parent node, or the root for a prefix key) and the piece that leads to them. A
request finds the longest part cached and renders, tokenizes and hashes only what follows
it. Bounded by bytes, least recently used first.

A chat rendered by message is cached by prefix: each node holds everything of the prompt up
to a message (all its block hashes, its token count, its last partial block) and is keyed
under its root by a prefix key that names every message up to it: a keyed hash of their
bytes in the request body (the gateway's path, `RouteHints.plan_body`: a message seen
before is not even decoded), or of their roles and contents when the caller has decoded
them. A request looks its keys up from the last (`longest`): a prompt seen before takes one
lookup, one with a new last message two, and only the node found is touched, so a shared
system prompt stays as long as new conversations start from it, and a conversation's
earlier turns need not stay once a later one is cached. Other prompts (rendered whole, cut
at hard boundaries) are chains of pieces walked from the root, a leading part touched after
what follows it, so that a prefix outlives its continuations.

Exact, not approximate: the hashes equal those of rendering and tokenizing the whole prompt
(tests/unit/test_prompt_cache.py: a table and random conversations, and transformers' own
chat template), because of two facts, checked when a model is added:

* Tokenizing can be cut at hard boundaries (`Boundaries`). A Hugging Face tokenizer splits
  the text at its added tokens first, then normalizes, pre-tokenizes and models each piece
  alone. The position just after a special token S (or just before one) is a hard boundary
  when S is matched there whatever follows (or precedes) it: no added token can match
  across that position or overlap S, S strips no whitespace, and no step of the pipeline
  depends on where a piece starts (Metaspace's prepend_scheme "first" does; such a
  tokenizer, or one that truncates, gets no boundaries: whole prompts are cached then).
  The tokens of a text up to a hard boundary are the leading tokens of the whole text's.

* Rendering by message (`MessageChunks`). Many chat templates render each message into a
  piece that depends only on the message (and on whether it is the first), followed by a
  fixed generation prompt. Probing the template with a set of conversations at start tells
  whether this one does; when it does not (a system prompt folded into the last user turn,
  reasoning dropped from earlier turns) or a request carries tools, the whole prompt is
  rendered and only its tokenizing is cached, by the pieces between hard boundaries. A
  sample of the requests rendered by message is also rendered whole and compared; one
  difference turns rendering by message off for the model (logged once, counted).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer

from hpcserve.contracts.prefix_hash import chain_hashes, chain_seed

log = logging.getLogger(__name__)

Render = Callable[[list[dict[str, Any]], bool], str]
"""A chat template: (messages, add_generation_prompt) -> text."""


# -- hard boundaries ----------------------------------------------------------------------


def _position_dependent(spec: Mapping[str, Any]) -> str:
    """Why tokenizing a piece alone may differ from tokenizing it inside a longer text ("":
    it cannot)."""
    if spec.get("truncation") or spec.get("padding"):
        return "the tokenizer truncates or pads"
    stack = [spec.get("pre_tokenizer")]
    while stack:
        step = stack.pop()
        if not isinstance(step, dict):
            continue
        if step.get("type") == "Metaspace" and step.get("prepend_scheme") == "first":
            return "its Metaspace pre-tokenizer prepends to the first piece only"
        stack.extend(step.get("pretokenizers") or [])
    return ""


def _cut_after_is_hard(s: str, added: Sequence[str]) -> bool:
    """Whether no added token (S itself included) can match across the end of an S, or
    overlap S's start, whatever text surrounds it."""
    for t in added:
        if t != s and s in t:
            return False  # a longer token holding S would be matched instead
        for k in range(1, len(t)):  # t would span k characters before the cut
            if k <= len(s) and t[:k] == s[-k:]:
                return False
            if k > len(s) and t[k - len(s) : k] == s:
                return False
        for j in range(1, len(s)):  # t would end j characters into S
            if len(t) > j and t.endswith(s[:j]):
                return False
    return True


def _cut_before_is_hard(s: str, added: Sequence[str]) -> bool:
    """Whether no added token can match across the start of an S, whatever precedes it."""
    for t in added:
        if t != s and s in t:
            return False
        for k in range(1, len(t)):  # t would start k characters before the cut
            rest = t[k:]
            if s.startswith(rest) if len(rest) <= len(s) else rest.startswith(s):
                return False
    return True


def _soft_edge(c: str) -> bool:
    """A token edge that whitespace stripping or a single-word rule could look past."""
    return c.isalnum() or c == "_" or c.isspace()


class Boundaries:
    """Hard boundaries of one tokenizer (see the module docstring): `last(text)` is the last
    position in `text` where its tokens can be cut (0: none)."""

    def __init__(self, tokenizer: Tokenizer, candidates: Iterable[str] | None = None) -> None:
        """candidates: the added tokens worth cutting at (those a chat template writes);
        None: every added token (slow for a vocabulary with thousands of them)."""
        spec = json.loads(tokenizer.to_str())
        added = [t for t in spec.get("added_tokens") or [] if t.get("content")]
        contents = [t["content"] for t in added]
        wanted = set(contents if candidates is None else candidates)
        self.reason = _position_dependent(spec)
        after: set[str] = set()
        before: set[str] = set()
        if not self.reason:
            for token in added:
                s = token["content"]
                if s not in wanted or token.get("normalized") or token.get("single_word"):
                    continue
                if (
                    not token.get("rstrip")
                    and not _soft_edge(s[-1])
                    and _cut_after_is_hard(s, contents)
                ):
                    after.add(s)
                if (
                    not token.get("lstrip")
                    and not _soft_edge(s[0])
                    and _cut_before_is_hard(s, contents)
                ):
                    before.add(s)
            if not after and not before:
                self.reason = "no special token makes a hard boundary"
        self.after, self.before = after, before
        tokens = sorted(after | before, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, tokens))) if tokens else None

    def last(self, text: str, start: int = 0) -> int:
        """The last hard boundary in `text` at or after `start` (`start` when none)."""
        cut = start
        if self._pattern is None:
            return cut
        for match in self._pattern.finditer(text, start):
            token = match.group()
            if token in self.after:
                cut = match.end()
            elif token in self.before:
                cut = match.start()
        return cut

    def all(self, text: str) -> list[int]:
        """Every hard boundary in `text`, ascending, ending with len(text)."""
        cuts: list[int] = []
        if self._pattern is not None:
            for match in self._pattern.finditer(text):
                token = match.group()
                if (
                    token in self.before
                    and match.start()
                    and (not cuts or cuts[-1] < match.start())
                ):
                    cuts.append(match.start())
                if token in self.after and match.end() < len(text):
                    cuts.append(match.end())
        cuts.append(len(text))
        return cuts


# -- rendering by message -------------------------------------------------------------------

_PREDECESSOR: dict[str, Any] = {"role": "user", "content": "Hello."}
_CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
_PROBES: dict[str, dict[str, Any]] = {
    "sys": {"role": "system", "content": "You answer briefly."},
    "sys2": {"role": "system", "content": "Another rule.\n"},
    "u1": {"role": "user", "content": "What is the capital of France?"},
    "u2": {"role": "user", "content": "  And of Spain?  \n"},
    "u3": {"role": "user", "content": ""},
    "u4": {"role": "user", "content": [{"type": "text", "text": "part one"}, "part two"]},
    "a1": {"role": "assistant", "content": "Paris."},
    "a2": {"role": "assistant", "content": "<think>Spain's capital</think>Madrid."},
    "a3": {"role": "assistant", "content": None, "tool_calls": [_CALL]},
    "t1": {"role": "tool", "tool_call_id": "call_1", "content": "42"},
}
_CONVERSATIONS = (
    "u1", "sys u1", "sys u1 a1 u2", "u1 a1 u2 a2 u3", "sys u1 a2 u2 a1 u1", "u1 a3 t1 a1 u2",
    "sys u1 a3 t1 a2 u2 a1 u4", "sys sys2 u1", "u1 u2", "a1 u1", "u1 a1", "sys u4 a2",
    "u2 a2 u1 a2 u2 a1 u3",
)  # fmt: skip


_MARK = "q7Zx3hpcserveMark"
# Contents a template might treat specially (whitespace, reasoning, quotes, markup, its own
# syntax): a role whose messages render them other than as given is rendered each time.
_AWKWARD = (
    "line one\n\nline two\t",
    "<think>reasoning</think>answer",
    "a </think> b",
    "'single' \"double\" \\ back",
    "{{ not jinja }} {% raw %} <|x|> [INST] </s>",
    "ünïcødé 🚢",
    " ",
    "",
)


class MessageChunks:
    """A chat template's rendering as one piece per message and a generation prompt, when
    probing shows the template renders that way; `reason` says why not ("" when it does)."""

    def __init__(self, render: Render) -> None:
        self._render = render
        self.generation = ""
        self._shapes: dict[tuple[Any, bool], tuple[str, str, bool] | None] = {}
        try:
            self._before = render([_PREDECESSOR], False)
            self.reason = self._probe()
        except Exception as err:  # a template that fails on plain messages
            self.reason = f"the template failed on a probe conversation ({err})"

    def chunk(self, message: dict[str, Any], first: bool) -> str:
        """The text `message` renders to in a conversation (first: as its first message)."""
        content = message.get("content")
        if len(message) == 2 and isinstance(content, str):
            key = (message.get("role"), first)
            if key not in self._shapes:
                self._shapes[key] = self._shape(str(key[0]), first)
            shape = self._shapes[key]
            if shape is not None:  # the template's own text around the content, as probed
                head, tail, trim = shape
                return head + (content.strip() if trim else content) + tail
        return self._render_chunk(message, first)

    def _render_chunk(self, message: dict[str, Any], first: bool) -> str:
        if first:
            return self._render([message], False)
        text = self._render([_PREDECESSOR, message], False)
        if not text.startswith(self._before):
            raise ValueError("the template renders a message's predecessor differently")
        return text[len(self._before) :]

    def _shape(self, role: str, first: bool) -> tuple[str, str, bool] | None:
        """How a {role, content} message renders: (text before the content, text after it,
        whether the content is stripped), when the template writes the content as is (or
        stripped) whatever it holds; None when it does anything else (a plain render)."""
        try:
            plain = self._render_chunk({"role": role, "content": _MARK}, first)
            head, found, tail = plain.partition(_MARK)
            if not found or _MARK in tail:
                return None
            trim = head + _MARK + tail == self._render_chunk(
                {"role": role, "content": f"  {_MARK} \n"}, first
            )
            for content in _AWKWARD:
                want = head + (content.strip() if trim else content) + tail
                if self._render_chunk({"role": role, "content": content}, first) != want:
                    return None
        except Exception:  # a role the template refuses
            return None
        return head, tail, trim

    def _probe(self) -> str:
        checked = 0
        generation: str | None = None
        for names in _CONVERSATIONS:
            messages = [_PROBES[name] for name in names.split()]
            try:
                whole = self._render(messages, True)
                without = self._render(messages, False)
            except Exception:
                continue  # a conversation this template refuses (e.g. roles must alternate)
            if not whole.startswith(without):
                return "the generation prompt is not appended to the conversation"
            suffix = whole[len(without) :]
            if generation is None:
                generation = suffix
            elif suffix != generation:
                return "the generation prompt depends on the conversation"
            pieces = [self.chunk(m, i == 0) for i, m in enumerate(messages)]
            if "".join(pieces) + suffix != whole:
                return f"messages render differently in the conversation ({names})"
            checked += 1
        if not checked:
            return "the template refused every probe conversation"
        self.generation = generation or ""
        return ""


# -- the cache --------------------------------------------------------------------------


class _Node:
    __slots__ = ("hashes", "id", "key", "last", "n", "pending", "size", "tail")

    def __init__(
        self,
        node_id: int,
        key: tuple[Any, ...] | None,
        n: int,
        hashes: array[int],
        last: int,
        tail: list[int],
        pending: str,
        size: int,
    ) -> None:
        self.id = node_id
        self.key = key
        self.n = n  # tokens up to the last hard boundary
        self.hashes = hashes  # of the full blocks among them
        self.last = last  # the chain's last hash (its seed when no block is full)
        self.tail = tail  # the tokens after the last full block
        self.pending = pending  # the text after the last hard boundary, not tokenized
        self.size = size


_NODE_BYTES = 200  # a node's own overhead, about


# Roots (adapter and cache salt pairs) a model's cache keeps: tenants times the salts their
# clients set, the least recently used dropped past it.
MAX_ROOTS = 4096


class PromptCache:
    """The trie of one model's leading prompt parts (see the module docstring), shared by
    the event loop and the hint threads (one lock around every change)."""

    def __init__(self, block_size: int, max_bytes: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self._nodes: OrderedDict[tuple[Any, ...], _Node] = OrderedDict()
        # (adapter, cache salt) -> its root, oldest first; at most MAX_ROOTS (clients choose
        # salts). A root made again gets a new id, so its old children never match.
        self._roots: OrderedDict[tuple[str, str], _Node] = OrderedDict()
        self._next_root_id = -1
        self._next_id = 1
        self.bytes = 0
        self.hit_tokens = 0  # prompt tokens found here
        self.miss_tokens = 0  # prompt tokens tokenized
        self.miss_chars = 0  # characters tokenized (their tokens are miss_tokens)
        self.deferred_tokens = 0  # estimated tokens of new last messages not tokenized
        self.evicted = 0

    def root(self, adapter: str, salt: str = "") -> _Node:
        """The start of the prompts of `adapter` ("": the base model) under the cache salt
        `salt` ("": none): their hashes chain from their own seed."""
        node = self._roots.get((adapter, salt))
        if node is None:
            seed = chain_seed(adapter, salt)
            node = _Node(self._next_root_id, None, 0, array("q"), seed, [], "", 0)
            self._next_root_id -= 1
            self._roots[(adapter, salt)] = node
            if len(self._roots) > MAX_ROOTS:  # its children age out of the LRU unreached
                self._roots.popitem(last=False)
        else:
            self._roots.move_to_end((adapter, salt))
        return node

    def get(self, parent: _Node, piece: Any) -> _Node | None:
        """The child of `parent` for `piece`, if cached (call with the lock held)."""
        return self._nodes.get((parent.id, piece))

    def walk(self, node: _Node, pieces: Iterable[Any]) -> list[_Node]:
        """`node` and its descendants for `pieces`, one after another, as far as cached
        (call with the lock held)."""
        get = self._nodes.get
        path = [node]
        for piece in pieces:
            child = get((node.id, piece))
            if child is None:
                break
            node = child
            path.append(node)
        return path

    def longest(self, root: _Node, keys: Sequence[Any]) -> tuple[int, _Node]:
        """The longest prefix of a prompt cached under `root`, whose pieces are named by
        prefix keys (each names every piece up to it): (how many keys it covers, its node),
        (0, `root`) when none. Searched from the longest, so a prompt seen before up to its
        last piece takes one lookup (call with the lock held)."""
        get = self._nodes.get
        root_id = root.id
        for count in range(len(keys), 0, -1):
            node = get((root_id, keys[count - 1]))
            if node is not None:
                return count, node
        return 0, root

    def touch(self, path: Sequence[_Node]) -> None:
        """Mark a walked path used, its leading parts last (call with the lock held)."""
        nodes = self._nodes
        for node in reversed(path):
            if node.key is not None and node.key in nodes:
                nodes.move_to_end(node.key)

    def extend(
        self,
        parent: _Node,
        piece: Any,
        tokens: Sequence[int],
        pending: str,
        under: _Node | None = None,
    ) -> _Node:
        """The node after `parent` that adds `tokens` (tokenized up to a hard boundary) and
        leaves `pending` untokenized; stored unless the cache is off, keyed by (`parent`,
        `piece`), or by (`under`, `piece`) for a prefix key under its root (call without the
        lock: it hashes)."""
        size = self.block_size
        seq = parent.tail + list(tokens) if parent.tail else list(tokens)
        new = chain_hashes(seq, size, parent.last)
        hashes = parent.hashes + array("q", new) if new else parent.hashes
        node = _Node(
            0,
            None,
            parent.n + len(tokens),
            hashes,
            new[-1] if new else parent.last,
            seq[len(new) * size :],
            pending,
            0,
        )
        if not self.max_bytes:
            return node
        key = ((under or parent).id, piece)
        piece_bytes = (
            len(piece[-1])
            if isinstance(piece, tuple) and isinstance(piece[-1], (str, bytes))
            else 64
        )
        node.size = _NODE_BYTES + piece_bytes + 8 * len(hashes) + 32 * len(node.tail) + len(pending)
        with self.lock:
            known = self._nodes.get(key)
            if known is not None:  # another thread made it meanwhile
                return known
            node.id, node.key = self._next_id, key
            self._next_id += 1
            self._nodes[key] = node
            self.bytes += node.size
            while self.bytes > self.max_bytes and self._nodes:
                _, old = self._nodes.popitem(last=False)
                self.bytes -= old.size
                self.evicted += 1
        return node

    def clear(self) -> None:
        with self.lock:
            self._nodes.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._nodes)
