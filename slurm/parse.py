"""Parsers for what Slurm's command-line tools print (pure: text in, values out, no I/O).

The `--json` output changed shape between releases, so every field is read defensively:

- 22.05 (openapi/v0.0.38): `meta.Slurm.release`; `job_state` is a string ("PENDING");
  numbers are plain (`null` when unset or infinite); `time_limit` is in minutes.
- 23.02+ (data_parser/v0.0.39 ... v0.0.4x): `meta.slurm.release`; `job_state` is a list
  (base state first, then flags such as "COMPLETING"); most numbers are
  `{"set": bool, "infinite": bool, "number": N}` objects; `time_limit` still in minutes.

Node lists: 22.05's `scontrol` has no `--json`, so its nodes come from `sinfo --json`
(`{"nodes": [{"state": "idle", "state_flags": ["DRAIN"], ...}]}`); 23.02+ has
`scontrol show node --json` (`{"nodes": [{"state": ["IDLE", "DRAIN"], ...}]}`) and 23.11+
`sinfo --json` prints `{"sinfo": [...]}` entries; `parse_scontrol_show_node_json` reads all three.
"""

from __future__ import annotations

import enum
import json
import re
import time
from collections.abc import Mapping
from typing import Any

import msgspec

# The backfill scheduler plans an unlimited job as if it ran a year: 22.05 then reports
# time_limit 525600 (minutes) for jobs without --time in a MaxTime=INFINITE partition.
YEAR_MINUTES = 365 * 24 * 60
_MAX_HOSTS = 1_000_000
_SNIPPET = 200


class SlurmParseError(ValueError):
    """Slurm printed something this module cannot read; the message quotes a snippet of it."""


def _snippet(text: object) -> str:
    s = text if isinstance(text, str) else repr(text)
    return repr(s if len(s) <= _SNIPPET else s[:_SNIPPET] + "...")


class JobState(enum.StrEnum):
    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    SUSPENDED = "SUSPENDED"
    REQUEUED = "REQUEUED"
    UNKNOWN = "UNKNOWN"

    @property
    def is_active(self) -> bool:
        """The job holds or waits for resources (it is not finished)."""
        return self in _ACTIVE

    @classmethod
    def parse(cls, value: object) -> JobState:
        """A state from 22.05's string or 23.02+'s list of base state and flags.

        Like squeue's own state column, a COMPLETING/CONFIGURING/REQUEUED flag wins over
        the base state (a RUNNING job with the COMPLETING flag is shown as COMPLETING).
        Anything unrecognised is UNKNOWN.
        """
        if isinstance(value, str):
            names = [value]
        elif isinstance(value, list):
            names = [v for v in value if isinstance(v, str)]
        else:
            return cls.UNKNOWN
        names = [n.strip().upper() for n in names]
        for flag, state in _FLAG_STATES:
            if flag in names:
                return state
        for name in names:
            member = cls.__members__.get(name)
            if member is not None:
                return member
        return cls.UNKNOWN


_ACTIVE = frozenset(
    {
        JobState.PENDING,
        JobState.CONFIGURING,
        JobState.RUNNING,
        JobState.COMPLETING,
        JobState.SUSPENDED,
        JobState.REQUEUED,
    }
)
_FLAG_STATES = (
    ("COMPLETING", JobState.COMPLETING),
    ("CONFIGURING", JobState.CONFIGURING),
    ("REQUEUED", JobState.REQUEUED),
    ("REQUEUE_HOLD", JobState.REQUEUED),
    ("REQUEUE_FED", JobState.REQUEUED),
)


class SlurmJob(msgspec.Struct, frozen=True):
    job_id: int
    name: str
    state: JobState
    state_reason: str  # "None" when Slurm has no reason, e.g. "Resources", "JobHeldUser"
    nodes: list[str]  # expanded node names; empty while pending
    partition: str
    comment: str
    submit_time: int
    # For a pending job Slurm reports its expected start/end here (None while unknown).
    start_time: int | None
    time_limit_s: int | None  # None for unlimited
    end_time: int | None
    batch_host: str
    # The nodes it must run on (sbatch --nodelist), and Slurm's long form of state_reason
    # (e.g. "ReqNodeNotAvail, UnavailableNodes:n2"); empty when none.
    required_nodes: list[str] = []
    state_description: str = ""

    @property
    def is_active(self) -> bool:
        return self.state.is_active


class SqueueSnapshot(msgspec.Struct, frozen=True):
    release: str
    jobs: list[SlurmJob]


class SlurmNode(msgspec.Struct, frozen=True):
    name: str
    state: list[str]  # upper case, base state first: ["IDLE"], ["IDLE", "DRAIN"], ["DOWN"]
    reason: str
    gres: str  # e.g. "gpu:4"
    gres_used: str  # e.g. "gpu:1" (22.05) or "gpu:1(IDX:0)" (newer); "" if not reported
    cpus: int | None
    alloc_cpus: int | None
    partitions: list[str]

    @property
    def drained(self) -> bool:
        """Drained or draining: the scheduler puts nothing new on it."""
        return any(s in ("DRAIN", "DRAINED", "DRAINING") for s in self.state)

    @property
    def down(self) -> bool:
        return any(s in ("DOWN", "FAIL", "NOT_RESPONDING", "INVAL", "INVALID") for s in self.state)


# ---------------------------------------------------------------- small readers


def parse_sbatch_parsable(stdout: str) -> int:
    """The job id printed by `sbatch --parsable` ("123" or "123;cluster")."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    match = re.fullmatch(r"(\d+)(?:;[^\s;]+)?", lines[0]) if len(lines) == 1 else None
    if match is None:
        raise SlurmParseError(f"sbatch --parsable printed no job id: {_snippet(stdout)}")
    return int(match.group(1))


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist: "a1,b[1-3,5],c" -> [a1, b1, b2, b3, b5, c].

    Handles zero padding ("n[01-03]"), several bracket groups ("r[1-2]n[1-2]") and
    surrounding whitespace; order and duplicates are kept as written. Raises SlurmParseError.
    """
    text = hostlist.strip()
    if not text or text == "(null)":
        return []
    out: list[str] = []
    for token in _split_top_level(text, hostlist):
        out.extend(_expand_token(token, hostlist))
        if len(out) > _MAX_HOSTS:
            raise SlurmParseError(f"hostlist expands to too many names: {_snippet(hostlist)}")
    return out


def parse_scontrol_show_topology(text: str) -> dict[str, str]:
    """Node -> its leaf switch, from `scontrol show topology` (topology/tree), one line per
    switch as Slurm 22.05 to 25.x print it:

        SwitchName=s1 Level=0 LinkSpeed=1 Nodes=n[1-2]
        SwitchName=top Level=1 LinkSpeed=1 Nodes=n[1-4] Switches=s[1-2]

    A leaf switch is one of level 0 (without a Level: one without Switches below it); an
    upper switch lists its leaves' nodes too, and is not what a node hangs off. A node under
    two leaves (a site's config error) keeps the first. Lines of other plugins (topology/
    block's BlockName=...) and Slurm's notes carry no switch: {} when there is none at all,
    as where no topology plugin is configured ("No topology information available", on
    stderr). Raises SlurmParseError on a switch line it cannot read."""
    switches: dict[str, str] = {}
    for line in text.splitlines():
        words = line.split()
        if not words or not words[0].startswith("SwitchName="):
            continue
        fields: dict[str, str] = {}
        for word in words:
            key, sep, value = word.partition("=")
            if not sep:
                raise SlurmParseError(f"not key=value: {word!r} in topology line {_snippet(line)}")
            fields[key] = value
        name = fields["SwitchName"]
        level = fields.get("Level")
        below = fields.get("Switches", "(null)")
        leaf = level.strip() == "0" if level is not None else below in ("", "(null)")
        if not name or not leaf:
            continue
        for node in expand_hostlist(fields.get("Nodes", "")):
            switches.setdefault(node, name)
    return switches


def _split_top_level(text: str, whole: str) -> list[str]:
    tokens: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise SlurmParseError(f"nested '[' in hostlist: {_snippet(whole)}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmParseError(f"unbalanced ']' in hostlist: {_snippet(whole)}")
        if ch == "," and depth == 0:
            tokens.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise SlurmParseError(f"unbalanced '[' in hostlist: {_snippet(whole)}")
    tokens.append("".join(cur).strip())
    if any(not t for t in tokens):
        raise SlurmParseError(f"empty name in hostlist: {_snippet(whole)}")
    return tokens


def _expand_token(token: str, whole: str) -> list[str]:
    start = token.find("[")
    if start < 0:
        if "]" in token or any(c.isspace() for c in token):
            raise SlurmParseError(f"bad host name {token!r} in hostlist: {_snippet(whole)}")
        return [token]
    end = token.index("]", start)
    prefix, body, rest = token[:start], token[start + 1 : end], token[end + 1 :]
    if any(c.isspace() for c in prefix):
        raise SlurmParseError(f"bad host name {token!r} in hostlist: {_snippet(whole)}")
    suffixes = _expand_token(rest, whole) if rest else [""]
    out: list[str] = []
    for part in body.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if m is None:
            raise SlurmParseError(f"bad range {part!r} in hostlist: {_snippet(whole)}")
        lo_s, hi_s = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise SlurmParseError(f"descending range {part!r} in hostlist: {_snippet(whole)}")
        if (hi - lo + 1) * len(suffixes) > _MAX_HOSTS:
            raise SlurmParseError(f"hostlist expands to too many names: {_snippet(whole)}")
        width = len(lo_s)
        out.extend(f"{prefix}{i:0{width}d}{s}" for i in range(lo, hi + 1) for s in suffixes)
    return out


# ---------------------------------------------------------------- JSON helpers


def _load(text: str | bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except (ValueError, TypeError) as exc:
        raise SlurmParseError(f"{what} is not JSON ({exc}): {_snippet(text)}") from None
    if not isinstance(doc, dict):
        raise SlurmParseError(f"{what} is not a JSON object: {_snippet(text)}")
    errors = doc.get("errors") or []
    if errors:
        raise SlurmParseError(f"{what} reports errors: {_snippet(json.dumps(errors))}")
    return doc


def _num(value: object) -> int | None:
    """A number from a plain value or a {"set", "infinite", "number"} object; None if unset."""
    if isinstance(value, Mapping):
        if value.get("infinite") or not value.get("set", True):
            return None
        value = value.get("number")
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def _time(value: object) -> int | None:
    """A Unix time; 0 (Slurm's 'not set') becomes None."""
    n = _num(value)
    return n if n else None


def _str(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return ""


def parse_release(doc: Mapping[str, Any]) -> str:
    """The Slurm release from a --json document's meta (both spellings), or ""."""
    meta = doc.get("meta")
    if not isinstance(meta, Mapping):
        return ""
    for key in ("slurm", "Slurm"):
        info = meta.get(key)
        if not isinstance(info, Mapping):
            continue
        release = _str(info.get("release"))
        if release:
            return release
        version = info.get("version")
        if isinstance(version, Mapping):
            parts = [_str(version.get(k)) for k in ("major", "minor", "micro")]
            if all(parts):
                return f"{parts[0]}.{int(parts[1]):02d}.{parts[2]}"
    return ""


# ---------------------------------------------------------------- squeue


def _job_nodes(raw: Mapping[str, Any]) -> list[str]:
    value = raw.get("nodes")
    if isinstance(value, Mapping):  # defensive: some parsers nest it like job_resources.nodes
        value = value.get("list") or value.get("nodes") or ""
    return expand_hostlist(value) if isinstance(value, str) else []


def _comment(value: object) -> str:
    if isinstance(value, Mapping):  # slurmdb-style {"job": ..., "administrator": ...}
        return _str(value.get("job"))
    return _str(value)


def _parse_job(raw: object, index: int) -> SlurmJob:
    if not isinstance(raw, Mapping):
        raise SlurmParseError(f"squeue job #{index} is not an object: {_snippet(raw)}")
    job_id = _num(raw.get("job_id"))
    if job_id is None:
        raise SlurmParseError(f"squeue job #{index} has no job_id: {_snippet(json.dumps(raw))}")
    limit_min = _num(raw.get("time_limit"))
    return SlurmJob(
        job_id=job_id,
        name=_str(raw.get("name")),
        state=JobState.parse(raw.get("job_state")),
        state_reason=_str(raw.get("state_reason")) or "None",
        nodes=_job_nodes(raw),
        partition=_str(raw.get("partition")),
        comment=_comment(raw.get("comment")),
        submit_time=_time(raw.get("submit_time")) or 0,
        start_time=_time(raw.get("start_time")),
        time_limit_s=None if limit_min is None else limit_min * 60,
        end_time=_time(raw.get("end_time")),
        batch_host=_str(raw.get("batch_host")),
        required_nodes=expand_hostlist(_str(raw.get("required_nodes"))),
        state_description=_str(raw.get("state_description")),
    )


_UNAVAILABLE_NODES = re.compile(r"UnavailableNodes:(\S*)")


def unavailable_required_nodes(reason: str, description: str) -> list[str] | None:
    """What a pending job's reason says about its required nodes (sbatch --nodelist): the
    unavailable ones it names ("ReqNodeNotAvail, UnavailableNodes:n[1-2]"), [] when it says
    some are down or drained without naming them, None when it is not waiting for them.

    Seen on 22.05: a job pinned to a drained or down node has reason "ReqNodeNotAvail" and
    description "ReqNodeNotAvail, UnavailableNodes:n2"; before the scheduler's next pass,
    reason "Resources" with description "Nodes required for job are DOWN, DRAINED or
    reserved for jobs in higher priority partitions" (the reservation case cannot be told
    apart here: the caller checks the node states)."""
    match = _UNAVAILABLE_NODES.search(description)
    if match is not None:
        return expand_hostlist(match.group(1).rstrip(",)"))
    if reason.startswith("ReqNodeNotAvail") or description.startswith("Nodes required for job"):
        return []
    return None


# Pending reasons of a job that waits for nodes: busy ones (Resources: not enough free now;
# Priority: jobs ahead of it will take them). Other reasons (BeginTime, Dependency, JobHeld*,
# QOS and association limits) would hold the job wherever it were allowed to run.
_WAITS_FOR_BUSY_NODES = ("Resources", "Priority")


def waits_for_nodes(reason: str, description: str) -> bool:
    """Whether a pending job's reason says it waits for nodes, busy or unavailable: for a
    job pinned with --nodelist, a wait for its pin."""
    return (
        reason in _WAITS_FOR_BUSY_NODES
        or unavailable_required_nodes(reason, description) is not None
    )


def parse_squeue_json(text: str | bytes) -> SqueueSnapshot:
    """`squeue --json` of any release -> SqueueSnapshot (every job Slurm still remembers)."""
    doc = _load(text, "squeue --json output")
    jobs = doc.get("jobs")
    if not isinstance(jobs, list):
        raise SlurmParseError(f"squeue --json output has no 'jobs' list: {_snippet(text)}")
    return SqueueSnapshot(
        release=parse_release(doc), jobs=[_parse_job(j, i) for i, j in enumerate(jobs)]
    )


# ---------------------------------------------------------------- nodes


def _node_state(raw: Mapping[str, Any]) -> list[str]:
    state = raw.get("state")
    if isinstance(state, list):  # 23.02+
        names = [_str(s).upper() for s in state]
    else:  # 22.05 sinfo: "idle" + state_flags ["DRAIN"]
        names = [_str(state).upper()]
        flags = raw.get("state_flags")
        if isinstance(flags, list):
            names += [_str(f).upper() for f in flags]
    return [n for n in names if n]


def _parse_node(raw: object, index: int) -> SlurmNode:
    if not isinstance(raw, Mapping) or not _str(raw.get("name")):
        raise SlurmParseError(f"node #{index} has no name: {_snippet(raw)}")
    parts = raw.get("partitions")
    return SlurmNode(
        name=_str(raw.get("name")),
        state=_node_state(raw),
        reason=_str(raw.get("reason")),
        gres=_str(raw.get("gres")),
        gres_used=_str(raw.get("gres_used")),
        cpus=_num(raw.get("cpus")),
        alloc_cpus=_num(raw.get("alloc_cpus")),
        partitions=[_str(p) for p in parts] if isinstance(parts, list) else [],
    )


def _parse_sinfo_entry(raw: object, index: int) -> list[SlurmNode]:
    """One 23.11+ `sinfo --json` entry (a group of nodes of one partition)."""
    if not isinstance(raw, Mapping):
        raise SlurmParseError(f"sinfo entry #{index} is not an object: {_snippet(raw)}")
    nodes = raw.get("nodes")
    names = nodes.get("nodes") if isinstance(nodes, Mapping) else None
    if not isinstance(names, list):
        raise SlurmParseError(f"sinfo entry #{index} has no node names: {_snippet(raw)}")
    node, cpus = _object_at(raw, "node"), _object_at(raw, "cpus")
    gres, partition = _object_at(raw, "gres"), _object_at(raw, "partition")
    state = node.get("state")
    total_nodes = max(len(names), 1)
    return [
        SlurmNode(
            name=_str(name),
            state=[_str(s).upper() for s in state] if isinstance(state, list) else [],
            reason=_str(raw.get("reason")),
            gres=_str(gres.get("total")),
            gres_used=_str(gres.get("used")),
            cpus=_num(cpus.get("maximum")),
            alloc_cpus=None if total_nodes > 1 else _num(cpus.get("allocated")),
            partitions=[_str(partition.get("name"))] if partition.get("name") else [],
        )
        for name in names
    ]


def parse_scontrol_show_node_json(text: str | bytes) -> list[SlurmNode]:
    """Nodes from `scontrol show node --json` (23.02+) or `sinfo --json` (22.05, 23.11+)."""
    doc = _load(text, "node --json output")
    if isinstance(doc.get("nodes"), list):
        return [_parse_node(n, i) for i, n in enumerate(doc["nodes"])]
    if isinstance(doc.get("sinfo"), list):
        merged: dict[str, SlurmNode] = {}
        for i, entry in enumerate(doc["sinfo"]):
            for node in _parse_sinfo_entry(entry, i):
                seen = merged.get(node.name)
                if seen is not None:
                    parts = seen.partitions + [
                        p for p in node.partitions if p not in seen.partitions
                    ]
                    node = msgspec.structs.replace(seen, partitions=parts)
                merged[node.name] = node
        return list(merged.values())
    raise SlurmParseError(f"node --json output has no 'nodes' or 'sinfo' list: {_snippet(text)}")


# ---------------------------------------------------------------- sacct

# The columns SlurmCLI.accounting asks sacct for (`--parsable2 --noheader`), in this order;
# JobName last, so a "|" in a job's name cannot shift the others.
SACCT_FIELDS = ("JobIDRaw", "Partition", "State", "Start", "End", "AllocTRES", "NNodes", "JobName")
_UNSET_TIMES = {"", "unknown", "none", "n/a"}


class AccountedJob(msgspec.Struct, frozen=True):
    """One job allocation as Slurm's accounting (slurmdbd) recorded it."""

    job_id: int
    name: str
    partition: str
    state: JobState
    start: int | None  # Unix time; None: it never started
    end: int | None  # None: still running
    gpus: int | None  # allocated GPUs (AllocTRES gres/gpu); None: not tracked as a TRES
    nodes: int


def _sacct_time(value: str, line: str) -> int | None:
    """A time as sacct prints it: Unix seconds (SLURM_TIME_FORMAT=%s, which the client
    sets), else ISO 8601 local time (Slurm's default format); Unknown/None: unset."""
    value = value.strip()
    if value.lower() in _UNSET_TIMES:
        return None
    if value.isdigit():
        return int(value) or None
    try:
        return int(time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        raise SlurmParseError(
            f"sacct time {value!r} is unreadable in line {_snippet(line)}"
        ) from None


def alloc_gpus(tres: str) -> int | None:
    """GPUs in an AllocTRES string: `gres/gpu=N`, else the sum of typed `gres/gpu:TYPE=N`
    (Slurm lists both when GPUs have types); None when the TRES has no GPU entry (the site's
    AccountingStorageTRES lacks gres/gpu) or the string is empty."""
    total, typed, seen = None, 0, False
    for part in tres.split(","):
        key, _, count = part.strip().partition("=")
        if not count.strip().isdigit():
            continue
        if key == "gres/gpu":
            total = int(count)
        elif key.startswith("gres/gpu:"):
            typed += int(count)
            seen = True
    if total is not None:
        return total
    return typed if seen else None


def parse_sacct(text: str) -> list[AccountedJob]:
    """`sacct --parsable2 --noheader --format=<SACCT_FIELDS>` output -> jobs (steps skipped:
    the client passes --allocations, and an id like 123.batch is dropped here too)."""
    jobs = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|", len(SACCT_FIELDS) - 1)
        if len(parts) != len(SACCT_FIELDS):
            raise SlurmParseError(
                f"sacct line has {len(parts)} fields, not {len(SACCT_FIELDS)}: {_snippet(line)}"
            )
        job_id, partition, state, start, end, tres, nodes, name = parts
        if not job_id.strip().isdigit():
            if "." in job_id or "_" in job_id:  # a step, or an array task's other form
                continue
            raise SlurmParseError(f"sacct job id {job_id!r} is not a number: {_snippet(line)}")
        jobs.append(
            AccountedJob(
                job_id=int(job_id),
                name=name,
                partition=partition.strip(),
                # "CANCELLED by 0": the state is the first word
                state=JobState.parse((state.split() or ["UNKNOWN"])[0]),
                start=_sacct_time(start, line),
                end=_sacct_time(end, line),
                gpus=alloc_gpus(tres),
                nodes=int(nodes) if nodes.strip().isdigit() else 0,
            )
        )
    return jobs


__all__ = [
    "SACCT_FIELDS",
    "YEAR_MINUTES",
    "AccountedJob",
    "JobState",
    "SlurmJob",
    "SlurmNode",
    "SlurmParseError",
    "SqueueSnapshot",
    "alloc_gpus",
    "expand_hostlist",
    "parse_release",
    "parse_sacct",
    "parse_sbatch_parsable",
    "parse_scontrol_show_node_json",
    "parse_scontrol_show_topology",
    "parse_squeue_json",
]


def _object_at(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """raw[key] when it is an object, else an empty one."""
    value = raw.get(key)
    return value if isinstance(value, Mapping) else {}
