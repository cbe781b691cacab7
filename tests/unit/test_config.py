import pytest

from hpcserve.config import ConfigError, dump_config, load_config, parse_config

POOL = {"name": "chat", "model_path": "/models/llama"}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"pools": [{**POOL, "replicas": -1}]}, "pools[0].replicas: expected `int` >= 0, got -1"),
        ({"pools": [{**POOL, "replicas": "two"}]}, "pools[0].replicas: expected `int`, got `str`"),
        (
            {"pools": [{**POOL, "engine": "tgi"}]},
            "pools[0].engine: invalid enum value 'tgi'; allowed: vllm, vllm-cpu, sim",
        ),
        ({"pools": [{"name": "chat"}]}, "pools[0]: set exactly one of model_path"),
        ({"pools": [{**POOL, "model_ref": "llama@1"}]}, "pools[0]: set exactly one of model_path"),
        (
            {"pools": [{"name": "chat", "model_ref": "llama@1"}]},
            "pools[0].model_ref: 'llama@1' needs engine.cache_dir",
        ),
        ({"pools": [{"model_path": "/m"}]}, "pools[0]: object missing required field `name`"),
        ({"pools": [{**POOL, "name": "bad name"}]}, "pools[0].name: expected `str` matching"),
        ({"routr": {}}, "(top level): object contains unknown field `routr`"),
        ({"pools": [POOL, POOL]}, "pools[1].name: 'chat' is used by an earlier pool"),
        (
            {"pools": [{**POOL, "tensor_parallel": 4, "gpus_per_replica": 2}]},
            "pools[0].gpus_per_replica: 2 x nodes_per_replica 1 = 2 GPU(s), but "
            "tensor_parallel x pipeline_parallel = 4 x 1 = 4; engine 'vllm' needs them equal",
        ),
        (
            {"pools": [{**POOL, "tensor_parallel": 2, "gpus_per_replica": 4}]},
            "pools[0].gpus_per_replica: 4 x nodes_per_replica 1 = 4 GPU(s), but "
            "tensor_parallel x pipeline_parallel = 2 x 1 = 2",
        ),
        (
            {
                "pools": [
                    {**POOL, "nodes_per_replica": 2, "gpus_per_replica": 4, "tensor_parallel": 4}
                ]
            },
            "pools[0].gpus_per_replica: 4 x nodes_per_replica 2 = 8 GPU(s), but "
            "tensor_parallel x pipeline_parallel = 4 x 1 = 4",
        ),
        (
            {"pools": [{**POOL, "nodes_per_replica": 0}]},
            "pools[0].nodes_per_replica: expected `int` >= 1, got 0",
        ),
        (
            {
                "pools": [
                    {**POOL, "engine": "vllm-cpu", "nodes_per_replica": 2, "tensor_parallel": 3}
                ]
            },
            "pools[0].nodes_per_replica: 2 does not divide tensor_parallel x pipeline_parallel = 3",
        ),
        (
            {"pools": [{**POOL, "engine": "sim", "tensor_parallel": 2}]},
            "pools[0].gpus_per_replica: 1 x nodes_per_replica 1 = 1 is fewer than "
            "tensor_parallel x pipeline_parallel = 2",
        ),
        (
            {
                "poolmgr": {"launcher": "local"},
                "pools": [
                    {**POOL, "engine": "vllm-cpu", "nodes_per_replica": 2, "tensor_parallel": 2}
                ],
            },
            "pools[0].nodes_per_replica: 2 needs poolmgr.launcher = 'slurm'",
        ),
        ({"router": {"lease_s": 3, "heartbeat_s": 2}}, "router.lease_s: 3.0 must be at least"),
        (
            {"pools": [POOL, {**POOL, "name": "chat2", "served_model_name": "chat"}]},
            "pools: model 'chat' is served by two pools",
        ),
    ],
)
def test_bad_config_names_key_value_and_rule(data, message):
    with pytest.raises(ConfigError) as err:
        parse_config(data, source="site.toml")
    text = str(err.value).replace("`", "")
    assert text.startswith("site.toml: ")
    assert message.replace("`", "") in text


@pytest.mark.parametrize(
    "pool",
    [
        {
            "nodes_per_replica": 2,
            "gpus_per_replica": 4,
            "tensor_parallel": 4,
            "pipeline_parallel": 2,
        },
        {"nodes_per_replica": 2, "gpus_per_replica": 1, "pipeline_parallel": 2},
        {"nodes_per_replica": 2, "engine": "vllm-cpu", "tensor_parallel": 2},
        {"nodes_per_replica": 2, "engine": "sim", "gpus_per_replica": 1, "tensor_parallel": 2},
        {"engine": "vllm-cpu", "gpus_per_replica": 0, "tensor_parallel": 2},
    ],
)
def test_multinode_pools_that_fit(pool):
    cfg = parse_config({"pools": [{**POOL, **pool}]})
    assert cfg.pools[0].nodes_per_replica == pool.get("nodes_per_replica", 1)


def test_defaults_and_model_name():
    cfg = parse_config({"pools": [POOL, {**POOL, "name": "b", "served_model_name": "llama-b"}]})
    assert cfg.pools[0].model == "chat" and cfg.pools[1].model == "llama-b"
    assert cfg.pools[0].nodes_per_replica == 1
    assert cfg.router.engines_dial() == cfg.router.registry_bind
    assert cfg.pool("b").name == "b"
    with pytest.raises(ConfigError, match="unknown pool 'zz'; pools: chat, b"):
        cfg.pool("zz")


def test_dump_and_load_round_trip(tmp_path):
    cfg = parse_config(
        {
            "gateway": {"api_keys": [{"tenant": "t", "sha256": "a" * 64}]},
            "slurm": {"extra_args": ["--exclusive"]},
            "pools": [{**POOL, "env": {"VLLM_X": "1"}, "engine_args": ["--max-model-len", "1024"]}],
        }
    )
    path = tmp_path / "hpcserve.toml"
    path.write_text(dump_config(cfg))
    loaded = load_config(path)
    assert loaded.pools == cfg.pools and loaded.gateway == cfg.gateway
    assert loaded.slurm == cfg.slurm
    # A relative state_dir is resolved against the config file's folder.
    assert loaded.state_dir == str(tmp_path / ".state")


def test_unreadable_and_invalid_toml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("pools = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
