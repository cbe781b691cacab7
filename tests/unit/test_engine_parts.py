import pytest

from hpcserve.engine_launch.load import parse_vllm_load
from hpcserve.engine_launch.topology import topology_from_env
from hpcserve.engine_launch.vllm_args import EngineSpec, vllm_argv, vllm_env
from hpcserve.router.protocol import ReplicaLoad

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:num_requests_running_total_nonsense 99
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 384.0
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (VLLM_METRICS, ReplicaLoad(running=3, waiting=3, kv_usage=0.25)),
        ("", ReplicaLoad()),
        ("vllm:num_requests_running garbage\n", ReplicaLoad()),
        ("vllm:num_requests_running 4\n", ReplicaLoad(running=4)),
    ],
)
def test_parse_vllm_load(text, expected):
    assert parse_vllm_load(text) == expected


def spec(**kw):
    base = dict(
        model_path="/m",
        served_model_name="tiny",
        engine="vllm-cpu",
        python="/py",
        bind_host="127.0.0.1",
        port=8123,
    )
    return EngineSpec(**(base | kw))


def test_vllm_argv_single_gpu():
    assert vllm_argv(spec(extra_args=("--dtype", "float32"))) == [
        "/py",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/m",
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "--shutdown-timeout",
        "30",
        "--disable-uvicorn-access-log",
        "--dtype",
        "float32",
    ]


def test_vllm_argv_parallel_and_env():
    argv = vllm_argv(spec(tensor_parallel=2, pipeline_parallel=2))
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "2"
    env = vllm_env(spec(tensor_parallel=2), {"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"  # the pool's own setting wins
    assert env["HF_HUB_OFFLINE"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_env(spec(engine="vllm"), {})


def test_topology_from_slurm_env():
    topo = topology_from_env(
        {
            "SLURM_JOB_ID": "77",
            "SLURMD_NODENAME": "n2",
            "SLURM_JOB_NODELIST": "n[2-3]",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_NODEID": "1",
        }
    )
    assert (topo.job_id, topo.node, topo.nodelist, topo.num_nodes, topo.node_rank) == (
        77,
        "n2",
        "n[2-3]",
        2,
        1,
    )
    assert topo.in_slurm
    outside = topology_from_env({"SLURM_JOB_ID": "garbage"})
    assert outside.job_id == 0 and not outside.in_slurm
