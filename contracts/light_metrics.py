"""Prometheus metrics counted in plain Python numbers and exposed through one custom
Collector, for the request path.

prometheus_client's own metrics take a lock and, with labels, a lookup on every update
(Histogram.observe ~1.8 us, `labels(...).inc()` ~2.9 us on this host); these take neither.
They are for metrics updated from one thread at a time (the gateway's event loop, the
router's loop or whoever holds its lock): a scrape from another thread reads plain numbers.
`labels(...)` returns a child to keep.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class GaugeChild(CounterChild):
    __slots__ = ()

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class _Family:
    """A metric with labels; with none, it is its own only child (`inc`, `observe` work)."""

    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.children: dict[tuple[str, ...], object] = {}
        if not self.labelnames:
            child = self.children[()] = self._child()
            for method in ("inc", "dec", "set", "observe"):
                if hasattr(child, method):
                    setattr(self, method, getattr(child, method))

    def _child(self) -> object:
        raise NotImplementedError

    def labels(self, *values: str) -> object:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = self._child()
        return child

    def collect(self) -> list[Metric]:
        """Its one family, as a list (prometheus_client's metrics' `collect`)."""
        raise NotImplementedError


class Counter(_Family):
    inc: Callable[..., None]  # an unlabelled family's own child's (see _Family)

    def _child(self) -> CounterChild:
        return CounterChild()

    def labels(self, *values: str) -> CounterChild:
        return super().labels(*values)  # type: ignore[return-value]

    def collect(self) -> list[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self.children.items():
            family.add_metric(values, child.value)  # type: ignore[attr-defined]
        return [family]


class Gauge(_Family):
    inc: Callable[..., None]
    dec: Callable[..., None]
    set: Callable[[float], None]

    def _child(self) -> GaugeChild:
        return GaugeChild()

    def labels(self, *values: str) -> GaugeChild:
        return super().labels(*values)  # type: ignore[return-value]

    def collect(self) -> list[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self.children.items():
            family.add_metric(values, child.value)  # type: ignore[attr-defined]
        return [family]


class Histogram(_Family):
    observe: Callable[[float], None]

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
    ) -> None:
        self.bounds = tuple(float(b) for b in buckets)
        super().__init__(name, documentation, labelnames)

    def _child(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def labels(self, *values: str) -> HistogramChild:
        return super().labels(*values)  # type: ignore[return-value]

    def collect(self) -> list[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self.children.items():
            assert isinstance(child, HistogramChild)
            cumulative, buckets = 0, []
            for bound, count in zip((*self.bounds, math.inf), child.counts, strict=True):
                cumulative += count
                buckets.append((_bound_text(bound), cumulative))
            family.add_metric(values, buckets, child.sum)
        return [family]


def _bound_text(bound: float) -> str:
    return "+Inf" if bound == math.inf else repr(float(bound))


class LightCollector(Collector):
    def __init__(self, families: list[_Family]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            yield from family.collect()
