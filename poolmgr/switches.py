"""The switch topology, from Slurm to the router: node -> its leaf switch.

Where the site runs Slurm's topology/tree plugin, `scontrol show topology` says which leaf
switch each node hangs off (slurm/parse.py). The router places a disaggregated request's
decode replica near its prefill replica: the same node first, then the same leaf switch
(router/policies/pd_roles.py). The router never calls Slurm, so the pool manager reads the
topology (at its first poll, then every `refresh_s`: it changes only when the site
reconfigures slurmctld) and hands it over with its ListReplicas (`node_switches`) when it
changed, and once to each router epoch (a restarted router starts without it). A site
without a topology plugin sends {} once: the router's decode choice stays by node only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

REFRESH_S = 600.0


class SwitchTopology:
    def __init__(
        self,
        read: Callable[[], dict[str, str]],
        *,
        on_error: Callable[[Exception], None],
        refresh_s: float = REFRESH_S,
    ) -> None:
        """read: Slurm's answer (SlurmClient.topology); on_error: a failed read (logged and
        counted there), the last known topology is kept."""
        self._read = read
        self._on_error = on_error
        self.refresh_s = refresh_s
        self.switches: dict[str, str] | None = None  # None: never read
        self._read_at: float | None = None
        self._router_epoch: str | None = None  # the router epoch that holds `switches`

    def for_router(self, now: float) -> dict[str, str] | None:
        """What the next ListReplicas carries: the topology when the router lacks it, else
        None (nothing new)."""
        if self._read_at is None or now - self._read_at >= self.refresh_s:
            self._read_at = now
            try:
                switches = self._read()
            except Exception as err:  # SlurmError: the client's one failure
                self._on_error(err)
            else:
                if switches != self.switches:
                    self._describe(switches)
                    self.switches = switches
                    self._router_epoch = None
        if self.switches is None or self._router_epoch is not None:
            return None
        return self.switches

    def answered(self, sent: dict[str, str] | None, epoch: str) -> None:
        """The router answered a ListReplicas that carried `sent`, with its epoch."""
        if sent is not None:
            self._router_epoch = epoch
        elif epoch != self._router_epoch:
            self._router_epoch = None  # a new router: it gets the topology next poll

    @staticmethod
    def _describe(switches: dict[str, str]) -> None:
        if switches:
            log.info(
                "switch topology: %d nodes under %d leaf switches",
                len(switches),
                len(set(switches.values())),
            )
        else:
            log.info("no switch topology in Slurm (topology/tree): decode locality by node")
