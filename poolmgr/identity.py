"""How a Slurm job says which pool it serves, across pool-manager restarts (pure).

hpcserve's jobs carry `--comment=hpcserve:pool=<pool>;model=<model>;spec=<hex>;nonce=<hex>`.
The spec is a digest of everything that shapes a replica of the pool (model, engine,
its arguments, GPUs, Slurm settings), so after a config reload the pool manager knows which
jobs to replace and which to keep. The nonce makes a comment unique, so a recycled job id
is never mistaken for a job this pool manager submitted earlier.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

PREFIX = "hpcserve:"


@dataclass(frozen=True)
class JobIdentity:
    pool: str
    model: str
    nonce: str
    spec: str = ""

    def comment(self) -> str:
        spec = f";spec={self.spec}" if self.spec else ""
        return f"{PREFIX}pool={self.pool};model={self.model}{spec};nonce={self.nonce}"


def new_identity(pool: str, model: str, spec: str = "") -> JobIdentity:
    return JobIdentity(pool=pool, model=model, nonce=secrets.token_hex(4), spec=spec)


def parse_comment(comment: str) -> JobIdentity | None:
    """The identity in a job comment, or None for jobs that are not hpcserve's."""
    if not comment.startswith(PREFIX):
        return None
    fields = dict(part.split("=", 1) for part in comment[len(PREFIX) :].split(";") if "=" in part)
    pool, model, nonce = fields.get("pool"), fields.get("model"), fields.get("nonce")
    if not pool or not model or not nonce:
        return None
    return JobIdentity(pool=pool, model=model, nonce=nonce, spec=fields.get("spec", ""))
