"""Reading systemd unit files in tests: what systemd would run (ExecStart, Environment,
User), for running the services without a systemd as PID 1."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path


def parse_unit(text: str, instance: str = "") -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (repeated keys such as Environment= keep every value);
    `%i` becomes the instance, `%%` a percent sign; comments and blank lines dropped."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        value = value.replace("%i", instance).replace("%%", "%")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


@dataclass(frozen=True)
class ServiceCommand:
    argv: list[str]
    env: dict[str, str]
    user: str
    unit: dict[str, dict[str, list[str]]]

    def one(self, key: str) -> str:
        [value] = self.unit["Service"][key]
        return value


def service_command(path: Path, instance: str = "") -> ServiceCommand:
    """The unit's ExecStart as an argv, its Environment= assignments and its User."""
    unit = parse_unit(path.read_text(), instance)
    service = unit["Service"]
    [exec_start] = service["ExecStart"]
    env: dict[str, str] = {}
    for value in service.get("Environment", []):
        for assignment in shlex.split(value):
            name, _, setting = assignment.partition("=")
            env[name] = setting
    [user] = service["User"]
    return ServiceCommand(shlex.split(exec_start), env, user, unit)
