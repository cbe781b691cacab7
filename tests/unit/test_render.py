import os
import subprocess
from pathlib import Path

import pytest

from hpcserve.poolmgr.render import (
    MULTINODE_TEMPLATE_NAME,
    TEMPLATE_NAME,
    JobSpec,
    RenderError,
    load_template,
    render,
)

GOLDEN_DIR = Path(__file__).parent / "data" / "golden"
GOLDEN = GOLDEN_DIR / "engine.sbatch"
GOLDEN_MULTINODE = GOLDEN_DIR / "engine-multinode.sbatch"

SPEC = JobSpec(
    job_name="hpcserve-chat",
    comment="hpcserve:pool=chat;model=llama-8b;nonce=0a1b2c3d",
    gpus=2,
    time_limit_min=720,
    drain_s=90,
    hpcserve_bin="/opt/hpcserve/venv/bin/hpcserve",
    model_path="/lustre/models/Llama 3.1 8B",  # a space: must survive quoting
    model="llama-8b",
    router="tcp://ctl:5560",
    pool="chat",
    engine="vllm",
    tensor_parallel=2,
    partition="gpu",
    account="ai-team",
    output="/var/log/hpcserve/%x-%j.out",
    engine_args=("--max-model-len", "8192", "--chat-template", "$(rm -rf /)"),
    env=(("VLLM_LOGGING_LEVEL", "INFO"), ("SITE_NOTE", "it's; `quoted`")),
)


# Two nodes of 4 GPUs, TP 4 x PP 2: engine-multinode.sbatch.
MULTINODE_SPEC = JobSpec(
    **(SPEC.__dict__ | {"nodes": 2, "gpus": 4, "tensor_parallel": 4, "pipeline_parallel": 2})
)


@pytest.mark.parametrize(("spec", "golden"), [(SPEC, GOLDEN), (MULTINODE_SPEC, GOLDEN_MULTINODE)])
def test_rendered_script_matches_golden_file(spec, golden):
    text = render(spec)
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


def test_template_follows_the_node_count():
    assert SPEC.template_name == TEMPLATE_NAME
    assert MULTINODE_SPEC.template_name == MULTINODE_TEMPLATE_NAME
    single, multi = render(SPEC), render(MULTINODE_SPEC)
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks=1\n#SBATCH --gres=gpu:2\n" in single
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gres=gpu:4\n" in multi
    for text in (single, multi):
        assert "#SBATCH --signal=B:USR1@90\n" in text  # the drain window, for the batch shell
    assert "srun " in multi and "srun " not in single
    with pytest.raises(RenderError, match="nodes: 0"):
        render(JobSpec(**(SPEC.__dict__ | {"nodes": 0})))


@pytest.mark.parametrize("name", [TEMPLATE_NAME, MULTINODE_TEMPLATE_NAME])
def test_templates_and_rendered_scripts_are_valid_bash(tmp_path, name):
    spec = SPEC if name == TEMPLATE_NAME else MULTINODE_SPEC
    for label, text in (("template", load_template(name)), ("rendered", render(spec))):
        script = tmp_path / f"{label}-{name}"
        script.write_text(text)
        out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, (label, out.stderr)


@pytest.mark.parametrize("spec", [SPEC, MULTINODE_SPEC])
def test_rendered_values_reach_the_engine_verbatim(tmp_path, spec):
    # Run the settings block in bash and print what the engine command would receive.
    text = render(spec)
    settings = text.split("# @settings", 1)[1].split("# @end settings", 1)[0]
    script = tmp_path / "probe.sh"
    script.write_text(
        settings.split("\n", 1)[1]
        + 'printf "%s\\n" "$HPCSERVE_MODEL_PATH" "${HPCSERVE_ENGINE_ARGS[@]}" '
        '"$SITE_NOTE"\n'
    )
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [
        "/lustre/models/Llama 3.1 8B",
        "--max-model-len",
        "8192",
        "--chat-template",
        "$(rm -rf /)",
        "it's; `quoted`",
    ]


@pytest.mark.parametrize("name", [TEMPLATE_NAME, MULTINODE_TEMPLATE_NAME])
def test_template_is_runnable_by_hand_and_names_what_is_missing(tmp_path, name):
    script = tmp_path / name
    script.write_text(load_template(name))
    out = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, env={"PATH": os.environ["PATH"]}
    )
    assert out.returncode != 0
    assert "set HPCSERVE_MODEL_PATH to the model directory" in out.stderr


def test_multinode_template_outside_sbatch_says_so(tmp_path):
    script = tmp_path / MULTINODE_TEMPLATE_NAME
    script.write_text(load_template(MULTINODE_TEMPLATE_NAME))
    env = {
        "PATH": os.environ["PATH"],
        "HPCSERVE_MODEL_PATH": "/m",
        "HPCSERVE_MODEL": "m",
        "HPCSERVE_ROUTER": "tcp://h:1",
    }
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    assert out.returncode != 0
    assert "submit this script with sbatch (SLURM_JOB_NUM_NODES is not set)" in out.stderr


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"partition": "gpu part"}, "#SBATCH --partition: 'gpu part'"),
        ({"job_name": "a\nb"}, "#SBATCH --job-name"),
        ({"env": (("BAD-NAME", "x"),)}, "environment variable name 'BAD-NAME'"),
    ],
)
def test_unsafe_values_are_refused(change, message):
    with pytest.raises(RenderError, match=message):
        render(JobSpec(**(SPEC.__dict__ | change)))


def test_template_without_markers_is_refused():
    with pytest.raises(RenderError, match="settings markers"):
        render(SPEC, template="#!/bin/bash\n#SBATCH --nodes=1\necho hi\n")
