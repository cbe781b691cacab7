"""What the router reads from the model registry's database (LoRA adapters, aliases), kept
as name -> entry and re-read from `read()` at most every `refresh_s`.

A name not found triggers a re-read once `miss_refresh_s` has passed since the last one, so
a newly added entry is found within that time and unknown names cannot make the router read
the registry on every request. A registry that cannot be read (being written, moved) keeps
the last entries: it must not stop routing."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, Self, TypeVar

log = logging.getLogger(__name__)


class _Named(Protocol):
    @property
    def name(self) -> str: ...


Entry = TypeVar("Entry", bound=_Named)


class RegistryCatalog(Generic[Entry]):
    what = "entries"  # for the log line when the registry cannot be read

    def __init__(
        self,
        read: Callable[[], Iterable[Entry]],
        *,
        refresh_s: float = 30.0,
        miss_refresh_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self.refresh_s = refresh_s
        self.miss_refresh_s = miss_refresh_s
        self._clock = clock
        self._entries: dict[str, Entry] = {}
        self._read_at: float | None = None

    @classmethod
    def empty(cls) -> Self:
        return cls(list)

    def get(self, name: str) -> Entry | None:
        self._refresh(self.refresh_s)
        found = self._entries.get(name)
        if found is None:
            self._refresh(self.miss_refresh_s)
            found = self._entries.get(name)
        return found

    def all(self) -> list[Entry]:
        self._refresh(self.refresh_s)
        return list(self._entries.values())

    def _refresh(self, max_age_s: float) -> None:
        now = self._clock()
        if self._read_at is not None and now - self._read_at < max_age_s:
            return
        self._read_at = now
        try:
            entries = {e.name: e for e in self._read()}
        except Exception as err:  # a registry being written or moved must not stop routing
            log.warning("cannot read %s from the model registry: %s", self.what, err)
            return
        self.changed(self._entries, entries)
        self._entries = entries

    def changed(self, old: dict[str, Entry], new: dict[str, Entry]) -> None:
        """Called with the entries before and after each successful read."""
