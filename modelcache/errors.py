"""The errors of the node cache; each message names the entry or file and what was wrong."""

from __future__ import annotations


class CacheError(Exception):
    """A cache operation that cannot be done."""


class NotCachedError(CacheError):
    """The entry is not in the cache."""


class EntryBusyError(CacheError):
    """The entry is pinned, in use, or locked by a stager right now."""


class CacheFullError(CacheError):
    """The cap cannot be met without evicting pinned or in-use entries."""


class SourceChangedError(CacheError):
    """A source file's size differs from the manifest: it changed after `models add`."""


class DigestMismatchError(CacheError):
    """Copied bytes whose digest differs from the manifest; nothing was published."""

    def __init__(self, path: str, expected: str, actual: str) -> None:
        super().__init__(
            f"{path}: digest mismatch, manifest says {expected}, the copied bytes give {actual}"
        )
        self.path, self.expected, self.actual = path, expected, actual
