"""vLLM is started with KV-cache events and prefix caching; registration says where."""

from __future__ import annotations

import json

from hpcserve.contracts.engine_args import engine_block_size
from hpcserve.engine_launch.vllm_args import EngineSpec, block_size, vllm_argv


def spec(**kw):
    base = dict(
        model_path="/m", served_model_name="m", engine="vllm-cpu", python="py",
        bind_host="0.0.0.0", port=8000,
    )  # fmt: skip
    return EngineSpec(**{**base, **kw})


def config_of(argv):
    return json.loads(argv[argv.index("--kv-events-config") + 1])


def test_kv_events_publisher_binds_ipc_in_the_private_directory_with_replay_and_topic():
    argv = vllm_argv(spec(kv_events_dir="/tmp/hpcserve-kv-x", kv_events_topic="r-1"))
    assert "--enable-prefix-caching" not in argv  # default on; forcing it breaks BERT pools
    # Never tcp: any user of the node reaches a TCP port, loopback included.
    assert config_of(argv) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "ipc:///tmp/hpcserve-kv-x/events",
        "replay_endpoint": "ipc:///tmp/hpcserve-kv-x/replay",
        "topic": "r-1",
    }


def test_no_events_without_a_directory_or_when_the_user_configured_them():
    assert "--kv-events-config" not in vllm_argv(spec())
    own = ["--kv-events-config", '{"enable_kv_cache_events": false}']
    argv = vllm_argv(spec(kv_events_dir="/tmp/kv", extra_args=own))
    assert argv.count("--kv-events-config") == 1 and config_of(argv) == {
        "enable_kv_cache_events": False
    }


def test_block_size_from_the_arguments_or_the_engine_default():
    assert block_size(spec()) == 128
    assert block_size(spec(engine="vllm")) == 16
    assert block_size(spec(engine="sim")) == 16  # the simulator models a GPU
    assert block_size(spec(extra_args=["--block-size", "32"])) == 32
    assert engine_block_size("vllm", ["--block-size=64"]) == 64


def test_vllms_own_sockets_and_temporary_files_go_to_the_private_directory():
    from hpcserve.engine_launch.vllm_args import vllm_env

    env = vllm_env(spec(runtime_dir="/tmp/hpcserve-kv-1-x"), {"TMPDIR": "/scratch/job"})
    # Not /tmp, where vLLM's ipc:// sockets take the umask's mode.
    assert env["VLLM_RPC_BASE_PATH"] == env["TMPDIR"] == "/tmp/hpcserve-kv-1-x"
    # torch's compiled kernels stay where torch keeps them, across starts.
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith("/tmp/torchinductor_")
    own = {"TORCHINDUCTOR_CACHE_DIR": "/site/inductor"}
    assert vllm_env(spec(runtime_dir="/tmp/d"), own)["TORCHINDUCTOR_CACHE_DIR"] == "/site/inductor"
    assert "VLLM_RPC_BASE_PATH" not in vllm_env(spec(), {})
