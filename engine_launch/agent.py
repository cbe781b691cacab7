"""The engine's side of the registry conversation: register, heartbeat, deregister.

The router is the stable side and binds; the agent connects a DEALER and may be
started before the router is up. Every receive polls with a timeout. When the
router answers a heartbeat with ReRegister (it restarted, or our lease lapsed)
the agent registers again at once, so a router restart heals within one
heartbeat interval.
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from hpcserve.router import protocol as p

log = logging.getLogger(__name__)


class RegistryAgent:
    def __init__(
        self, endpoint: str, registration: p.Register, *, context: zmq.Context | None = None
    ) -> None:
        self.endpoint = endpoint
        self.registration = registration
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 500)
        self._sock.connect(endpoint)
        self.registered = False

    @property
    def replica_id(self) -> str:
        return self.registration.replica_id

    def close(self) -> None:
        self._sock.close()

    def register(self) -> None:
        self._sock.send(p.encode(self.registration))
        log.info("registering replica %s with router %s", self.replica_id, self.endpoint)

    def heartbeat(self, load: p.ReplicaLoad) -> None:
        if not self.registered:
            # Until the router acknowledged us, keep sending the full registration.
            self._sock.send(p.encode(msgspec.structs.replace(self.registration, load=load)))
        else:
            self._sock.send(p.encode(p.Heartbeat(self.replica_id, load)))

    def deregister(self, reason: str, timeout_s: float = 2.0) -> bool:
        """Leave routing; True when the router confirmed within timeout_s."""
        self._sock.send(p.encode(p.Deregister(self.replica_id, reason)))
        deadline_ms = int(timeout_s * 1000)
        while self._sock.poll(deadline_ms):
            reply = self._decode(self._sock.recv())
            if isinstance(reply, p.RegistryAck) and reply.lease_s == 0.0:
                log.info("replica %s deregistered: %s", self.replica_id, reason)
                self.registered = False
                return True
        log.warning(
            "router did not confirm deregistration of %s within %.1fs", self.replica_id, timeout_s
        )
        return False

    def process_replies(self, timeout_s: float) -> None:
        """Handle every reply that arrives within timeout_s (also the agent's sleep)."""
        timeout_ms = int(timeout_s * 1000)
        while self._sock.poll(timeout_ms):
            timeout_ms = 0
            reply = self._decode(self._sock.recv())
            match reply:
                case p.RegistryAck() if reply.lease_s > 0:
                    if not self.registered:
                        log.info(
                            "replica %s is live in the router (lease %.1fs)",
                            self.replica_id,
                            reply.lease_s,
                        )
                    self.registered = True
                case p.ReRegister():
                    if self.registered:
                        log.warning("router forgot replica %s; registering again", self.replica_id)
                    self.registered = False
                    self.register()

    @staticmethod
    def _decode(payload: bytes) -> p.RegistryReply | None:
        try:
            return p.registry_reply_decoder.decode(payload)
        except msgspec.DecodeError as err:
            log.warning("undecodable reply from router dropped: %s", err)
            return None
