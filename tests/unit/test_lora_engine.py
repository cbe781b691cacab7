"""Multi-LoRA on the engine side: vLLM flags and environment, the pool's LoRA plan written by
the pool manager and read by the engine, adapters staged into the node cache verified, and
the pool config's LoRA keys checked."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from hpcserve.config import ConfigError, parse_config
from hpcserve.engine_launch.lora import LoraPlan, read_plan, stage_adapter
from hpcserve.engine_launch.vllm_args import EngineSpec, lora_args, vllm_argv, vllm_env
from hpcserve.modelcache.errors import CacheError
from hpcserve.modelcache.manifest import build_manifest
from hpcserve.modelcache.registry import Registry
from hpcserve.poolmgr.spec import build_job_spec, resolve_model
from hpcserve.tinymodels import make_tiny_model


def spec(**kw: object) -> EngineSpec:
    base: dict[str, object] = dict(
        model_path="/m", served_model_name="chat", engine="vllm-cpu", python="py",
        bind_host="127.0.0.1", port=8000,
    )  # fmt: skip
    return EngineSpec(**(base | kw))  # type: ignore[arg-type]


def test_lora_flags_and_runtime_updating_only_when_on() -> None:
    off = spec()
    assert lora_args(off) == []
    assert "--enable-lora" not in vllm_argv(off)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in vllm_env(off, {})
    on = spec(max_loras=2, max_lora_rank=8, lora_modules=(("a", "/c/a@1-x"), ("b", "/c/b@1-y")))
    argv = vllm_argv(on)
    i = argv.index("--enable-lora")
    assert argv[i : i + 8] == [
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", "a=/c/a@1-x", "b=/c/b@1-y",
    ]  # fmt: skip
    assert vllm_env(on, {})["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def config(tmp_path: Path, **pool: object) -> dict[str, object]:
    return {
        "state_dir": str(tmp_path / "state"),
        "engine": {"cache_dir": str(tmp_path / "cache")},
        "pools": [{"name": "chat", "model_ref": "llama@1", "engine": "vllm-cpu", **pool}],
    }


@pytest.mark.parametrize(
    ("pool", "engine", "message"),
    [
        ({"max_loras": 1, "lora_adapters": ["a", "b"]}, {}, "pools[0].max_loras: 1 is fewer"),
        ({"max_loras": 2, "model_ref": "", "model_path": "/m"}, {"cache_dir": ""}, "cache_dir"),
        ({"max_loras": 2, "engine": "sim"}, {}, "simulated engine has no LoRA"),
        (
            {"max_loras": 2, "nodes_per_replica": 2, "tensor_parallel": 2},
            {},
            "not supported for replicas across nodes",
        ),
        ({"max_loras": -1}, {}, "pools[0].max_loras"),
    ],
)
def test_lora_config_errors_name_the_key(
    tmp_path: Path, pool: dict[str, object], engine: dict[str, object], message: str
) -> None:
    data = config(tmp_path, **pool)
    data["engine"] = {**data["engine"], **engine}  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config(data)


@pytest.fixture
def registered(tmp_path: Path) -> tuple[Path, Path]:
    base = make_tiny_model("chat", tmp_path / "chat")
    adapter = make_tiny_model("lora", tmp_path / "docs-a", seed=1)
    registry = tmp_path / "state" / "registry.sqlite3"
    with Registry(registry) as reg:
        reg.add_version("llama", str(base), build_manifest(base))
        reg.add_adapter("docs-a", "llama", str(adapter), build_manifest(adapter), rank=8)
    return base, adapter


def test_the_pool_manager_writes_the_plan_and_the_job_gets_its_path(
    tmp_path: Path, registered: tuple[Path, Path]
) -> None:
    _, adapter = registered
    cfg = parse_config(config(tmp_path, max_loras=3, max_lora_rank=8, lora_adapters=["docs-a"]))
    model = resolve_model(cfg, cfg.pools[0])
    plan = read_plan(model.lora_plan)
    assert (plan.max_loras, plan.max_lora_rank) == (3, 8)
    (static,) = plan.adapters
    assert (static.name, static.source) == ("docs-a", str(adapter))
    job = build_job_spec(cfg, cfg.pools[0], model)
    assert ("HPCSERVE_LORA_PLAN", model.lora_plan) in job.env
    # Same plan, same file: resubmissions do not pile up files.
    assert resolve_model(cfg, cfg.pools[0]).lora_plan == model.lora_plan
    off = parse_config(config(tmp_path))
    assert resolve_model(off, off.pools[0]).lora_plan == ""


def test_a_static_adapter_missing_from_the_registry_is_named(
    tmp_path: Path, registered: tuple[Path, Path]
) -> None:
    cfg = parse_config(config(tmp_path, max_loras=2, lora_adapters=["nope"]))
    with pytest.raises(ValueError, match="no adapter named 'nope'"):
        resolve_model(cfg, cfg.pools[0])


def test_adapters_are_staged_verified_and_a_corrupt_source_is_refused(
    tmp_path: Path, registered: tuple[Path, Path]
) -> None:
    _, adapter = registered
    manifest = build_manifest(adapter).encode()
    cache = tmp_path / "cache"
    staged = stage_adapter("docs-a", str(adapter), manifest, str(cache))
    assert staged.parent == cache and staged.name.startswith("docs-a@1-")
    assert (staged / "adapter_model.safetensors").read_bytes() == (
        adapter / "adapter_model.safetensors"
    ).read_bytes()
    assert stage_adapter("docs-a", str(adapter), manifest, str(cache)) == staged
    other = make_tiny_model("lora", tmp_path / "docs-b", seed=2)
    (other / "adapter_model.safetensors").write_bytes(b"not the registered bytes")
    with pytest.raises(CacheError):
        stage_adapter("docs-b", str(other), build_manifest(adapter).encode(), str(cache))


def test_a_bad_plan_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "plan.json"
    bad.write_bytes(msgspec.json.encode({"max_loras": "two"}))
    with pytest.raises(ValueError, match=str(bad)):
        read_plan(str(bad))
    good = tmp_path / "good.json"
    good.write_bytes(msgspec.json.encode(LoraPlan(2, 8)))
    assert read_plan(str(good)) == LoraPlan(2, 8, [])


def test_a_static_adapter_bound_to_another_base_version_is_refused(
    tmp_path: Path, registered: tuple[Path, Path]
) -> None:
    base, _ = registered
    with Registry(tmp_path / "state" / "registry.sqlite3") as reg:
        reg.add_version("llama", str(base), build_manifest(base))  # llama@2; docs-a: llama@1
    cfg = parse_config(config(tmp_path, model_ref="llama@2", max_loras=2, lora_adapters=["docs-a"]))
    with pytest.raises(
        ValueError, match="adapter docs-a is bound to llama@1, the pool serves llama@2"
    ):
        resolve_model(cfg, cfg.pools[0])
