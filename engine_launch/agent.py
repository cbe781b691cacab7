"""The engine's side of the registry conversation: register, heartbeat, deregister.

The router is the stable side and binds; the agent connects a DEALER and may be
started before the router is up. Every receive polls with a timeout. When the
router answers a heartbeat with ReRegister (it restarted, or our lease lapsed)
the agent registers again at once, so a router restart heals within one
heartbeat interval. Each acknowledgement also names the router's KV relay socket
(`on_kv_relay`): the engine's relay thread (kv_relay.py) connects there, and again if
the router moved.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from hpcserve.contracts import protocol as p
from hpcserve.contracts.curve import make_client

log = logging.getLogger(__name__)

# Registrations without an answer before the agent says why it may be talking to nobody.
UNANSWERED_WARNING = 5


class RegistryAgent:
    def __init__(
        self,
        endpoint: str,
        registration: p.Register,
        *,
        context: zmq.Context | None = None,
        curve_dir: str = "",
    ) -> None:
        self.endpoint = endpoint
        self.registration = registration
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 500)
        # A router that is down, or refuses our CURVE key, must never block the engine's loop.
        self._sock.setsockopt(zmq.SNDTIMEO, 0)
        self._sock.setsockopt(zmq.SNDHWM, 16)
        if curve_dir:  # contracts/curve.py: the cluster's engine key
            make_client(self._sock, Path(curve_dir))
        self._sock.connect(endpoint)
        self.registered = False
        self._unanswered = 0
        # The router asks for a LoRA adapter (engine_launch/lora.py answers with send()).
        self.on_load_adapter: Callable[[p.LoadAdapter], None] | None = None
        # The router's KV relay address, from its acks (engine_launch/kv_relay.py).
        self.on_kv_relay: Callable[[str], None] | None = None

    @property
    def replica_id(self) -> str:
        return self.registration.replica_id

    def close(self) -> None:
        self._sock.close()

    def register(self) -> None:
        self._send(self.registration)
        log.info("registering replica %s with router %s", self.replica_id, self.endpoint)

    def _send(self, message: p.RegistryMessage) -> bool:
        try:
            self._sock.send(p.encode(message))
            return True
        except zmq.Again:
            # Queue full: nothing reaches the router. Heartbeats are resent anyway.
            return False

    def heartbeat(self, load: p.ReplicaLoad, adapters: list[str] | None = None) -> None:
        if adapters is not None:
            self.registration = msgspec.structs.replace(self.registration, adapters=adapters)
        if not self.registered:
            # Until the router acknowledged us, keep sending the full registration.
            self._send(msgspec.structs.replace(self.registration, load=load))
            self._unanswered += 1
            if self._unanswered == UNANSWERED_WARNING:
                log.warning(
                    "router %s has not answered %d registrations of %s: is it running, and "
                    "does this engine hold the cluster's CURVE key (router.curve_dir)?",
                    self.endpoint,
                    self._unanswered,
                    self.replica_id,
                )
        else:
            self._send(p.Heartbeat(self.replica_id, load, adapters))

    def send(self, message: p.RegistryMessage) -> None:
        self._send(message)

    def deregister(self, reason: str, timeout_s: float = 2.0) -> bool:
        """Leave routing; True when the router confirmed within timeout_s."""
        if not self._send(p.Deregister(self.replica_id, reason)):
            log.warning("router unreachable; replica %s leaves by lease expiry", self.replica_id)
            return False
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
                    self._unanswered = 0
                    if reply.kv_relay and self.on_kv_relay is not None:
                        self.on_kv_relay(reply.kv_relay)
                case p.ReRegister():
                    if self.registered:
                        log.warning("router forgot replica %s; registering again", self.replica_id)
                    self.registered = False
                    self.register()
                case p.LoadAdapter() if self.on_load_adapter is not None:
                    self.on_load_adapter(reply)

    @staticmethod
    def _decode(payload: bytes) -> p.RegistryReply | None:
        try:
            return p.registry_reply_decoder.decode(payload)
        except msgspec.DecodeError as err:
            log.warning("undecodable reply from router dropped: %s", err)
            return None
