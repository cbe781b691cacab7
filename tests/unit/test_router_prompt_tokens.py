"""Request-side tokens and hashes: the model's tokenizer and chat template without
transformers, checked against transformers' own apply_chat_template."""

from __future__ import annotations

import pytest

from hpcserve.contracts.prefix_hash import prompt_block_hashes
from hpcserve.contracts.prompt_tokens import PromptTokenizer, RouteHints
from hpcserve.tinymodels import make_tiny_model

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant. " * 20},
    {"role": "user", "content": "Say hello to the router."},
]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return make_tiny_model("chat", tmp_path_factory.mktemp("m") / "chat")


def test_chat_tokens_match_transformers(chat_dir):
    from transformers import AutoTokenizer

    ours = PromptTokenizer.from_dir(chat_dir)
    theirs = AutoTokenizer.from_pretrained(str(chat_dir))
    expected_text = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(MESSAGES) == expected_text
    expected = theirs(expected_text, add_special_tokens=False)["input_ids"]
    assert ours.chat_tokens(MESSAGES) == expected
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert ours.render_chat(parts) == ours.render_chat([{"role": "user", "content": "a\nb"}])
    assert ours.prompt_tokens("hello world") == theirs("hello world")["input_ids"]


def test_hints_carry_block_hashes_and_session(chat_dir):
    hints = RouteHints()
    tok = PromptTokenizer.from_dir(chat_dir)
    hints.add_model("m", tok, 16)
    hints.add_adapter("m-sql", "m")
    got = hints.hints("m", {"messages": MESSAGES}, {"x-session-id": "abc"})
    tokens = tok.chat_tokens(MESSAGES)
    assert got["prompt_tokens"] == len(tokens) and got["block_size"] == 16
    assert got["block_hashes"] == prompt_block_hashes(tokens, 16)
    assert got["session_key"] == "abc"
    lora = hints.hints("m-sql", {"messages": MESSAGES}, {})
    assert lora["adapter"] == "m-sql"
    assert lora["block_hashes"] == prompt_block_hashes(tokens, 16, "m-sql")
    assert hints.hints("m", {"prompt": [1, 2, 3] * 10}, {})["prompt_tokens"] == 30
    assert hints.hints("m", {"prompt": ["text"]}, {})["prompt_tokens"] > 0


def test_unreadable_prompts_give_no_prefix_hints(chat_dir):
    hints = RouteHints()
    hints.add_model("m", PromptTokenizer.from_dir(chat_dir), 16)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert hints.hints("m", {"messages": image}, {}) == {}
    assert hints.hints("m", {"prompt": {"bad": 1}}, {}) == {}
    assert hints.hints("unknown", {"prompt": "x"}, {"x-session-id": "s"}) == {"session_key": "s"}
    with pytest.raises(ValueError, match="block_size"):
        hints.add_model("z", PromptTokenizer.from_dir(chat_dir), 0)


def test_gateway_hints_from_the_config(chat_dir, tmp_path):
    from hpcserve.config import parse_config
    from hpcserve.gateway.route_hints import route_hints_for

    pools = [
        {"name": "chat", "model_path": str(chat_dir), "engine": "vllm-cpu"},
        {
            "name": "gpu",
            "model_path": str(chat_dir),
            "engine": "vllm",
            "engine_args": ["--block-size", "32"],
        },
        {"name": "broken", "model_path": str(tmp_path / "missing"), "engine": "vllm"},
    ]
    hints = route_hints_for(parse_config({"pools": pools}))
    assert "chat" in hints and "gpu" in hints and "broken" not in hints
    assert hints.hints("chat", {"messages": MESSAGES}, {})["block_size"] == 128
    assert hints.hints("gpu", {"messages": MESSAGES}, {})["block_size"] == 32
    baseline = {"router": {"routing": {"policy": "least-load"}}, "pools": pools}
    assert route_hints_for(parse_config(baseline)) is None


def test_adapter_requests_hash_like_the_index_hashes_their_blocks(chat_dir, tmp_path):
    from hpcserve.config import parse_config
    from hpcserve.contracts import kv_wire as kw
    from hpcserve.gateway.route_hints import route_hints_for
    from hpcserve.modelcache.manifest import build_manifest
    from hpcserve.modelcache.registry import Registry as ModelRegistry
    from hpcserve.router.prefix_index import PrefixIndex

    adapter_dir = make_tiny_model("lora", tmp_path / "lora", seed=1)
    with ModelRegistry(tmp_path / "reg.sqlite3") as reg:
        reg.add_version("chat", str(chat_dir), build_manifest(chat_dir))
        reg.add_adapter(
            "from-registry", "chat", str(adapter_dir), build_manifest(adapter_dir), rank=8
        )
    pool = {
        "name": "chat",
        "model_path": str(chat_dir),
        "engine": "vllm-cpu",
        "max_loras": 2,
        "lora_adapters": ["from-config"],
    }
    hints = route_hints_for(
        parse_config(
            {
                "registry": str(tmp_path / "reg.sqlite3"),
                "engine": {"cache_dir": str(tmp_path / "cache")},
                "pools": [pool],
            }
        )
    )
    tokens = PromptTokenizer.from_dir(chat_dir).chat_tokens(MESSAGES * 20)
    n = len(tokens) // 128
    base = hints.hints("chat", {"messages": MESSAGES * 20}, {})["block_hashes"]
    for adapter in ("from-config", "from-registry"):
        got = hints.hints(adapter, {"messages": MESSAGES * 20}, {})
        assert got["adapter"] == adapter and len(got["block_hashes"]) == n > 0
        assert set(got["block_hashes"]).isdisjoint(base)
        # The engine stores the prompt's blocks under the adapter's lora_name.
        index = PrefixIndex()
        stored = kw.BlockStored(list(range(n)), None, tokens[: n * 128], 128, lora_name=adapter)
        index.apply("r0", [stored])
        assert index.match(got["block_hashes"]) == {"r0": n}
        assert index.match(base) == {}
    # A pool without LoRA hashes no adapter names; an unknown name gets no hints.
    plain = route_hints_for(
        parse_config({"pools": [{**pool, "max_loras": 0, "lora_adapters": []}]})
    )
    assert "from-config" not in plain and plain.hints("nope", {"messages": MESSAGES}, {}) == {}
