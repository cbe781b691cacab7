"""`models eval` on replicas already serving, with simulated engines: the real router finds
the served model of each version, a real gateway process relays the official openai client's
requests and bench/'s benchmark, and the evaluation lands in the real registry."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcserve.config import GatewayConfig, PlatformConfig, hash_api_key
from hpcserve.contracts import protocol as p
from hpcserve.modelcache.registry import Registry
from hpcserve.onboarding.cli import EvalError, Options, evaluate, format_evaluation
from hpcserve.onboarding.runner import BenchSpec
from hpcserve.onboarding.suite import parse_suite
from hpcserve.router.server import RouterServer
from tests.ports import free_port
from tests.routers import alias_registry, loopback_router_config, running_router
from tests.services import gateways, service, sim_engine_argv

KEY = "sk-onboarding-sim"
HEADER = {"suite": "sim-probe", "key_metrics": ["filler"], "params": {"temperature": 0}}
CASES = [
    {"id": "chat", "messages": [{"role": "user", "content": "hello"}], "params": {"max_tokens": 4},
     "expect": [{"metric": "filler", "scorer": "exact", "value": "tok0 tok1 tok2 tok3"},
                {"metric": "json", "scorer": "json_valid"}]},
    {"id": "prompt", "prompt": "The bill of lading", "params": {"max_tokens": 2},
     "expect": [{"metric": "filler", "scorer": "regex", "pattern": "^ ?tok0 tok1$"},
                {"metric": "json", "scorer": "json_valid"}]},
]  # fmt: skip
SUITE = parse_suite(
    "".join(json.dumps(x) + "\n" for x in [HEADER, *CASES]).encode(), source="sim.jsonl"
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PlatformConfig, str]]:
    """docs@1 and docs@2 each served by a simulated engine, a router and a gateway."""
    work = tmp_path_factory.mktemp("onboarding-sim")
    registry = alias_registry(work)
    ports = {"docs-v1": free_port(), "docs-v2": free_port()}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    with (
        service(sim_engine_argv(ports["docs-v1"], "docs-v1", 1), urls["docs-v1"]),
        service(sim_engine_argv(ports["docs-v2"], "docs-v2", 1), urls["docs-v2"]),
        running_router(loopback_router_config(lease_s=600.0)) as router,
        gateways(
            router.config,
            {"api_keys": [{"tenant": "admin", "sha256": hash_api_key(KEY)}]},
            work,
            count=1,
            model="docs-v1",
        ) as (gateway,),
    ):
        for version, name in ((1, "docs-v1"), (2, "docs-v2")):
            register(router, name, urls[name], f"docs@{version}")
        config = PlatformConfig(
            state_dir=str(work / "state"),
            registry=str(registry),
            router=router.config,
            gateway=GatewayConfig(port=int(gateway.rsplit(":", 1)[1])),
        )
        yield config, gateway


def register(router: RouterServer, model: str, url: str, ref: str) -> None:
    router.registry.register(p.Register(model, model, url, pool=model, model_ref=ref), now=1e12)


def test_a_version_already_serving_is_evaluated_against_its_baseline(
    served: tuple[PlatformConfig, str],
) -> None:
    config, gateway = served
    said: list[str] = []
    bench = BenchSpec(requests=6, rate=20.0, prompt_tokens=32, output_tokens=4)
    options = Options(gateway=gateway, api_key=KEY, bench=bench)
    evaluation = evaluate(config, "docs@2", SUITE, "docs@1", options, said.append)
    assert evaluation.passed and evaluation.id > 0
    assert evaluation.scores == {"filler": 100.0, "json": 0.0}
    assert evaluation.baseline == "docs@1" and evaluation.baseline_scores == evaluation.scores
    assert [(r.metric, r.delta, r.passed) for r in evaluation.results] == [("filler", 0.0, True)]
    assert evaluation.served_by == "docs-v2, already serving"
    assert evaluation.errors == 0
    # The gate passed, so the eval tried to record the golden record on docs-v2's replica; a
    # simulated engine has no logprobs: the verdict stands, and the note says how to record.
    assert evaluation.canary.startswith("not recorded on http://127.0.0.1:")
    assert "no choices[0].logprobs" in evaluation.canary
    assert "hpcserve models canary record docs@2 --config" in evaluation.canary
    b = evaluation.benchmark
    assert b is not None and (b.requests, b.ok) == (6, 6)
    assert b.ttft_p50_s > 0 and b.tpot_p50_s > 0 and b.output_tokens_per_s > 0
    assert "baseline docs@1: running suite sim-probe (2 cases)" in said
    assert "docs@1 is served by docs-v1, already serving" in said
    with Registry(Path(config.registry_path())) as reg:
        assert reg.gate_status("docs@2")[0]
        assert reg.latest_evaluation("docs@2") == evaluation
        assert reg.canary_record("docs@2") is None
    table = format_evaluation(evaluation)
    assert "docs@2 vs docs@1 on suite sim-probe (2 cases, 0 failed requests)" in table
    assert "verdict: PASS" in table
    assert f"canary: {evaluation.canary}" in table


def test_a_version_that_nothing_serves_needs_a_canary_pool(
    served: tuple[PlatformConfig, str],
) -> None:
    config, gateway = served
    with Registry(Path(config.registry_path())) as reg:
        source = reg.version("docs@1").source
        reg.add_version("docs", source, reg.manifest("docs@1"))  # docs@3, not served
    options = Options(gateway=gateway, api_key=KEY, bench=None)
    with pytest.raises(EvalError, match="no replica serves docs@3; give --pool POOL"):
        evaluate(config, "docs@3", SUITE, None, options, lambda _: None)
    with Registry(Path(config.registry_path())) as reg:
        assert reg.evaluations("docs@3") == []
