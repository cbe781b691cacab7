import os
import subprocess
from pathlib import Path

import pytest

from hpcserve.poolmgr.render import JobSpec, RenderError, load_template, render

GOLDEN = Path(__file__).parent / "data" / "golden" / "engine.sbatch"

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


def test_rendered_script_matches_golden_file():
    text = render(SPEC)
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_rendered_values_reach_the_engine_verbatim(tmp_path):
    # Run the settings block in bash and print what the engine command would receive.
    text = render(SPEC)
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


def test_template_is_runnable_by_hand_and_names_what_is_missing(tmp_path):
    script = tmp_path / "engine.sbatch"
    script.write_text(load_template())
    out = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, env={"PATH": os.environ["PATH"]}
    )
    assert out.returncode != 0
    assert "set HPCSERVE_MODEL_PATH to the model directory" in out.stderr


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
