"""Render a job script from slurm_templates/ for one replica of a pool (pure).

A replica on one node uses engine.sbatch, a replica across several nodes
engine-multinode.sbatch (one `srun` task per node). Both are scripts an admin can
run by hand, and both render the same way: their #SBATCH lines are replaced and
their settings block filled with shell-quoted assignments, so the rendered script
reads like the template with values written in.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from importlib import resources

TEMPLATE_NAME = "engine.sbatch"
MULTINODE_TEMPLATE_NAME = "engine-multinode.sbatch"
_SETTINGS_START = "# @settings"
_SETTINGS_END = "# @end settings"
# Values on #SBATCH lines are parsed by sbatch, not by a shell: allow no spaces or quotes there.
_SBATCH_SAFE = re.compile(r"^[A-Za-z0-9_.:;@%/,=+-]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class RenderError(ValueError):
    pass


@dataclass(frozen=True)
class JobSpec:
    job_name: str
    comment: str
    gpus: int  # per node
    time_limit_min: int
    drain_s: int
    hpcserve_bin: str
    model_path: str
    model: str
    router: str
    pool: str
    engine: str
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    bind_host: str = "0.0.0.0"
    advertise_host: str = ""
    heartbeat_s: float = 2.0
    cache_dir: str = ""
    manifest: str = ""
    model_ref: str = ""
    partition: str = ""
    account: str = ""
    qos: str = ""
    output: str = ""
    engine_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    extra_sbatch: tuple[str, ...] = field(default_factory=tuple)
    nodes: int = 1
    # argv the engine starts under (a container), and environment modules loaded first.
    launch_prefix: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()

    @property
    def template_name(self) -> str:
        return TEMPLATE_NAME if self.nodes == 1 else MULTINODE_TEMPLATE_NAME


def load_template(name: str = TEMPLATE_NAME) -> str:
    return resources.files("hpcserve.slurm_templates").joinpath(name).read_text()


def _sbatch_line(option: str, value: object) -> str:
    text = str(value)
    if not _SBATCH_SAFE.match(text):
        raise RenderError(f"#SBATCH --{option}: {text!r} has characters sbatch cannot take here")
    return f"#SBATCH --{option}={text}"


def sbatch_lines(spec: JobSpec) -> list[str]:
    if spec.nodes < 1:
        raise RenderError(f"nodes: {spec.nodes}; expected at least 1")
    lines = [
        _sbatch_line("job-name", spec.job_name),
        _sbatch_line("comment", spec.comment),
        _sbatch_line("nodes", spec.nodes),
        # One task: the engine; on several nodes, one per node (srun starts them).
        _sbatch_line("ntasks", 1) if spec.nodes == 1 else _sbatch_line("ntasks-per-node", 1),
    ]
    if spec.gpus > 0:
        lines.append(_sbatch_line("gres", f"gpu:{spec.gpus}"))
    lines += [
        _sbatch_line("time", spec.time_limit_min),
        _sbatch_line("signal", f"B:USR1@{spec.drain_s}"),
    ]
    for option, value in (
        ("partition", spec.partition),
        ("account", spec.account),
        ("qos", spec.qos),
        ("output", spec.output),
    ):
        if value:
            lines.append(_sbatch_line(option, value))
    for arg in spec.extra_sbatch:
        if not arg.startswith("--") or not _SBATCH_SAFE.match(arg[2:]):
            raise RenderError(f"extra sbatch argument {arg!r}: expected --option=value, no spaces")
        lines.append(f"#SBATCH {arg}")
    return lines


def settings_lines(spec: JobSpec) -> list[str]:
    values = {
        "HPCSERVE_BIN": spec.hpcserve_bin,
        "HPCSERVE_MODEL_PATH": spec.model_path,
        "HPCSERVE_MODEL": spec.model,
        "HPCSERVE_ROUTER": spec.router,
        "HPCSERVE_POOL": spec.pool,
        "HPCSERVE_ENGINE": spec.engine,
        "HPCSERVE_TP": str(spec.tensor_parallel),
        "HPCSERVE_PP": str(spec.pipeline_parallel),
        "HPCSERVE_DRAIN_S": str(spec.drain_s),
        "HPCSERVE_HEARTBEAT_S": f"{spec.heartbeat_s:g}",
        "HPCSERVE_BIND_HOST": spec.bind_host,
        "HPCSERVE_ADVERTISE_HOST": spec.advertise_host,
    }
    if spec.manifest:
        values |= {
            "HPCSERVE_CACHE_DIR": spec.cache_dir,
            "HPCSERVE_MANIFEST": spec.manifest,
            "HPCSERVE_MODEL_REF": spec.model_ref,
        }
    lines = [f"{name}={shlex.quote(value)}" for name, value in values.items()]
    lines.append(
        "HPCSERVE_ENGINE_ARGS=(" + " ".join(shlex.quote(a) for a in spec.engine_args) + ")"
    )
    for name, words in (("MODULES", spec.modules), ("LAUNCH_PREFIX", spec.launch_prefix)):
        if words:
            lines.append(f"HPCSERVE_{name}=(" + " ".join(shlex.quote(w) for w in words) + ")")
    for name, value in spec.env:
        if not _ENV_NAME.match(name):
            raise RenderError(f"environment variable name {name!r} is not a valid shell name")
        lines.append(f"export {name}={shlex.quote(value)}")
    return lines


def render(spec: JobSpec, template: str | None = None) -> str:
    text = template if template is not None else load_template(spec.template_name)
    out: list[str] = []
    sbatch_done = False
    in_settings = False
    for line in text.splitlines():
        if line.startswith("#SBATCH"):
            if not sbatch_done:
                out += sbatch_lines(spec)
                sbatch_done = True
            continue
        if line.startswith(_SETTINGS_START):
            out.append(line)
            out += settings_lines(spec)
            in_settings = True
            continue
        if line.startswith(_SETTINGS_END):
            in_settings = False
        if not in_settings:
            out.append(line)
    if not sbatch_done or _SETTINGS_START not in text or _SETTINGS_END not in text:
        raise RenderError(
            f"template {spec.template_name} lacks #SBATCH lines or the settings markers"
        )
    return "\n".join(out) + "\n"
