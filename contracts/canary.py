"""Numerical canaries: a version's golden record and the comparison with it (pure).

A golden record holds, for each of a fixed set of prompts, what a replica of one registry
version decoded greedily: temperature 0, `ignore_eos`, `max_tokens` tokens, each token's id,
its logprob and the `top_logprobs` most likely alternatives. Every replica of that version
is compared with it before it registers for traffic (engine_launch/engine.py) and again
periodically (health/canary.py): a replica that computes different numbers (other weights,
an engine argument or kernel that changes results, silent data corruption on a GPU)
differs from it.

The tolerance (`compare`), per prompt, positions 0 .. `positions`-1 (0: every token):
- the token ids are equal, except at a near tie: where each side's token is among the
  other's top alternatives with a logprob within `logprob_tol` of its chosen token, the two
  greedy decodes may legitimately part; that prompt's comparison ends there, passed;
- the chosen token's logprob differs by at most `logprob_tol` (nats);
- every golden alternative clearly inside the top (more than `logprob_tol` above the
  golden's least alternative) is among the replica's, its logprob within `logprob_tol`.
The first position that breaks a rule is the mismatch: prompt index, position, what differed.

The tolerance absorbs what legitimately varies between decodes of one version on sound
hardware: batch composition and prefix-cache hits (a canary prompt is asked again and again).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

# The shipped prompts: plain text, code, a document-extraction line, numbers.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Bill of lading no. 4471. Shipper: ACME Corp, Rotterdam. Consignee:",
    "1, 1, 2, 3, 5, 8, 13,",
)
DEFAULT_MAX_TOKENS = 16
DEFAULT_TOP_LOGPROBS = 5
# bf16 GPU decodes of one version vary by a few hundredths of a nat with batch composition;
# a different model, dtype or a corrupted GPU moves them by far more.
DEFAULT_LOGPROB_TOL = 0.1
MAX_TOKENS_LIMIT = 256
TOP_LOGPROBS_LIMIT = 20  # vLLM's --max-logprobs default
DETAIL_PREFIX = "numerical canary mismatch"


class CanaryError(ValueError):
    """A canary setting, answer or record that cannot be used; the message says which."""


class CanarySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    max_tokens: int = DEFAULT_MAX_TOKENS
    top_logprobs: int = DEFAULT_TOP_LOGPROBS
    # Token positions compared per prompt (N); 0: all max_tokens.
    positions: int = 0
    logprob_tol: float = DEFAULT_LOGPROB_TOL


class CanaryToken(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float
    top: dict[int, float]  # token id -> logprob: the top alternatives (vLLM's top_logprobs)


class CanaryAnswer(msgspec.Struct, frozen=True):
    prompt: str
    tokens: list[CanaryToken]


class GoldenRecord(msgspec.Struct, frozen=True):
    """What one version decodes for the canary prompts, with the tolerance it is held to."""

    model_ref: str
    settings: CanarySettings
    answers: list[CanaryAnswer]
    recorded_at: float = 0.0  # epoch seconds
    recorded_from: str = ""  # the replica it was decoded on (its URL)


class Mismatch(msgspec.Struct, frozen=True):
    prompt: int  # index into the record's prompts
    position: int  # the first differing token position of that prompt's answer
    what: str

    def detail(self) -> str:
        """A health finding's detail (and, prefixed, a Slurm drain reason): short."""
        return f"{DETAIL_PREFIX} at position {self.position} (prompt {self.prompt}): {self.what}"


def check_settings(settings: CanarySettings) -> CanarySettings:
    """`settings` when usable; else CanaryError naming the key and the bad value."""
    if not settings.prompts or not all(isinstance(p, str) and p for p in settings.prompts):
        raise CanaryError(
            f"prompts: a list of non-empty strings is needed, got {settings.prompts!r}"
        )
    if not 1 <= settings.max_tokens <= MAX_TOKENS_LIMIT:
        raise CanaryError(f"max_tokens: {settings.max_tokens}; allowed 1 to {MAX_TOKENS_LIMIT}")
    if not 1 <= settings.top_logprobs <= TOP_LOGPROBS_LIMIT:
        raise CanaryError(
            f"top_logprobs: {settings.top_logprobs}; allowed 1 to {TOP_LOGPROBS_LIMIT}"
        )
    if not 0 <= settings.positions <= settings.max_tokens:
        raise CanaryError(
            f"positions: {settings.positions}; allowed 0 (all) to max_tokens {settings.max_tokens}"
        )
    if not (math.isfinite(settings.logprob_tol) and settings.logprob_tol >= 0):
        raise CanaryError(f"logprob_tol: {settings.logprob_tol}; a finite number >= 0 is needed")
    return settings


def request_body(model: str, prompt: str, settings: CanarySettings) -> dict[str, Any]:
    """One canary's /v1/completions body: greedy, a fixed length, token ids in logprobs."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": settings.max_tokens,
        "temperature": 0,
        "n": 1,
        "logprobs": settings.top_logprobs,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
    }


def _token_id(text: object) -> int:
    if isinstance(text, str) and text.startswith("token_id:"):
        try:
            return int(text[len("token_id:") :])
        except ValueError:
            pass
    raise CanaryError(f"token {text!r} is not 'token_id:N' (return_tokens_as_token_ids)")


def _logprob(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CanaryError(f"logprob {value!r} is not a number")
    return float(value)


def parse_answer(prompt: str, body: Mapping[str, Any]) -> CanaryAnswer:
    """The tokens of a /v1/completions answer to `request_body` (CanaryError if malformed)."""
    try:
        logprobs = body["choices"][0]["logprobs"]
        tokens, values, tops = (
            logprobs["tokens"],
            logprobs["token_logprobs"],
            logprobs["top_logprobs"],
        )
    except (KeyError, IndexError, TypeError):
        raise CanaryError("the answer has no choices[0].logprobs with tokens") from None
    if not (isinstance(tokens, list) and isinstance(values, list) and isinstance(tops, list)):
        raise CanaryError("the answer's logprobs are not lists")
    if not len(tokens) == len(values) == len(tops):
        raise CanaryError(
            f"the answer has {len(tokens)} tokens, {len(values)} logprobs, {len(tops)} tops"
        )
    out = []
    for token, value, top in zip(tokens, values, tops, strict=True):
        if not isinstance(top, dict):
            raise CanaryError(f"top_logprobs entry {top!r} is not an object")
        out.append(
            CanaryToken(
                _token_id(token),
                _logprob(value),
                {_token_id(k): _logprob(v) for k, v in top.items()},
            )
        )
    return CanaryAnswer(prompt, out)


def _near_tie(gold: CanaryToken, seen: CanaryToken, tol: float) -> bool:
    """Both sides' chosen tokens are within tol of each other on both sides."""
    g_alt = gold.top.get(seen.token_id)
    s_alt = seen.top.get(gold.token_id)
    return (
        g_alt is not None
        and s_alt is not None
        and gold.logprob - g_alt <= tol
        and seen.logprob - s_alt <= tol
    )


def _compare_token(gold: CanaryToken, seen: CanaryToken, tol: float) -> str:
    """What differs beyond tol at one position with equal token ids ("" when nothing)."""
    if abs(seen.logprob - gold.logprob) > tol:
        return (
            f"token {gold.token_id} logprob {seen.logprob:.4f}, golden {gold.logprob:.4f} "
            f"(tolerance {tol:g})"
        )
    floor = min(gold.top.values(), default=-math.inf)
    for token_id, logprob in sorted(gold.top.items(), key=lambda kv: -kv[1]):
        if logprob - floor <= tol:
            continue  # at the edge of the top alternatives: may fall out legitimately
        found = seen.top.get(token_id)
        if found is None:
            return f"alternative {token_id} (golden logprob {logprob:.4f}) not among the top"
        if abs(found - logprob) > tol:
            return (
                f"alternative {token_id} logprob {found:.4f}, golden {logprob:.4f} "
                f"(tolerance {tol:g})"
            )
    return ""


def compare(golden: GoldenRecord, observed: Sequence[CanaryAnswer]) -> Mismatch | None:
    """The first position where `observed` differs from `golden` beyond its tolerance."""
    settings = golden.settings
    tol = settings.logprob_tol
    if len(observed) != len(golden.answers):
        return Mismatch(
            0, 0, f"{len(observed)} answers to the {len(golden.answers)} canary prompts"
        )
    for index, (gold, seen) in enumerate(zip(golden.answers, observed, strict=True)):
        if gold.prompt != seen.prompt:
            return Mismatch(index, 0, "a different prompt was asked")
        n = len(gold.tokens) if settings.positions == 0 else settings.positions
        for position in range(min(n, len(gold.tokens))):
            if position >= len(seen.tokens):
                return Mismatch(index, position, f"the answer ends after {len(seen.tokens)} tokens")
            g, s = gold.tokens[position], seen.tokens[position]
            if g.token_id != s.token_id:
                if _near_tie(g, s, tol):
                    break  # both decodes stay right; they part here
                return Mismatch(index, position, f"token {s.token_id}, golden {g.token_id}")
            what = _compare_token(g, s, tol)
            if what:
                return Mismatch(index, position, what)
    return None


def encode_record(record: GoldenRecord) -> bytes:
    return msgspec.json.encode(record)


def decode_record(data: bytes | str) -> GoldenRecord:
    """A golden record from its JSON (CanaryError naming the problem)."""
    try:
        record = msgspec.json.decode(data, type=GoldenRecord)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise CanaryError(f"not a golden record: {err}") from None
    check_settings(record.settings)
    if len(record.answers) != len(record.settings.prompts):
        raise CanaryError(
            f"golden record has {len(record.answers)} answers for "
            f"{len(record.settings.prompts)} prompts"
        )
    return record
