"""A chat's short new last message is not tokenized the first time it is seen
(gateway.prompt_defer_chars): the hints are then exactly the whole prompt's up to the
messages before it, with the token count estimated; seen again, exact in full."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from hpcserve.config import ConfigError, parse_config
from hpcserve.contracts import prompt_tokens
from hpcserve.contracts.prefix_hash import prompt_block_hashes
from hpcserve.contracts.prompt_tokens import PromptTokenizer, RouteHints
from hpcserve.gateway.route_hints import register_cache_metrics
from hpcserve.tinymodels import make_tiny_model

BLOCK = 16
SYSTEM = "You extract fields from shipping documents. Answer in JSON. " * 6
HISTORY = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Bill of lading 4711: consignee ACME GmbH, port Hamburg."},
    {"role": "assistant", "content": '{"consignee": "ACME GmbH", "port": "Hamburg"}'},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    return PromptTokenizer.from_dir(make_tiny_model("chat", tmp_path_factory.mktemp("m") / "chat"))


def exact(tok: PromptTokenizer, messages: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = tok.chat_tokens(messages)
    return {
        "block_hashes": prompt_block_hashes(tokens, BLOCK, ""),
        "block_size": BLOCK,
        "prompt_tokens": len(tokens),
    }


def deferring(tok: PromptTokenizer, defer_chars: int = 1024) -> RouteHints:
    hints = RouteHints()
    hints.add_model("m", tok, BLOCK, 64 << 20, defer_chars)
    return hints


def ask(question: str) -> list[dict[str, Any]]:
    return [*HISTORY, {"role": "user", "content": question}]


def check_deferred(tok: PromptTokenizer, got: dict[str, Any], messages: list[Any]) -> None:
    """The full blocks of the messages before the last, exactly; the count near the truth."""
    before = exact(tok, messages[:-1])["block_hashes"]
    # The blocks wholly inside the earlier messages: those of rendering them without the
    # generation prompt, cut where the last message's text starts.
    earlier = tok.render_chat(messages[:-1], add_generation_prompt=False)
    held = len(tok.encode_pieces([earlier])[0]) // BLOCK
    whole = exact(tok, messages)
    assert got["block_hashes"] == whole["block_hashes"][:held] == before[:held]
    assert got["block_size"] == BLOCK
    assert abs(got["prompt_tokens"] - whole["prompt_tokens"]) <= whole["prompt_tokens"] // 5


def test_a_new_short_last_turn_is_deferred_then_exact_when_seen_again(
    tokenizer: PromptTokenizer,
) -> None:
    hints = deferring(tokenizer)
    first = ask("And the port of loading?")
    # Nothing cached: the history is tokenized, the short last message is deferred.
    check_deferred(tokenizer, hints.hints("m", {"messages": first}, {}), first)
    # The same history, a new question: nothing is tokenized at all.
    cache = hints.cache_stats()[0][1]
    missed = cache.miss_tokens
    second = ask("Which vessel carried it?")
    check_deferred(tokenizer, hints.hints("m", {"messages": second}, {}), second)
    assert cache.miss_tokens == missed and cache.deferred_tokens > 0
    # Seen before (a retry, a regenerated answer): its blocks may be in an engine's cache.
    assert hints.hints("m", {"messages": second}, {}) == exact(tokenizer, second)
    assert hints.hints("m", {"messages": second}, {}) == exact(tokenizer, second)  # cached
    # The next turn holds the deferred question as history: tokenized then, exactly.
    third = [
        *second,
        {"role": "assistant", "content": "MSC Oscar"},
        {"role": "user", "content": "Thanks"},
    ]
    check_deferred(tokenizer, hints.hints("m", {"messages": third}, {}), third)


def test_seen_last_messages_are_bounded_and_the_newest_half_always_remembered(
    tokenizer: PromptTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prompt_tokens, "SEEN_LAST_MAX", 8)
    hints = deferring(tokenizer)
    cache = hints.cache_stats()[0][1]

    def deferred(question: list[dict[str, Any]]) -> bool:
        before = cache.deferred_tokens
        got = hints.hints("m", {"messages": question}, {})
        if cache.deferred_tokens == before:
            assert got == exact(tokenizer, question)
            return False
        check_deferred(tokenizer, got, question)
        return True

    questions = [ask(f"Field {i} of the bill?") for i in range(12)]
    assert all(deferred(q) for q in questions)  # each new
    # The newest SEEN_LAST_MAX / 2 are remembered: seen again, exact.
    assert not any(deferred(q) for q in questions[-4:])
    # The oldest were forgotten (at most SEEN_LAST_MAX kept): deferred again, then seen.
    assert deferred(questions[0])
    assert not deferred(questions[0])


def test_long_last_messages_and_single_messages_are_never_deferred(
    tokenizer: PromptTokenizer,
) -> None:
    hints = deferring(tokenizer, defer_chars=64)
    long_question = ask("Please list every field of the bill of lading above, one per line. " * 2)
    assert hints.hints("m", {"messages": long_question}, {}) == exact(tokenizer, long_question)
    alone = [{"role": "user", "content": "Hello"}]
    assert hints.hints("m", {"messages": alone}, {}) == exact(tokenizer, alone)
    named = [*HISTORY, {"role": "user", "content": "Port?", "name": "clerk"}]
    assert hints.hints("m", {"messages": named}, {}) == exact(tokenizer, named)
    # Off (0, or no prompt cache): always exact.
    for off in (deferring(tokenizer, 0), RouteHints()):
        if not off.covers("m"):
            off.add_model("m", tokenizer, BLOCK, 0, 1024)
        question = ask("Port?")
        assert off.hints("m", {"messages": question}, {}) == exact(tokenizer, question)


def test_the_deferred_tokens_are_a_metric_and_the_default_is_on(
    tokenizer: PromptTokenizer,
) -> None:
    hints = deferring(tokenizer)
    hints.hints("m", {"messages": ask("Port?")}, {})
    registry = CollectorRegistry()
    register_cache_metrics(registry, hints)
    text = generate_latest(registry).decode()
    line = next(
        x
        for x in text.splitlines()
        if x.startswith("hpcserve_gateway_prompt_cache_tokens_total") and 'result="deferred"' in x
    )
    assert float(line.rsplit(" ", 1)[1]) > 0
    assert parse_config({}).gateway.prompt_defer_chars == 1024
    with pytest.raises(ConfigError, match=r"gateway\.prompt_defer_chars"):
        parse_config({"gateway": {"prompt_defer_chars": -1}})


def test_each_gateway_sees_a_message_anew(tmp_path: Path) -> None:
    """What was seen is kept per RouteHints (per gateway worker): another one defers the
    same message the first time it sees it."""
    tok = PromptTokenizer.from_dir(make_tiny_model("chat", tmp_path / "chat"))
    question = ask("Port?")
    for _ in range(2):
        hints = deferring(tok)
        check_deferred(tok, hints.hints("m", {"messages": question}, {}), question)
