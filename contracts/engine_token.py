"""The engine token: a per-deployment secret that every caller of an engine presents, so
that vLLM answers 401 to anyone else (another cluster user who reaches the node's port).

Where it lives: one file (`engine.token_file`, default `<state_dir>/secrets/engine-token`),
mode 0600 in a 0700 directory, made with 256 random bits by whichever component starts
first (`hpcserve up`, the pool manager, the gateway, the batch runner: `ensure_token`; an
atomic link, so two starting at once agree). It is never in an argv, in the job's
environment as Slurm records it, or in a log.

How it reaches vLLM: `hpcserve engine`, inside the job and as the service account, reads
the file named by `--engine-token-file` (`$HPCSERVE_ENGINE_TOKEN_FILE`: the path, not the
secret) and starts vLLM with `VLLM_API_KEY` in vLLM's environment only (vLLM 0.32 reads it
there, vllm/envs.py; /proc/PID/environ is readable by the process owner alone) and with
`--middleware hpcserve.contracts.engine_token.EngineTokenGuard`.

Why the guard beside vLLM's own check: vLLM's --api-key middleware
(vllm/entrypoints/serve/middleware/authenticate.py) guards only paths under /v1, /v2,
/inference and /cohere. /invocations (SageMaker's, which runs chat and completions),
/rerank, /score, /pooling, /classify, /tokenize, /detokenize, /abort_requests, /pause,
/resume and, in dev mode, /collective_rpc, /sleep and /reset_prefix_cache stay open to
anyone. The guard refuses every request without the token except GET or HEAD of /health
(an empty body) and /metrics (counters labelled by model, LoRA adapter name, finish
reason: no prompt, no tenant), which monitoring and the engine's own load reports read.
It is a pure ASGI class of a few lines: one header lookup and a constant-time comparison
per request, no extra hop.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import tempfile
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from hpcserve.contracts.private_files import private_dir, tighten

log = logging.getLogger(__name__)

# vLLM reads its API key from this variable; the engine sets it in vLLM's environment only.
TOKEN_ENV = "VLLM_API_KEY"
# Where `hpcserve engine` finds the token file (a path; the job script may carry it).
FILE_ENV = "HPCSERVE_ENGINE_TOKEN_FILE"
# What `--middleware` names: vLLM imports it in its API server process.
GUARD = "hpcserve.contracts.engine_token.EngineTokenGuard"
OPEN_PATHS = frozenset({"/health", "/metrics", "/metrics/"})


class EngineTokenError(RuntimeError):
    pass


def read_token(path: str | os.PathLike[str]) -> str:
    """The token in `path` (its mode tightened to 0600 if it was looser)."""
    try:
        tighten(path)
        token = Path(path).read_text().strip()
    except OSError as err:
        raise EngineTokenError(f"cannot read the engine token {path}: {err.strerror}") from None
    if not token or any(c.isspace() for c in token):
        raise EngineTokenError(f"the engine token {path} is empty or holds whitespace")
    return token


def ensure_token(path: str | os.PathLike[str]) -> str:
    """The token in `path`, made first (0600, in a 0700 directory) if there is none."""
    path = Path(path)
    if not path.exists():
        private_dir(path.parent)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".engine-token.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)  # fails if another component made it meanwhile: theirs wins
            log.info("made the token %s (mode 0600)", path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    else:
        tighten(path.parent)
    return read_token(path)


def bearer_matches(header: str, token: bytes) -> bool:
    """Whether an Authorization header value presents `token` as a bearer token
    (constant-time comparison)."""
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token)


def bearer(token: str) -> str:
    """The Authorization header value that presents `token`."""
    return f"Bearer {token}"


def auth_headers(token: str) -> dict[str, str]:
    """Headers for a request to an engine ({} without a token: an engine without one)."""
    return {"Authorization": bearer(token)} if token else {}


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_UNAUTHORIZED = (
    b'{"error":{"message":"This engine serves the hpcserve gateway only: send its engine '
    b'token","type":"authentication_error","param":null,"code":401}}'
)


class EngineTokenGuard:
    """ASGI middleware: 401 for any request without `Authorization: Bearer <token>` (the
    token from $VLLM_API_KEY), except GET/HEAD of /health and /metrics. Refuses to start
    without a token, so an engine never serves open by mistake."""

    def __init__(self, app: Callable[..., Awaitable[None]], token: str | None = None) -> None:
        token = token if token is not None else os.environ.get(TOKEN_ENV, "")
        if not token:
            raise EngineTokenError(f"{GUARD} needs the engine token in ${TOKEN_ENV}")
        self.app = app
        self._token = token.encode("latin-1")

    def allowed(self, scope: Scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS and scope.get("method", "GET") in ("GET", "HEAD"):
            return True
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, given = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    given.strip(), self._token
                )
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
        elif kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                        (b"www-authenticate", b"Bearer"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": _UNAUTHORIZED})
