"""The finding -> action policy of one site: the config's overrides over the defaults of
contracts/health_policy.py (the Xid table and the checks)."""

from __future__ import annotations

from hpcserve.config import HealthConfig
from hpcserve.contracts.health_policy import CHECKS, XID_APPLICATION, XID_FAULTS
from hpcserve.contracts.protocol import HealthFinding


class Policy:
    """Maps a check (and an Xid) to its action: the config's overrides, else the defaults."""

    def __init__(self, config: HealthConfig | None = None) -> None:
        self.config = config or HealthConfig()
        self._xids = {int(k): v for k, v in self.config.xid_actions.items()}

    def xid_class(self, xid: int) -> str:
        if xid in XID_FAULTS:
            return "fault"
        if xid in XID_APPLICATION:
            return "application"
        return "unknown"

    def xid_action(self, xid: int) -> str:
        if xid in self._xids:
            return self._xids[xid]
        return {"fault": "drain", "application": "log"}.get(
            self.xid_class(xid), self.config.xid_default
        )

    def action(self, check: str) -> str:
        if check not in CHECKS:
            raise ValueError(f"unknown health check {check!r}")
        return self.config.actions.get(check, CHECKS[check])

    def finding(self, check: str, detail: str, *, gpu: int = -1) -> HealthFinding:
        return HealthFinding(check=check, detail=detail, action=self.action(check), gpu=gpu)

    def xid_finding(self, xid: int, gpu: int) -> HealthFinding:
        cls = self.xid_class(xid)
        detail = f"xid {xid} gpu {gpu}" if gpu >= 0 else f"xid {xid}"
        if cls == "application":
            detail += " (application error)"
        return HealthFinding(check="xid", detail=detail, action=self.xid_action(xid), gpu=gpu)
