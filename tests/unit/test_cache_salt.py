"""Each tenant's own prefix cache (contracts/cache_salt.py): the salt the gateway derives,
found again in the engines' KV events by the router's index, and kept apart everywhere the
prompt's hashes are made (prompt cache, index, simulated engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcserve.contracts import kv_wire as kw
from hpcserve.contracts.cache_salt import SALT_PREFIX, salt_of, tenant_salt
from hpcserve.contracts.prefix_hash import chain_seed, prompt_block_hashes
from hpcserve.contracts.prompt_tokens import PromptTokenizer, RouteHints
from hpcserve.router.prefix_index import PrefixIndex
from hpcserve.sim.engine import wire_events
from hpcserve.sim.kvcache import KVCache
from hpcserve.tinymodels import make_tiny_model

BS = 4
PROMPT = list(range(100, 118))  # 4 full blocks and a partial one


def test_a_tenants_salt_is_its_own_and_vllm_accepts_it() -> None:
    a, b = tenant_salt("team-a"), tenant_salt("team-b")
    assert a != b and a == tenant_salt("team-a")
    # a client's own salt makes another within the tenant; it never yields another tenant's
    assert tenant_salt("team-a", "x") not in (a, b, tenant_salt("team-b", "x"))
    assert tenant_salt("team-a", b) != b
    for salt in (a, tenant_salt("team-a", "@/\\")):
        assert salt.startswith(SALT_PREFIX) and len(salt) <= 128
        assert not any(c in salt for c in "@/\\\x00")  # vLLM refuses those


@pytest.mark.parametrize(
    ("first_block_keys", "salt"),
    [
        ((tenant_salt("t"),), tenant_salt("t")),
        (("my-lora", ("mm-hash", 0), tenant_salt("t")), tenant_salt("t")),
        (("my-lora",), ""),
        (("someone-elses-salt",), ""),  # not one the gateway set
        ((), ""),
        (None, ""),
    ],
)
def test_the_salt_among_a_first_blocks_extra_keys(first_block_keys, salt) -> None:
    assert salt_of(first_block_keys) == salt


def test_an_adapter_named_like_a_salt_is_not_taken_for_one() -> None:
    lora = SALT_PREFIX + "adapter"
    assert salt_of((lora,), lora) == ""
    assert salt_of((lora, tenant_salt("t")), lora) == tenant_salt("t")


def test_the_index_keeps_salted_blocks_apart() -> None:
    """vLLM publishes the salt in the first block's extra keys: the index chains those
    blocks from the salted seed, so only a prompt hashed with the same salt matches them."""
    salt = tenant_salt("t")
    index = PrefixIndex()
    index.apply(
        "r1",
        [kw.BlockStored([1, 2, 3, 4], None, PROMPT[:16], BS,
                        extra_keys=[(salt,), None, None, None])],
    )  # fmt: skip
    index.apply("r2", [kw.BlockStored([9, 8], None, PROMPT[:8], BS)])
    assert index.match(prompt_block_hashes(PROMPT, BS, "", salt)) == {"r1": 4}
    assert index.match(prompt_block_hashes(PROMPT, BS)) == {"r2": 2}
    assert index.match(prompt_block_hashes(PROMPT, BS, "", tenant_salt("other"))) == {}
    assert index.orphans == 0
    # an adapter and a salt together: both in the seed
    index.apply(
        "r3",
        [kw.BlockStored([5], None, PROMPT[:4], BS, lora_name="ad",
                        extra_keys=[("ad", salt)])],
    )  # fmt: skip
    assert index.match(prompt_block_hashes(PROMPT, BS, "ad", salt)) == {"r3": 1}
    assert chain_seed("ad", salt) not in (chain_seed("ad"), chain_seed("", salt))


@pytest.fixture(scope="module")
def hints(tmp_path_factory: pytest.TempPathFactory) -> tuple[RouteHints, PromptTokenizer]:
    model = make_tiny_model("chat", tmp_path_factory.mktemp("salt") / "tiny")
    tokenizer = PromptTokenizer.from_dir(model)
    route_hints = RouteHints()
    route_hints.add_model("m", tokenizer, block_size=BS)
    return route_hints, tokenizer


def test_the_gateways_hints_chain_from_the_salt(hints) -> None:
    route_hints, tokenizer = hints
    messages = [{"role": "system", "content": "You answer briefly. " * 8},
                {"role": "user", "content": "What is a block? " * 4}]  # fmt: skip
    tokens = tokenizer.chat_tokens(messages)
    salt = tenant_salt("t")
    for _ in range(2):  # rendered, then from the prompt cache
        salted = route_hints.hints("m", {"messages": messages}, {}, salt)
        plain = route_hints.hints("m", {"messages": messages}, {})
        assert salted["block_hashes"] == prompt_block_hashes(tokens, BS, "", salt)
        assert plain["block_hashes"] == prompt_block_hashes(tokens, BS)
        assert salted["prompt_tokens"] == plain["prompt_tokens"] == len(tokens)
    completion = route_hints.hints("m", {"prompt": [7] * 20}, {}, salt)
    assert completion["block_hashes"] == prompt_block_hashes([7] * 20, BS, "", salt)


def test_the_simulated_engine_shares_blocks_only_within_a_salt() -> None:
    kv = KVCache(num_blocks=64, block_size=BS)
    ids = list(range(1, 18))
    salt = tenant_salt("t")
    for request, request_salt in (("a1", salt), ("b1", "")):
        assert kv.lookup(request, ids, request_salt) == 0
        assert kv.allocate(request, len(ids))
        kv.commit(request, ids, len(ids))
        kv.free(request)
    assert kv.lookup("a2", ids, salt) == 16  # its own tenant's blocks
    assert kv.lookup("c1", ids, tenant_salt("other")) == 0  # nobody else's
    stored = [e for e in wire_events(kv.events) if isinstance(e, kw.BlockStored)]
    salted, plain = stored[0], stored[1]
    assert salted.extra_keys == [(salt,), None, None, None]  # as vLLM publishes it
    assert plain.extra_keys is None
    # and the router's index, fed these events, matches each prompt to its own blocks
    index = PrefixIndex()
    index.apply("sim", [salted])
    assert index.match(prompt_block_hashes(ids, BS, "", salt)) == {"sim": 4}
    assert index.match(prompt_block_hashes(ids, BS)) == {}


def test_a_bad_cache_salt_is_a_400_naming_it(tmp_path: Path) -> None:
    from hpcserve.gateway import validate
    from hpcserve.gateway.errors import APIError

    body = b'{"model":"m","prompt":"x","cache_salt":"a/b"}'
    with pytest.raises(APIError) as refused:
        validate.parse("/v1/completions", body)
    assert refused.value.status == 400
    assert "cache_salt must not contain '@', '/', '\\' or NUL" in str(refused.value)
    too_long = b'{"model":"m","prompt":"x","cache_salt":"' + b"s" * 129 + b'"}'
    with pytest.raises(APIError, match="cache_salt"):
        validate.parse("/v1/completions", too_long)


def test_the_prompt_caches_roots_are_bounded_however_many_salts_clients_send(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hpcserve.contracts import prompt_cache
    from hpcserve.contracts.prompt_cache import PromptCache

    monkeypatch.setattr(prompt_cache, "MAX_ROOTS", 3)
    cache = PromptCache(BS, 1 << 20)
    base = cache.root("")
    first = cache.root("", "s1")
    cache.root("", "s2")
    assert cache.root("") is base  # used again: the newest
    cache.root("", "s3")  # one past the bound: the least recently used (s1) goes
    again = cache.root("", "s1")
    assert again is not first and again.id != first.id  # its old children never match
    assert cache.root("") is base
    assert again.last == first.last == chain_seed("", "s1")
