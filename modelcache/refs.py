"""Names, `name@version` references and cache keys.

One namespace holds model, alias and adapter names, because clients ask for any of them
in the `model` field of a request. A name is a single path component, so a cache key built
from it is a safe directory name: `<name>@<version>-<first 12 hex of the manifest digest>`,
e.g. `llama-8b-docs@3-1f2e3d4c5b6a`. The digest part makes a re-added version with other
bytes a different key, so a stale copy is never mistaken for the new one.
"""

from __future__ import annotations

import re
from typing import NamedTuple

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}@[0-9]{1,9}-[0-9a-f]{12}")
KEY_DIGEST_HEX = 12


class RefError(ValueError):
    """A name, reference or cache key that is not well formed."""


class Ref(NamedTuple):
    name: str
    version: int | None = None

    def __str__(self) -> str:
        return self.name if self.version is None else f"{self.name}@{self.version}"


def check_name(name: str, what: str = "name") -> str:
    if not NAME_RE.fullmatch(name):
        raise RefError(
            f"{what} {name!r} is not allowed; use 1-100 of A-Z a-z 0-9 . _ - "
            "starting with a letter or digit"
        )
    return name


def parse_ref(text: str) -> Ref:
    """`llama` or `llama@3` -> Ref; anything else raises RefError naming the text."""
    name, sep, version = text.partition("@")
    check_name(name, "model name")
    if not sep:
        return Ref(name)
    if not version.isdigit() or int(version) < 1 or len(version) > 9:
        raise RefError(f"version in {text!r} must be a positive integer, got {version!r}")
    return Ref(name, int(version))


def cache_key(name: str, version: int, manifest_digest: str) -> str:
    check_name(name, "model name")
    key = f"{name}@{version}-{manifest_digest[:KEY_DIGEST_HEX]}"
    return check_key(key)


def check_key(key: str) -> str:
    if not KEY_RE.fullmatch(key):
        raise RefError(f"cache key {key!r} is not of the form NAME@VERSION-<12 hex digits>")
    return key
