"""Each tenant's own prefix cache: the `cache_salt` the gateway gives a tenant's requests.

vLLM shares a prompt prefix's KV blocks between requests whose tokens match, whoever sent
them, and a cached prefix answers sooner: a tenant who guesses another's prompt prefix can
tell from its time to first token whether that prefix was recently sent. vLLM hashes a
request's `cache_salt` into its first block, so requests with different salts share no
block. The gateway sets one per tenant (and per salt the client set itself, which stays
its own choice within the tenant), overriding whatever the body said.

The router's prefix index must tell the salts apart too, or it would predict hits vLLM
does not have: the salt seeds our hash chain (prefix_hash.chain_seed), on the gateway from
the salt it set, in the router from the first block's `extra_keys` in vLLM's BlockStored
events (where vLLM publishes the salt), recognised by SALT_PREFIX.

A salt is public knowledge inside the stack (events, engine bodies); it needs no secret:
it only has to differ between tenants, which a collision-resistant hash of the tenant's
name gives, and no client can choose another tenant's (the gateway sets it last).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import msgspec

from hpcserve.contracts.json_members import with_members

SALT_PREFIX = "hpcs-"


@lru_cache(maxsize=4096)
def tenant_salt(tenant: str, client_salt: str = "") -> str:
    """The salt of `tenant`'s requests that set `client_salt` ("" for none): 37 characters
    vLLM accepts (at most 128, none of @ / \\ NUL)."""
    digest = hashlib.sha256(f"{tenant}\x00{client_salt}".encode()).hexdigest()
    return SALT_PREFIX + digest[:32]


def salt_of(extra_keys: Sequence[Any] | None, lora_name: str | None = None) -> str:
    """The salt among a first block's extra keys (BlockStored.extra_keys[0]: the LoRA name
    when `lora_name` is set, multimodal pairs, the cache salt, prompt-embedding digests,
    untagged); "" when none of them is one the gateway set. The LoRA name is skipped, so
    an adapter whose name happens to start like a salt is not taken for one."""
    keys = list(extra_keys or ())
    if lora_name and keys and keys[0] == lora_name:
        del keys[0]
    for key in keys:
        if isinstance(key, str) and key.startswith(SALT_PREFIX):
            return key
    return ""


_object = msgspec.json.Decoder(dict[str, Any])


def salted_body(body: bytes, salt: str, *, replace: bool) -> bytes:
    """The JSON object `body` with `"cache_salt": salt` as its last key. `replace`: the body
    may hold a cache_salt already (the client's), which is taken out rather than left
    beside ours for a parser to choose between (re-encoded); else the key is appended to
    the bytes as they are."""
    if replace:
        payload = _object.decode(body)
        payload.pop("cache_salt", None)
        payload["cache_salt"] = salt
        return msgspec.json.encode(payload)
    return with_members(body, salt_member(salt))


@lru_cache(maxsize=4096)
def salt_member(salt: str) -> bytes:
    """`"cache_salt":<salt>`, encoded: a member for json_members.with_members."""
    return b'"cache_salt":' + msgspec.json.encode(salt)


def client_salt_of(body: bytes) -> str:
    """The cache_salt a request body sets ("" for none, or not a string)."""
    salt = _object.decode(body).get("cache_salt")
    return salt if isinstance(salt, str) else ""
