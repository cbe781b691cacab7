"""The prompt cache gives exactly the hints of rendering and tokenizing the whole prompt:
a table of conversations, random ones sharing prefixes, templates that do not render by
message, a cache too small to hold anything, and transformers' own chat template; from a
decoded payload (`RouteHints.hints`) and from a body's bytes (`plan_body`, the gateway's
path), in one cache."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from hpcserve.contracts.prefix_hash import prompt_block_hashes
from hpcserve.contracts.prompt_cache import Boundaries, MessageChunks
from hpcserve.contracts.prompt_tokens import PromptTokenizer, RouteHints
from hpcserve.gateway.route_hints import body_hints, body_plan, register_cache_metrics
from hpcserve.tinymodels import LLAMA3_CHAT_TEMPLATE, make_tiny_model

BLOCK = 16


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("chat", tmp_path_factory.mktemp("m") / "chat")


@pytest.fixture(scope="module")
def tokenizer(chat_dir: Path) -> PromptTokenizer:
    return PromptTokenizer.from_dir(chat_dir)


def whole(tok: PromptTokenizer, payload: dict[str, Any], adapter: str = "") -> dict[str, Any]:
    """The hints of rendering and tokenizing the whole prompt (no cache): the reference."""
    if "messages" in payload:
        extra = {"tools": payload["tools"]} if payload.get("tools") else {}
        tokens = tok.chat_tokens(payload["messages"], **extra)
    else:
        tokens = tok.prompt_tokens(payload["prompt"])
    return {
        "block_hashes": prompt_block_hashes(tokens, BLOCK, adapter),
        "block_size": BLOCK,
        "prompt_tokens": len(tokens),
    }


def hints_of(tok: PromptTokenizer, cache_bytes: int = 64 << 20) -> RouteHints:
    hints = RouteHints()
    hints.add_model("m", tok, BLOCK, cache_bytes)
    hints.add_adapter("m-sql", "m")
    return hints


def sent_as_body(
    hints: RouteHints, model: str, payload: dict[str, Any], spaced: bool = False
) -> dict[str, Any]:
    """The hints of `payload` sent as a body (JSON with or without spaces), as the gateway
    plans them: from the bytes of its messages."""
    separators = (", ", ": ") if spaced else (",", ":")
    body = json.dumps({"model": model, **payload}, separators=separators).encode()
    return body_hints(hints, model, body, {})


SYSTEM = "You extract fields from shipping documents. Answer in JSON. " * 6
TOOL = {
    "type": "function",
    "function": {"name": "lookup", "description": "Find a port", "parameters": {}},
}
CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"p": 1}'}}
TABLE: list[tuple[str, list[dict[str, Any]], dict[str, Any]]] = [
    ("one user turn", [{"role": "user", "content": "Hello"}], {}),
    (
        "system and user",
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Bill 4711"}],
        {},
    ),
    (
        "multi-turn",
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Bill of lading 4711: consignee ACME GmbH."},
            {"role": "assistant", "content": '{"consignee": "ACME GmbH"}'},
            {"role": "user", "content": "And the port?"},
        ],
        {},
    ),
    (
        "whitespace edges",
        [
            {"role": "user", "content": "  padded \n\n"},
            {"role": "assistant", "content": " "},
            {"role": "user", "content": ""},
        ],
        {},
    ),
    (
        "special tokens in content",
        [{"role": "user", "content": "a <|eot_id|> b <|start_header_id|>x"}],
        {},
    ),
    (
        "content parts",
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
            }
        ],
        {},
    ),
    (
        "tool call and result",
        [
            {"role": "user", "content": "Where?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "Hamburg"},
        ],
        {},
    ),
    (
        "tools in the request",
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Port?"}],
        {"tools": [TOOL]},
    ),
    ("unicode", [{"role": "user", "content": "Größe 🚢 façade — ナ" * 5}], {}),
]


@pytest.mark.parametrize("cache_bytes", [64 << 20, 0, 3000], ids=["cache", "off", "tiny"])
@pytest.mark.parametrize(("name", "messages", "extra"), TABLE, ids=[t[0] for t in TABLE])
def test_a_table_of_conversations_hashes_as_the_whole_prompt(
    tokenizer: PromptTokenizer,
    name: str,
    messages: list[dict[str, Any]],
    extra: dict[str, Any],
    cache_bytes: int,
) -> None:
    hints = hints_of(tokenizer, cache_bytes)
    payload = {"messages": messages, **extra}
    want = whole(tokenizer, payload)
    assert want["block_hashes"] or name in ("one user turn", "whitespace edges")
    for _ in range(3):  # cold, then from the cache
        assert hints.hints("m", payload, {}) == want
        assert sent_as_body(hints, "m", payload) == want
        assert sent_as_body(hints, "m", payload, spaced=True) == want
    lora_want = {**whole(tokenizer, payload, "m-sql"), "adapter": "m-sql"}
    assert hints.hints("m-sql", payload, {}) == lora_want
    assert sent_as_body(hints, "m-sql", payload) == lora_want


def test_the_tiny_models_template_renders_by_message(tokenizer: PromptTokenizer) -> None:
    hints = hints_of(tokenizer)
    (model, cache, mismatches, by_message) = hints.cache_stats()[0]
    assert (model, mismatches, by_message) == ("m", 0, True)
    bounds = Boundaries(tokenizer.tokenizer, tokenizer.boundary_candidates())
    assert {"<|eot_id|>", "<|start_header_id|>"} <= bounds.after and not bounds.reason
    assert len(cache) == 0


WORDS = [
    "the",
    "model",
    "reads",
    "a",
    "long",
    "prompt",
    "and",
    "the",
    "router",
    "keeps",
    "every",
    "request",
    "in",
    "the",
    "queue",
]


def random_text(rng: random.Random, n: int) -> str:
    out = " ".join(rng.choice(WORDS) for _ in range(n))
    if rng.random() < 0.1:
        out = f"  {out}\n"
    if rng.random() < 0.05:
        out += " <|eot_id|>"
    return out


def test_random_conversations_sharing_prefixes_hash_as_the_whole_prompt(
    tokenizer: PromptTokenizer,
) -> None:
    rng = random.Random(23)
    for cache_bytes in (64 << 20, 20_000):  # the second one evicts all the time
        hints = hints_of(tokenizer, cache_bytes)
        systems = [random_text(rng, rng.randint(0, 120)) for _ in range(3)]
        conversations: list[list[dict[str, Any]]] = []
        for _ in range(150):
            if conversations and rng.random() < 0.6:  # a next turn of an earlier one
                messages = list(rng.choice(conversations))
                if messages[-1]["role"] == "user":
                    messages.append({"role": "assistant", "content": random_text(rng, 30)})
            else:
                messages = [{"role": "system", "content": rng.choice(systems)}]
                if rng.random() < 0.2:
                    messages = []
            messages.append({"role": "user", "content": random_text(rng, rng.randint(0, 60))})
            conversations.append(messages)
            model = "m-sql" if rng.random() < 0.2 else "m"
            want = whole(tokenizer, {"messages": messages}, "m-sql" if model == "m-sql" else "")
            if rng.random() < 0.5:
                got = hints.hints(model, {"messages": messages}, {})
            else:
                got = sent_as_body(hints, model, {"messages": messages}, spaced=rng.random() < 0.5)
            got.pop("adapter", None)
            assert got == want, messages
        (_, cache, mismatches, _) = hints.cache_stats()[0]
        assert cache.bytes <= cache_bytes and mismatches == 0
        assert cache.hit_tokens > 0 and cache.miss_tokens > 0


def test_a_repeated_prompt_is_not_tokenized_again(tokenizer: PromptTokenizer) -> None:
    hints = hints_of(tokenizer)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Bill 4711"}]
    first = hints.hints("m", {"messages": messages}, {})
    (_, cache, _, _) = hints.cache_stats()[0]
    missed = cache.miss_tokens
    assert missed >= first["prompt_tokens"]
    plan = hints.plan("m", {"messages": messages}, {"x-session-id": "s"})
    assert plan.work == 0, "served from the cache: nothing left to render or tokenize"
    assert plan.run() == {**first, "session_key": "s"}
    assert cache.miss_tokens == missed and cache.hit_tokens >= first["prompt_tokens"]
    # The next turn renders and tokenizes only what is new.
    turn = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    plan = hints.plan("m", {"messages": turn}, {})
    assert 0 < plan.work < 20
    assert plan.run() == whole(tokenizer, {"messages": turn})
    assert cache.miss_tokens - missed < first["prompt_tokens"] // 4
    # From a body's bytes: a message seen before in these bytes is neither decoded nor
    # rendered again; only the new turn is left to the plan's run.
    body = json.dumps({"model": "m", "messages": turn}).encode()
    assert sent_as_body(hints, "m", {"messages": turn}, spaced=True) == whole(
        tokenizer, {"messages": turn}
    )
    missed = cache.miss_tokens
    plan = body_plan(hints, "m", body, {})
    assert plan.work == 0 and plan.run() == whole(tokenizer, {"messages": turn})
    assert cache.miss_tokens == missed
    longer = json.dumps({"model": "m", "messages": [*turn, {"role": "user", "content": "x"}]})
    plan = body_plan(hints, "m", longer.encode(), {})
    assert 0 < plan.work < 40, "only the new message's bytes are left"
    registry = CollectorRegistry()
    register_cache_metrics(registry, hints)
    text = generate_latest(registry).decode()
    assert 'hpcserve_gateway_prompt_cache_tokens_total{model="m",result="hit"}' in text
    assert 'hpcserve_gateway_prompt_cache_by_message{model="m"} 1.0' in text


def test_completions_prompts(tokenizer: PromptTokenizer) -> None:
    hints = hints_of(tokenizer)
    long = {"prompt": SYSTEM + " Bill of lading 4711."}
    assert hints.hints("m", long, {}) == hints.hints("m", long, {}) == whole(tokenizer, long)
    ids = {"prompt": list(range(40))}
    assert hints.hints("m", ids, {}) == whole(tokenizer, ids)
    # Shorter than a block whatever it tokenizes to: no hashes, the count bounded.
    short = hints.hints("m", {"prompt": "Hi"}, {})
    assert "block_hashes" not in short and short["prompt_tokens"] >= len(
        tokenizer.prompt_tokens("Hi")
    )


# Mistral-like: the system prompt goes into the last user turn, so a message's rendering
# depends on the others.
FOLDED = (
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set rest = messages[1:] %}{% else %}{% set sys = '' %}{% set rest = messages %}{% endif %}"
    "{{ bos_token }}{% for m in rest %}{% if m['role'] == 'user' %}"
    "{% if loop.last and sys %}[INST] {{ sys }}\n\n{{ m['content'] }}[/INST]"
    "{% else %}[INST] {{ m['content'] }}[/INST]{% endif %}"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
# Passes the probes (short conversations) but renders long ones differently.
SNEAKY = "{% if messages | length > 9 %}<|eot_id|>{% endif %}" + LLAMA3_CHAT_TEMPLATE


@pytest.mark.parametrize(("template", "by_message"), [(FOLDED, False), (SNEAKY, True)])
def test_templates_that_do_not_render_by_message_still_hash_as_the_whole_prompt(
    chat_dir: Path, template: str, by_message: bool
) -> None:
    base = PromptTokenizer.from_dir(chat_dir)
    tok = PromptTokenizer(base.tokenizer, template, base.special)
    hints = hints_of(tok)
    assert hints.cache_stats()[0][3] is by_message
    rng = random.Random(5)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for turn in range(8):
        messages.append({"role": "user", "content": random_text(rng, 20)})
        want = whole(tok, {"messages": messages})
        if turn % 2:
            assert hints.hints("m", {"messages": messages}, {}) == want
        else:
            assert sent_as_body(hints, "m", {"messages": messages}) == want
        messages.append({"role": "assistant", "content": f"answer {turn}"})
    # SNEAKY: the sampled check of a long conversation saw the difference, gave the whole
    # prompt's hints and turned rendering by message off.
    assert hints.cache_stats()[0][2:] == ((1, False) if by_message else (0, False))


def _tokenizer(added: list[AddedToken], pre: Any = None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(added)
    return tok


def test_boundaries_only_where_no_added_token_can_match_across() -> None:
    tok = _tokenizer(
        [
            AddedToken("<e>", special=True),
            AddedToken("<e>x", special=True),  # holds <e>: cutting after <e> is not safe
            AddedToken("<s>", special=True),
            AddedToken("[r]", special=True, rstrip=True),  # eats the whitespace after it
            AddedToken("ab", special=True),  # ends in a word character
        ]
    )
    bounds = Boundaries(tok)
    # <e>x ends in a word character, but nothing can match across its start.
    assert bounds.after == {"<s>"} and bounds.before == {"<s>", "[r]", "<e>x"}
    assert bounds.last("x<s>yy<s>z") == 9 and bounds.all("x<s>yy<s>") == [1, 4, 6, 9]
    metaspace = _tokenizer(
        [AddedToken("<s>", special=True)], pre_tokenizers.Metaspace(prepend_scheme="first")
    )
    assert "first piece" in Boundaries(metaspace).reason
    assert Boundaries(metaspace).last("a<s>b") == 0


def test_probing_refuses_a_template_that_drops_earlier_reasoning() -> None:
    def render(messages: list[dict[str, Any]], generation: bool) -> str:
        out = []
        for i, m in enumerate(messages):
            text = str(m.get("content") or "")
            if m["role"] == "assistant" and i < len(messages) - 1:
                text = text.split("</think>")[-1]  # as Qwen3 does before the last turn
            out.append(f"<{m['role']}>{text}</s>")
        return "".join(out) + ("<assistant>" if generation else "")

    assert "differently" in MessageChunks(render).reason


def test_cached_hints_match_transformers_chat_template(chat_dir: Path) -> None:
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(chat_dir))
    tok = PromptTokenizer.from_dir(chat_dir)
    hints = hints_of(tok)
    rng = random.Random(7)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for _ in range(6):
        messages.append({"role": "user", "content": random_text(rng, 40)})
        ids = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        got = hints.hints("m", {"messages": messages}, {})
        assert got["prompt_tokens"] == len(ids)
        assert got["block_hashes"] == prompt_block_hashes(ids, BLOCK)
        messages.append({"role": "assistant", "content": random_text(rng, 25)})
