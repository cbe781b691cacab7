"""The model registry: models, versions, LoRA adapters, aliases with canaries, and which
running replica uses which version. SQLite on the control node.

A version is one concrete set of weights: a source directory, its digest manifest, a
quantisation (bf16, fp16, fp8, awq or gptq, the last two int4) and the engine arguments it
needs. A quantised variant of the same model is added as its own version, so every
`name@version` names exactly one manifest. Model, alias and adapter names share one
namespace, since a client may ask for any of them as its `model`. A LoRA adapter is bound
to one version of its base model (it was trained against those weights): it is served only
by replicas of that version, and that version cannot be removed while the adapter exists.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import msgspec

from hpcserve.contracts.canary import (
    CanaryError,
    CanarySettings,
    GoldenRecord,
    check_settings,
    decode_record,
    encode_record,
)
from hpcserve.contracts.private_files import private_file
from hpcserve.modelcache.evaluations import (
    DEFAULT_MAX_DROP,
    AuditEntry,
    Evaluation,
    GateRule,
)
from hpcserve.modelcache.evaluations import TABLES as _ONBOARDING_TABLES
from hpcserve.modelcache.manifest import Manifest, decode_manifest
from hpcserve.modelcache.refs import Ref, check_name, parse_ref

QUANTIZATIONS = ("bf16", "fp16", "fp8", "awq", "gptq")
SCHEMA_VERSION = 2
SCHEMA = """
CREATE TABLE models (
    name TEXT PRIMARY KEY,
    created REAL NOT NULL
);
CREATE TABLE versions (
    model TEXT NOT NULL REFERENCES models(name),
    version INTEGER NOT NULL CHECK (version >= 1),
    quantization TEXT NOT NULL,
    source TEXT NOT NULL,
    engine_args TEXT NOT NULL,
    manifest TEXT NOT NULL,
    manifest_digest TEXT NOT NULL,
    total_bytes INTEGER NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (model, version)
);
CREATE TABLE adapters (
    name TEXT PRIMARY KEY,
    base_model TEXT NOT NULL REFERENCES models(name),
    rank INTEGER NOT NULL CHECK (rank >= 1),
    path TEXT NOT NULL,
    manifest TEXT NOT NULL,
    manifest_digest TEXT NOT NULL,
    total_bytes INTEGER NOT NULL,
    created REAL NOT NULL,
    base_version INTEGER NOT NULL,
    FOREIGN KEY (base_model, base_version) REFERENCES versions(model, version)
);
CREATE TABLE aliases (
    name TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    version INTEGER NOT NULL,
    canary_model TEXT,
    canary_version INTEGER,
    canary_percent INTEGER NOT NULL DEFAULT 0 CHECK (canary_percent BETWEEN 0 AND 99),
    updated REAL NOT NULL,
    FOREIGN KEY (model, version) REFERENCES versions(model, version),
    FOREIGN KEY (canary_model, canary_version) REFERENCES versions(model, version),
    CHECK ((canary_model IS NULL) = (canary_percent = 0))
);
CREATE TABLE replica_usage (
    replica_id TEXT NOT NULL,
    model TEXT NOT NULL,
    version INTEGER NOT NULL,
    since REAL NOT NULL,
    PRIMARY KEY (replica_id, model, version),
    FOREIGN KEY (model, version) REFERENCES versions(model, version)
);
"""
# Numerical canaries (contracts/canary.py): a version's golden record, a model's own
# canary prompts. Removing the version (the model) removes them.
_CANARY_TABLES = """
CREATE TABLE IF NOT EXISTS canary_records (
    model TEXT NOT NULL,
    version INTEGER NOT NULL,
    record TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (model, version),
    FOREIGN KEY (model, version) REFERENCES versions(model, version) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS canary_prompts (
    model TEXT PRIMARY KEY REFERENCES models(name) ON DELETE CASCADE,
    prompts TEXT NOT NULL
);
"""
# From schema 1: adapters gain the base version they are bound to; an existing adapter is
# bound to its base model's latest version.
_MIGRATE_1_TO_2 = """
ALTER TABLE adapters ADD COLUMN base_version INTEGER NOT NULL DEFAULT 0;
UPDATE adapters SET base_version =
    (SELECT COALESCE(MAX(version), 0) FROM versions WHERE model = adapters.base_model);
"""


class RegistryError(ValueError):
    """A registry request that cannot be done; the message names the bad value."""


class NotFoundError(RegistryError):
    pass


class InUseError(RegistryError):
    pass


class GateRefused(RegistryError):
    """Traffic moved to a version that has not passed its parity gate, without a forced
    override (`--force --reason`)."""


class ModelVersion(msgspec.Struct, frozen=True):
    model: str
    version: int
    quantization: str
    source: str
    engine_args: tuple[str, ...]
    manifest_digest: str
    total_bytes: int
    created: float

    @property
    def ref(self) -> str:
        return f"{self.model}@{self.version}"


class Adapter(msgspec.Struct, frozen=True):
    name: str
    base_model: str
    rank: int
    path: str
    manifest_digest: str
    total_bytes: int
    created: float
    base_version: int = 0  # the version of base_model it is bound to

    @property
    def base_ref(self) -> str:
        return f"{self.base_model}@{self.base_version}"


class Alias(msgspec.Struct, frozen=True):
    """`name` routes to `target`, except `canary_percent`% of requests that go to `canary`."""

    name: str
    target: str
    canary: str | None
    canary_percent: int
    updated: float

    def pick(self, u: float) -> str:
        """The ref for a request drawn with `u` uniform in [0, 1)."""
        if self.canary is not None and u * 100 < self.canary_percent:
            return self.canary
        return self.target


class Model(msgspec.Struct, frozen=True):
    name: str
    versions: tuple[ModelVersion, ...]
    aliases: tuple[Alias, ...]
    adapters: tuple[Adapter, ...]
    in_use: dict[str, list[str]]  # ref -> replica ids


class Registry:
    """The registry in one SQLite file.

    Every change runs in one `BEGIN IMMEDIATE` transaction: its checks (names free, refs
    present, not in use) and its writes see the same state, a concurrent writer waits up to
    `busy_timeout_s`, and a failed check changes nothing. The rollback journal is used, not
    WAL, so the file may live on an NFS home directory.
    """

    def __init__(
        self, path: Path, *, busy_timeout_s: float = 10.0, clock: Callable[[], float] = time.time
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        # Owner-only (its rollback journal takes the file's mode): contracts/private_files.py.
        private_file(self.path)
        self._db = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None)
        self._db.execute("PRAGMA foreign_keys = ON")
        self._init_schema()

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writes

    def add_version(
        self,
        name: str,
        source: str,
        manifest: Manifest,
        *,
        quantization: str = "bf16",
        engine_args: Sequence[str] = (),
        version: int | None = None,
    ) -> ModelVersion:
        """Register `source` (described by `manifest`) as the next version of `name`."""
        check_name(name, "model name")
        _check_choice(quantization, QUANTIZATIONS, "quantization")
        args = _check_engine_args(engine_args)
        with self._write():
            self.check_free(name, kind="model")
            if version is not None and (version < 1 or self._has_version(name, version)):
                raise RegistryError(f"version {version} of {name!r} exists or is not >= 1")
            version = version or self._next_version(name)
            now = self.clock()
            self._db.execute("INSERT OR IGNORE INTO models VALUES (?, ?)", (name, now))
            self._db.execute(
                "INSERT INTO versions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (name, version, quantization, source, json.dumps(args),
                 manifest.encode().decode(), manifest.digest(), manifest.total_bytes, now),
            )  # fmt: skip
        return self.version(f"{name}@{version}")

    def add_adapter(
        self, name: str, base: str, path: str, manifest: Manifest, *, rank: int
    ) -> Adapter:
        """Register an adapter bound to `base`: `name@3`, or `name` (its latest version) or
        an alias (its target now); the binding does not follow later versions."""
        check_name(name, "adapter name")
        if not isinstance(rank, int) or rank < 1:
            raise RegistryError(f"LoRA rank must be a positive integer, got {rank!r}")
        with self._write():
            self.check_free(name, kind="adapter")
            ref = self._require_version(base)
            self._db.execute(
                "INSERT INTO adapters VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (name, ref.name, rank, path, manifest.encode().decode(), manifest.digest(),
                 manifest.total_bytes, self.clock(), ref.version),
            )  # fmt: skip
        return self.adapter(name)

    def set_alias(self, name: str, ref: str) -> Alias:
        """Point alias `name` (new or existing) at `ref`; any canary is dropped."""
        check_name(name, "alias name")
        with self._write():
            self.check_free(name, kind="alias")
            target = self._require_version(ref)
            self._db.execute(
                "INSERT OR REPLACE INTO aliases VALUES (?, ?, ?, NULL, NULL, 0, ?)",
                (name, target.name, target.version, self.clock()),
            )
        return self.alias(name)

    def promote(self, alias: str, ref: str, share: int = 100) -> Alias:
        """Route `share`% of `alias` to `ref`: 100 makes it the target (no canary), 1-99
        makes it the canary, 0 drops it as the canary."""
        if isinstance(share, bool) or not isinstance(share, int) or not 0 <= share <= 100:
            raise RegistryError(f"canary share must be an integer from 0 to 100, got {share!r}")
        with self._write():
            current = self.alias(alias)
            new = self._require_version(ref)
            if share == 100:
                row: tuple[str, int | None, str | None, int | None, int]
                row = (new.name, new.version, None, None, 0)
            elif share == 0:
                if current.canary != str(new):
                    raise RegistryError(f"{new} is not the canary of alias {alias!r}")
                row = (*parse_ref(current.target), None, None, 0)
            elif str(new) == current.target:
                raise RegistryError(f"{new} is already the target of alias {alias!r}")
            else:
                row = (*parse_ref(current.target), new.name, new.version, share)
            self._db.execute(
                "UPDATE aliases SET model = ?, version = ?, canary_model = ?, "
                "canary_version = ?, canary_percent = ?, updated = ? WHERE name = ?",
                (*row, self.clock(), alias),
            )
        return self.alias(alias)

    def remove(self, text: str) -> str:
        """Remove a version (`name@3`), a whole model, an alias or an adapter; returns what
        was removed. Refused while a replica uses it or an alias or adapter points at it."""
        ref = parse_ref(text)
        with self._write():
            if ref.version is not None:
                return self._remove_versions(ref.name, [ref.version])
            if self._exists("aliases", ref.name):
                self._db.execute("DELETE FROM aliases WHERE name = ?", (ref.name,))
                return f"alias {ref.name}"
            if self._exists("adapters", ref.name):
                self._db.execute("DELETE FROM adapters WHERE name = ?", (ref.name,))
                return f"adapter {ref.name}"
            self._require_model(ref.name)
            return self._remove_versions(ref.name, self._version_numbers(ref.name))

    def mark_in_use(self, ref: str, replica_id: str) -> None:
        """Record that replica `replica_id` serves `ref` (an alias resolves to its target)."""
        if not replica_id:
            raise RegistryError("replica id must not be empty")
        with self._write():
            v = self._require_version(ref)
            self._db.execute(
                "INSERT OR REPLACE INTO replica_usage VALUES (?, ?, ?, ?)",
                (replica_id, v.name, v.version, self.clock()),
            )

    def release(self, replica_id: str, ref: str | None = None) -> int:
        """Forget what `replica_id` uses (only `ref`, if given); returns rows removed."""
        with self._write():
            if ref is None:
                cur = self._db.execute(
                    "DELETE FROM replica_usage WHERE replica_id = ?", (replica_id,)
                )
            else:
                r = parse_ref(ref)
                cur = self._db.execute(
                    "DELETE FROM replica_usage WHERE replica_id = ? AND model = ? AND version = ?",
                    (replica_id, r.name, r.version),
                )
        return cur.rowcount

    def set_canary_record(self, ref: str, record: GoldenRecord) -> GoldenRecord:
        """Store `record` as the golden record of version `ref` (any earlier one replaced):
        every replica of the version is held to it (contracts/canary.py)."""
        with self._write():
            v = self._require_version(ref)
            if record.model_ref != str(v):
                raise RegistryError(f"the golden record was made for {record.model_ref}, not {v}")
            try:
                data = encode_record(record)
                decode_record(data)  # its settings and answers are usable
            except CanaryError as err:
                raise RegistryError(str(err)) from None
            self._db.execute(
                "INSERT OR REPLACE INTO canary_records VALUES (?, ?, ?, ?)",
                (v.name, v.version, data.decode(), self.clock()),
            )
        return record

    def clear_canary_record(self, ref: str) -> bool:
        """Drop version `ref`'s golden record; False when it had none."""
        with self._write():
            v = self._require_version(ref)
            cur = self._db.execute(
                "DELETE FROM canary_records WHERE model = ? AND version = ?", (v.name, v.version)
            )
        return cur.rowcount > 0

    def set_canary_prompts(self, model: str, prompts: Sequence[str] | None) -> None:
        """The canary prompts recorded for `model`'s versions from now on; None: the shipped
        default (contracts/canary.py DEFAULT_PROMPTS)."""
        with self._write():
            self._require_model(model)
            if prompts is None:
                self._db.execute("DELETE FROM canary_prompts WHERE model = ?", (model,))
                return
            try:
                check_settings(CanarySettings(prompts=tuple(prompts)))
            except CanaryError as err:
                raise RegistryError(f"canary {err}") from None
            self._db.execute(
                "INSERT OR REPLACE INTO canary_prompts VALUES (?, ?)",
                (model, json.dumps(list(prompts))),
            )

    # -- reads

    def canary_record(self, ref: str) -> GoldenRecord | None:
        """Version `ref`'s golden record (an alias: its target's); None when it has none."""
        v = self._require_version(ref)
        row = self._db.execute(
            "SELECT record FROM canary_records WHERE model = ? AND version = ?",
            (v.name, v.version),
        ).fetchone()
        return decode_record(row[0]) if row is not None else None

    def canary_prompts(self, model: str) -> tuple[str, ...] | None:
        """`model`'s own canary prompts; None: it uses the shipped default."""
        self._require_model(model)
        row = self._db.execute(
            "SELECT prompts FROM canary_prompts WHERE model = ?", (model,)
        ).fetchone()
        return tuple(json.loads(row[0])) if row is not None else None

    def version(self, text: str) -> ModelVersion:
        """`name@3`, `name` (its latest version) or an alias (its target)."""
        v = self._require_version(text)
        row = self._db.execute(
            "SELECT * FROM versions WHERE model = ? AND version = ?", (v.name, v.version)
        ).fetchone()
        return _version_from_row(row)

    def manifest(self, text: str) -> Manifest:
        v = self._require_version(text)
        (data,) = self._db.execute(
            "SELECT manifest FROM versions WHERE model = ? AND version = ?", (v.name, v.version)
        ).fetchone()
        return decode_manifest(data)

    def versions(self, model: str | None = None) -> list[ModelVersion]:
        sql, args = "SELECT * FROM versions", cast(tuple[str, ...], ())
        if model is not None:
            sql, args = sql + " WHERE model = ?", (model,)
        rows = self._db.execute(sql + " ORDER BY model, version", args).fetchall()
        return [_version_from_row(r) for r in rows]

    def aliases(self) -> list[Alias]:
        rows = self._db.execute("SELECT * FROM aliases ORDER BY name").fetchall()
        return [_alias_from_row(r) for r in rows]

    def alias(self, name: str) -> Alias:
        row = self._db.execute("SELECT * FROM aliases WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise NotFoundError(f"no alias named {name!r}")
        return _alias_from_row(row)

    def adapters(self) -> list[Adapter]:
        rows = self._db.execute("SELECT * FROM adapters ORDER BY name").fetchall()
        return [_adapter_from_row(r) for r in rows]

    def adapter(self, name: str) -> Adapter:
        row = self._db.execute("SELECT * FROM adapters WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise NotFoundError(f"no adapter named {name!r}")
        return _adapter_from_row(row)

    def adapter_manifest(self, name: str) -> Manifest:
        self.adapter(name)
        row = self._db.execute("SELECT manifest FROM adapters WHERE name = ?", (name,))
        return decode_manifest(row.fetchone()[0])

    def model(self, name: str) -> Model:
        self._require_model(name)
        versions = self.versions(name)
        refs = {v.ref for v in versions}
        return Model(
            name=name,
            versions=tuple(versions),
            aliases=tuple(a for a in self.aliases() if {a.target, a.canary} & refs),
            adapters=tuple(a for a in self.adapters() if a.base_model == name),
            in_use={ref: users for ref in sorted(refs) if (users := self.users(ref))},
        )

    def users(self, ref: str) -> list[str]:
        r = parse_ref(ref)
        rows = self._db.execute(
            "SELECT replica_id FROM replica_usage WHERE model = ? AND version = ? "
            "ORDER BY replica_id",
            (r.name, r.version),
        ).fetchall()
        return [row[0] for row in rows]

    def usage(self) -> list[tuple[str, str]]:
        """Every (replica id, name@version) recorded in use."""
        rows = self._db.execute(
            "SELECT replica_id, model, version FROM replica_usage ORDER BY replica_id"
        ).fetchall()
        return [(rid, f"{model}@{version}") for rid, model, version in rows]

    def kind(self, name: str) -> str | None:
        """'model', 'alias', 'adapter' or None: what `name` is in the shared namespace."""
        for table, kind in (("models", "model"), ("aliases", "alias"), ("adapters", "adapter")):
            if self._exists(table, name):
                return kind
        return None

    # -- onboarding: evaluations, the parity gate, gated traffic moves (evaluations.py)

    def record_evaluation(self, evaluation: Evaluation) -> Evaluation:
        """Keep `evaluation` of its version; the newest one decides the version's gate."""
        with self._write():
            v = self._require_version(evaluation.ref)
            if str(v) != evaluation.ref:
                raise RegistryError(f"an evaluation names one version, not {evaluation.ref!r}")
            now = evaluation.at or self.clock()
            cur = self._db.execute(
                "INSERT INTO evaluations (model, version, passed, record, created) "
                "VALUES (?, ?, ?, '', ?)",
                (v.name, v.version, int(evaluation.passed), now),
            )
            row_id = int(cur.lastrowid or 0)
            stored = msgspec.structs.replace(evaluation, id=row_id, at=now)
            self._db.execute(
                "UPDATE evaluations SET record = ? WHERE id = ?",
                (msgspec.json.encode(stored).decode(), row_id),
            )
        return stored

    def evaluations(self, ref: str) -> list[Evaluation]:
        """Every evaluation of version `ref`, oldest first."""
        v = self._require_version(ref)
        rows = self._db.execute(
            "SELECT record FROM evaluations WHERE model = ? AND version = ? ORDER BY id",
            (v.name, v.version),
        ).fetchall()
        return [msgspec.json.decode(r[0], type=Evaluation) for r in rows]

    def latest_evaluation(self, ref: str) -> Evaluation | None:
        found = self.evaluations(ref)
        return found[-1] if found else None

    def set_gate_rule(self, model: str, max_drop: float, *, actor: str = "") -> GateRule:
        """The parity gate of `model`'s versions: no key metric more than `max_drop` points
        below the baseline's. Applies to evaluations from now on."""
        if isinstance(max_drop, bool) or not isinstance(max_drop, int | float) or max_drop < 0:
            raise RegistryError(f"max drop must be a number of points >= 0, got {max_drop!r}")
        with self._write():
            self._require_model(model)
            now = self.clock()
            self._db.execute(
                "INSERT OR REPLACE INTO gate_rules VALUES (?, ?, ?)", (model, float(max_drop), now)
            )
            self._audit("gate", model, "", detail=f"max drop {max_drop:g} points", actor=actor)
        return self.gate_rule(model)

    def gate_rule(self, model: str) -> GateRule:
        row = self._db.execute(
            "SELECT max_drop, updated FROM gate_rules WHERE model = ?", (model,)
        ).fetchone()
        return GateRule(model, row[0], row[1]) if row else GateRule(model, DEFAULT_MAX_DROP)

    def gate_status(self, ref: str) -> tuple[bool, str]:
        """(passed, why): whether version `ref`'s newest evaluation passed its gate."""
        v = self._require_version(ref)
        last = self.latest_evaluation(str(v))
        if last is None:
            return False, f"{v} has no evaluation (`hpcserve models eval {v} --suite FILE`)"
        against = f" vs {last.baseline}" if last.baseline else " (no baseline)"
        if not last.passed:
            why = "; ".join(last.reasons) or "a key metric failed"
            return False, f"{v} failed its gate in evaluation {last.id}{against}: {why}"
        return True, f"gate passed: evaluation {last.id} ({last.suite}{against})"

    def set_alias_gated(
        self, name: str, ref: str, *, force_reason: str = "", actor: str = ""
    ) -> Alias:
        """set_alias, only to a version that passed its gate (or the alias's target now);
        `force_reason` overrides the gate. Either way one audit line is kept."""
        with self._write():
            v = self._require_version(ref)
            current = self.alias(name).target if self._exists("aliases", name) else None
            detail, forced = self._gate_or_force(str(v), force_reason, exempt=current == str(v))
            alias = self.set_alias(name, ref)
            self._audit("alias", name, str(v), detail, forced, actor)
        return alias

    def promote_gated(
        self, alias: str, ref: str, share: int = 100, *, force_reason: str = "", actor: str = ""
    ) -> Alias:
        """promote, only to a version that passed its gate (share 0, taking traffic away,
        needs none); `force_reason` overrides the gate. One audit line either way."""
        with self._write():
            v = self._require_version(ref)
            detail, forced = self._gate_or_force(str(v), force_reason, exempt=share == 0)
            result = self.promote(alias, ref, share)
            self._audit("promote", alias, str(v), f"share {share}%; {detail}", forced, actor)
        return result

    def audit_log(self, subject: str | None = None) -> list[AuditEntry]:
        """Traffic moves and gate changes, oldest first (of one alias or model if given)."""
        sql, args = "SELECT * FROM audit", cast(tuple[str, ...], ())
        if subject is not None:
            sql, args = sql + " WHERE subject = ?", (subject,)
        rows = self._db.execute(sql + " ORDER BY id", args).fetchall()
        return [AuditEntry(r[0], r[1], r[2], r[3], r[4], bool(r[5]), *r[6:]) for r in rows]

    def _gate_or_force(self, ref: str, force_reason: str, *, exempt: bool) -> tuple[str, str]:
        """(what the audit line says, the reason when the gate was overridden, else "")."""
        if exempt:
            return "no gate needed (no traffic moves to it)", ""
        passed, why = self.gate_status(ref)
        if passed:
            return why, ""
        if not force_reason.strip():
            raise GateRefused(f"{why}; to move traffic anyway give --force --reason TEXT")
        return f"gate overridden: {why}", force_reason.strip()

    def _audit(
        self, action: str, subject: str, ref: str, detail: str, reason: str = "", actor: str = ""
    ) -> None:
        """One audit row; `reason` non-empty marks a forced move."""
        self._db.execute(
            "INSERT INTO audit (at, action, subject, ref, forced, reason, actor, detail) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (self.clock(), action, subject, ref, int(bool(reason.strip())), reason.strip(),
             actor, detail),
        )  # fmt: skip

    # -- helpers

    def _init_schema(self) -> None:
        with self._write():
            (found,) = self._db.execute("PRAGMA user_version").fetchone()
            if found > SCHEMA_VERSION:
                raise RegistryError(
                    f"{self.path} has registry schema {found}; this hpcserve knows "
                    f"{SCHEMA_VERSION} (upgrade hpcserve)"
                )
            if found == 0:
                _run_script(self._db, SCHEMA)
            if found == 1:
                _run_script(self._db, _MIGRATE_1_TO_2)
            # Onboarding (evaluations.py) and the numerical canaries: created where absent,
            # on every open, so they need no schema number and an older hpcserve still opens
            # the file.
            _run_script(self._db, _ONBOARDING_TABLES)
            _run_script(self._db, _CANARY_TABLES)
            if found != SCHEMA_VERSION:
                self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @contextlib.contextmanager
    def _write(self) -> Iterator[None]:
        if self._db.in_transaction:  # nested: the outer transaction decides
            yield
            return
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _exists(self, table: str, name: str) -> bool:
        sql = f"SELECT 1 FROM {table} WHERE name = ?"  # table names are ours, never input
        return self._db.execute(sql, (name,)).fetchone() is not None

    def check_free(self, name: str, kind: str) -> None:
        """Raise unless `name` may be used for a new `kind` ('model', 'alias', 'adapter')."""
        found = self.kind(name)
        if found is not None and found != kind:
            article = "an" if found[0] in "aeiou" else "a"
            raise RegistryError(f"{name!r} is already the name of {article} {found}")
        if kind == "adapter" and found == "adapter":
            raise RegistryError(f"adapter {name!r} exists; remove it first")

    def _require_model(self, name: str) -> None:
        if not self._exists("models", name):
            what = self.kind(name)
            hint = f" ({name!r} is an {what})" if what else ""
            raise NotFoundError(f"no model named {name!r}{hint}")

    def _require_version(self, text: str) -> Ref:
        ref = parse_ref(text)
        if ref.version is None and self._exists("aliases", ref.name):
            return parse_ref(self.alias(ref.name).target)
        self._require_model(ref.name)
        known = self._version_numbers(ref.name)
        if ref.version is None and known:
            return Ref(ref.name, known[-1])
        if ref.version not in known:
            listed = ", ".join(map(str, known)) or "none"
            raise NotFoundError(f"{ref} does not exist; versions of {ref.name}: {listed}")
        return ref

    def _has_version(self, name: str, version: int) -> bool:
        sql = "SELECT 1 FROM versions WHERE model = ? AND version = ?"
        return self._db.execute(sql, (name, version)).fetchone() is not None

    def _version_numbers(self, name: str) -> list[int]:
        rows = self._db.execute(
            "SELECT version FROM versions WHERE model = ? ORDER BY version", (name,)
        ).fetchall()
        return [r[0] for r in rows]

    def _next_version(self, name: str) -> int:
        sql = "SELECT COALESCE(MAX(version), 0) + 1 FROM versions WHERE model = ?"
        return int(self._db.execute(sql, (name,)).fetchone()[0])

    def _remove_versions(self, name: str, versions: Iterable[int]) -> str:
        """Delete versions (the model too once it has none); the caller's transaction
        rolls everything back if any check fails."""
        refs = [Ref(name, v) for v in versions]
        for ref in refs:
            self._require_version(str(ref))
            self._refuse_if_used(ref)
            bound = [a.name for a in self.adapters() if a.base_ref == str(ref)]
            if bound:
                raise InUseError(f"{ref} is the base model of adapters: {', '.join(bound)}")
            self._db.execute(
                "DELETE FROM versions WHERE model = ? AND version = ?", (name, ref.version)
            )
        if not self._version_numbers(name):
            adapters = [a.name for a in self.adapters() if a.base_model == name]
            if adapters:
                raise InUseError(f"{name} is the base model of adapters: {', '.join(adapters)}")
            self._db.execute("DELETE FROM models WHERE name = ?", (name,))
        return ", ".join(map(str, refs)) or f"model {name}"

    def _refuse_if_used(self, ref: Ref) -> None:
        users = self.users(str(ref))
        if users:
            raise InUseError(f"{ref} is in use by running replicas: {', '.join(users)}")
        aliases = [a.name for a in self.aliases() if str(ref) in (a.target, a.canary)]
        if aliases:
            raise InUseError(f"{ref} is the target or canary of aliases: {', '.join(aliases)}")


def _check_choice(value: str, allowed: Sequence[str], what: str) -> None:
    if value not in allowed:
        raise RegistryError(f"{what} {value!r} is not allowed; allowed: {', '.join(allowed)}")


def _check_engine_args(args: Sequence[str]) -> list[str]:
    if isinstance(args, str) or not all(isinstance(a, str) for a in args):
        raise RegistryError(f"engine args must be a list of strings, got {args!r}")
    return list(args)


def _version_from_row(row: Sequence[Any]) -> ModelVersion:
    model, version, quant, source, args, _manifest, digest, total, created = row
    return ModelVersion(
        model, version, quant, source, tuple(json.loads(args)), digest, total, created
    )


def _adapter_from_row(row: Sequence[Any]) -> Adapter:
    name, base, rank, path, _manifest, digest, total, created, base_version = row
    return Adapter(name, base, rank, path, digest, total, created, base_version)


def _run_script(db: sqlite3.Connection, script: str) -> None:
    """Each statement on its own: executescript would commit the open transaction."""
    for statement in script.split(";"):
        if statement.strip():
            db.execute(statement)


def _alias_from_row(row: Sequence[Any]) -> Alias:
    name, model, version, c_model, c_version, percent, updated = row
    canary = f"{c_model}@{c_version}" if c_model is not None else None
    return Alias(name, f"{model}@{version}", canary, percent, updated)
