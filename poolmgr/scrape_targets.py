"""The engines as Prometheus scrape targets (file_sd): the pool manager writes the live
replicas it reads from the router to `poolmgr.scrape_targets_file` on each poll, so a
site's Prometheus scrapes every engine's vLLM /metrics with `file_sd_configs`, whichever
node and port Slurm gave it.

The file is rewritten (atomically) only when the set of replicas changed, and is made
readable by others (0644): it names hosts, ports, pools and models, which Prometheus, a
separate account, must read; nothing in it is secret.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

import msgspec

from hpcserve.contracts.protocol import ReplicaInfo

log = logging.getLogger(__name__)


class TargetGroup(msgspec.Struct, frozen=True):
    targets: list[str]
    labels: dict[str, str]


def target_groups(replicas: Sequence[ReplicaInfo]) -> list[TargetGroup]:
    """One group per replica (host:port of its engine), labelled with what it serves."""
    groups = []
    for replica in sorted(replicas, key=lambda r: r.replica_id):
        address = urlsplit(replica.url).netloc
        if not address:
            continue
        labels = {
            "pool": replica.pool,
            "model": replica.model,
            "replica_id": replica.replica_id,
            "slurm_job_id": str(replica.slurm_job_id),
            "node": replica.node,
        }
        groups.append(TargetGroup([address], labels))
    return groups


class ScrapeTargetsFile:
    """Writes the target groups to `path` when they change; a write that fails is logged
    once per failure streak and retried on the next poll."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._written: bytes | None = None
        self._failing = False

    def update(self, replicas: Sequence[ReplicaInfo]) -> None:
        data = msgspec.json.format(msgspec.json.encode(target_groups(replicas))) + b"\n"
        if data == self._written:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.chmod(tmp, 0o644)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as err:
            if not self._failing:
                log.warning("cannot write the scrape targets %s: %s", self.path, err)
            self._failing = True
            return
        if self._failing:
            log.info("scrape targets %s written again", self.path)
        self._failing = False
        self._written = data
        log.info("scrape targets: %d engine(s) in %s", data.count(b'"targets"'), self.path)
