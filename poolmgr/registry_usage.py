"""Keep the model registry's record of which replica serves which version in step with the
router's replica list, so `hpcserve models rm` refuses a version that a replica serves.

Engines report the version they serve (`Register.model_ref`); the pool manager passes its
one `ListReplicas` per poll to `RegistryUsage.sync`, which writes only the difference from
the last sync. The first sync after a start also removes rows of replicas that ended while
no pool manager ran. A failed write (registry busy, version removed meanwhile) is logged
and tried again at the next poll.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable
from pathlib import Path

from hpcserve.contracts.protocol import ReplicaInfo
from hpcserve.modelcache.registry import Registry, RegistryError

log = logging.getLogger(__name__)


class RegistryUsage:
    def __init__(self, registry_path: str) -> None:
        self.path = Path(registry_path)
        self._synced: set[tuple[str, str]] | None = None  # None: not synced since start

    def sync(self, replicas: Iterable[ReplicaInfo]) -> None:
        live = {(r.replica_id, r.model_ref) for r in replicas if r.model_ref}
        if live == self._synced or (not live and not self.path.exists()):
            return
        try:
            with Registry(self.path) as registry:
                recorded = set(registry.usage()) if self._synced is None else self._synced
                for replica_id, ref in sorted(recorded - live):
                    registry.release(replica_id, ref)
                for replica_id, ref in sorted(live - recorded):
                    try:
                        registry.mark_in_use(ref, replica_id)
                    except RegistryError as err:  # removed meanwhile: nothing to protect
                        log.warning("replica %s serves %s: %s", replica_id, ref, err)
        except (RegistryError, OSError, sqlite3.Error) as err:
            log.warning("cannot record model usage in %s: %s", self.path, err)
            return
        self._synced = live
