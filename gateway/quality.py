"""Online quality per deployment: what the answers of each (model, version, adapter) said.

Counted per answer a replica gave, labelled with the name the client asked for (`model`:
a served name, an alias or an adapter), the registry version the replica serves
(`version`, name@version from RouteReply.model_ref; empty for a model_path pool) and the
LoRA adapter (`adapter`, empty for the base model). A staged rollout compares the new
version with the stable one on these (poolmgr/rollout.py).

- errors: the answer was a 5xx, or the engine failed before or during the answer (an
  attempt retried on another replica counts for the version that failed);
- truncations: some choice ended with finish_reason "length";
- structured / structured_invalid: answers (200) to requests for JSON output
  (`response_format` json_object or json_schema, or vLLM's `structured_outputs.json`), and
  those whose text does not parse as strict JSON (a truncated one included: the client
  cannot parse it either);
- refusals: the answer (choice 0) opens with a refusal phrase, `REFUSAL_PREFIXES` on the
  first `REFUSAL_SCAN_CHARS` characters, lower-cased, curly apostrophes straightened,
  or the message carries OpenAI's `refusal` field. A heuristic for English chat models: it
  misses refusals worded otherwise and counts an answer that merely opens that way; watch
  its trend per version, never a single answer.

Cost on the hot path: a whole answer is decoded once (msgspec, choices only). A stream's
chunks are searched for `"finish_reason":"length"` (bytes, across chunk boundaries) and
decoded only until the first `REFUSAL_SCAN_CHARS` characters of text are in, except for
structured requests, whose whole text is kept to be checked once at the end.
"""

from __future__ import annotations

import msgspec

from hpcserve.gateway.metrics import GatewayMetrics

REFUSAL_SCAN_CHARS = 64
REFUSAL_PREFIXES = (
    "i'm sorry, but i can",
    "i am sorry, but i can",
    "i'm sorry, i can",
    "i am sorry, i can",
    "sorry, but i can",
    "sorry, i can't",
    "sorry, i cannot",
    "i cannot help",
    "i can't help",
    "i cannot assist",
    "i can't assist",
    "i cannot provide",
    "i can't provide",
    "i cannot comply",
    "i can't comply",
    "i won't be able to",
    "i'm not able to help",
    "i am not able to help",
    "i'm unable to help",
    "i am unable to help",
    "i'm unable to provide",
    "i am unable to provide",
    "as an ai language model, i can",
)
# vLLM writes compact JSON; other OpenAI servers (and the simulator) put a space after ':'.
_LENGTH = (b'"finish_reason":"length"', b'"finish_reason": "length"')
_TAIL = max(len(p) for p in _LENGTH) - 1


def _truncated(data: bytes) -> bool:
    return data.find(_LENGTH[0]) >= 0 or data.find(_LENGTH[1]) >= 0  # not `in`: relay.py


def is_refusal(text: str) -> bool:
    head = text[:REFUSAL_SCAN_CHARS].lstrip().lower().replace("\u2019", "'")
    return head.startswith(REFUSAL_PREFIXES)


def is_json(text: str) -> bool:
    try:
        msgspec.json.decode(text)
    except msgspec.DecodeError:
        return False
    return True


def wants_json(parsed: object) -> bool:
    """Whether a checked request (gateway/validate.py) asks for JSON output."""
    fmt = getattr(parsed, "response_format", None)
    if fmt is not None and fmt.type in ("json_object", "json_schema"):
        return True
    outputs = getattr(parsed, "structured_outputs", None)
    return outputs is not None and outputs.json not in (None, False)


class _Message(msgspec.Struct):
    content: str | None = None
    refusal: str | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    finish_reason: str | None = None
    message: _Message | None = None  # chat
    delta: _Message | None = None  # chat, streamed
    text: str | None = None  # completions


class _Answer(msgspec.Struct):
    choices: list[_Choice] = []


_answer = msgspec.json.Decoder(_Answer)


class OutputWatch:
    """One answer, whole (`whole`) or streamed (`feed` per chunk); read at the end."""

    __slots__ = (
        "_chars",
        "_pending",
        "_reading",
        "_tail",
        "refused",
        "structured",
        "texts",
        "truncated",
    )

    def __init__(self, structured: bool) -> None:
        self.structured = structured
        self.truncated = False
        self.refused = False
        self.texts: dict[int, list[str]] = {}  # choice index -> its text's pieces
        self._reading = True  # still decoding stream events for their text
        self._chars = 0  # of choice 0's text so far
        self._pending = b""
        self._tail = b""

    def whole(self, payload: bytes) -> None:
        try:
            answer = _answer.decode(payload)
        except msgspec.DecodeError:
            return
        for choice in answer.choices:
            self._choice(choice, choice.message)

    def feed(self, chunk: bytes) -> None:
        if not self.truncated:
            head = self._tail + chunk[:_TAIL]  # a pattern cut by the chunk boundary
            if chunk.find(b"length") >= 0 or head.find(b"length") >= 0:
                self.truncated = _truncated(chunk) or _truncated(head)
            self._tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else head[-_TAIL:]
        if not self._reading:
            return
        data = self._pending + chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._pending = data
            return
        self._pending = data[cut + 2 :]
        for event in data[:cut].split(b"\n\n"):
            if event.startswith(b"data: {"):
                try:
                    answer = _answer.decode(event[6:])
                except msgspec.DecodeError:
                    continue
                for choice in answer.choices:
                    self._choice(choice, choice.delta)
        if not self.structured and self._chars >= REFUSAL_SCAN_CHARS:
            self._reading = False
            self._pending = b""

    def _choice(self, choice: _Choice, message: _Message | None) -> None:
        if choice.finish_reason == "length":
            self.truncated = True
        text = choice.text if message is None else message.content
        if message is not None and message.refusal:
            self.refused = True
        if text:
            self.texts.setdefault(choice.index, []).append(text)
            if choice.index == 0:
                self._chars += len(text)

    def refusal(self) -> bool:
        return self.refused or is_refusal("".join(self.texts.get(0, ())))

    def valid_json(self) -> bool:
        """Every choice's text parses as JSON (no text at all: not valid)."""
        if not self.texts:
            return False
        return all(is_json("".join(pieces)) for pieces in self.texts.values())


class DeploymentMetrics:
    """The labelled children of one (model, version, adapter), looked up once."""

    __slots__ = (
        "answers",
        "errors",
        "refusals",
        "structured",
        "structured_invalid",
        "truncations",
        "ttft",
    )

    def __init__(self, metrics: GatewayMetrics, model: str, version: str, adapter: str) -> None:
        labels = (model, version, adapter)
        self.answers = metrics.answers.labels(*labels)
        self.errors = metrics.answer_errors.labels(*labels)
        self.truncations = metrics.truncations.labels(*labels)
        self.structured = metrics.structured.labels(*labels)
        self.structured_invalid = metrics.structured_invalid.labels(*labels)
        self.refusals = metrics.refusals.labels(*labels)
        self.ttft = metrics.deployment_ttft.labels(*labels)

    def failed(self) -> None:
        """An attempt that failed before the answer (then retried elsewhere, or a 5xx)."""
        self.answers.inc()
        self.errors.inc()

    def answered(self, status: int, watch: OutputWatch | None, ttft_s: float | None) -> None:
        """A finished answer: `status` as the client got it (499: the client went away,
        counted as an answer and nothing else)."""
        self.answers.inc()
        if status >= 500:
            self.errors.inc()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if watch is None or status != 200:
            return
        if watch.truncated:
            self.truncations.inc()
        if watch.structured:
            self.structured.inc()
            if not watch.valid_json():
                self.structured_invalid.inc()
        if watch.refusal():
            self.refusals.inc()
