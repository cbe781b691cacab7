"""Bad input, generated, against the real gateway process in front of real vLLM CPU engines (a
chat model, an embedding model and a reranker): every endpoint (chat, completions,
embeddings, rerank, score, models, files, batches). The bodies hold the classes that broke
the client boundary (issue 17): deep nesting, boundary and huge integers and floats,
NaN/Infinity literals written as raw JSON, lone surrogates and odd Unicode as JSON escapes,
JSON schemas the grammar backend cannot compile, wrong types at every level. Whatever the
body, the answer is a success or a 4xx in OpenAI's error shape: a 5xx or a dropped
connection fails the test, and so does a traceback in the gateway's log.

Bounded for CI: a fixed set of examples (derandomized, so a failure reproduces). To search
for minutes: HPCSERVE_FUZZ_EXAMPLES=2000 (random examples, a new search each run).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcserve.config import dump_config, hash_api_key, parse_config
from hpcserve.contracts.router_client import RouterQueryError, list_models
from hpcserve.gateway.errors import TYPES
from hpcserve.router.server import RouterServer
from hpcserve.tinymodels import make_tiny_model
from tests.integration.slurm_helpers import wait_for
from tests.ports import free_port
from tests.routers import loopback_router_config, running_router
from tests.services import stop, wait_healthy
from tests.unit.test_gateway_schema_check import schemas

pytestmark = pytest.mark.vllm

KEY = "sk-fuzz-vllm"
CHAT, EMBED, RERANK = "tiny-chat", "tiny-embed", "tiny-rerank"
_SEARCH = int(os.environ.get("HPCSERVE_FUZZ_EXAMPLES", "0"))


def fuzz(examples: int) -> Any:
    return settings(
        max_examples=_SEARCH or examples,
        deadline=None,
        database=None,
        derandomize=not _SEARCH,
        suppress_health_check=list(HealthCheck),
    )


@dataclass
class Stack:
    url: str
    log: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("fuzz-vllm")
    models = {name: make_tiny_model(kind, work / name) for name, kind in
              ((CHAT, "chat"), (EMBED, "embed"), (RERANK, "rerank"))}  # fmt: skip
    with running_router(loopback_router_config(lease_s=20.0)) as router:
        engines = [_engine(router, name, path, work) for name, path in models.items()]
        gateway: subprocess.Popen[bytes] | None = None
        try:
            wait_for(
                "three vLLM engines to register",
                lambda: {CHAT, EMBED, RERANK} <= set(_served(router)),
                timeout=600,
            )
            port = free_port()
            config = parse_config({
                "state_dir": str(work),
                "router": {"registry_bind": router.config.registry_bind,
                           "routing_bind": router.config.routing_bind,
                           "lease_s": router.config.lease_s,
                           "heartbeat_s": router.config.heartbeat_s,
                           "allow_plain_loopback": True},
                "gateway": {"port": port, "audit_log": "", "upstream_timeout_s": 120.0,
                            "max_body_bytes": 256 * 1024,
                            "api_keys": [{"tenant": "fuzz", "sha256": hash_api_key(KEY)}]},
                "batch": {"metrics_port": free_port(), "runner": "gateway"},
                "pools": [{"name": name, "model_path": str(path), "engine": "vllm-cpu"}
                          for name, path in models.items()],
            })  # fmt: skip
            (work / "gateway.toml").write_text(dump_config(config))
            log = work / "gateway.log"
            with open(log, "wb") as out:
                gateway = subprocess.Popen(
                    [sys.executable, "-m", "hpcserve.cli", "gateway", "--config",
                     str(work / "gateway.toml")],
                    stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, gateway, timeout_s=60)
            yield Stack(url, log)
            print("answers by (path, status):", sorted(SEEN.items()))  # seen with -s
            assert gateway.poll() is None, "the gateway exited"
            text = log.read_text(errors="replace")
            assert "Traceback" not in text, text[-5000:]
            assert " failed (request id " not in text, "the gateway's catch-all answered"
        finally:
            if gateway is not None:
                stop(gateway)
            for engine in engines:
                stop(engine, timeout_s=60)


def _engine(router: RouterServer, name: str, path: Path, work: Path) -> subprocess.Popen[bytes]:
    env = os.environ | {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # three engines, two cores
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    with open(work / f"{name}.log", "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "hpcserve.cli", "engine", "--engine", "vllm-cpu",
             "--model-path", str(path), "--served-model-name", name, "--pool", name,
             "--router", router.config.registry_bind, "--bind-host", "127.0.0.1",
             "--advertise-host", "127.0.0.1", "--heartbeat-s", "1", "--ready-timeout-s", "600",
             "--", "--dtype", "float32", "--enforce-eager", "--max-model-len", "512"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip


def _served(router: RouterServer) -> list[str]:
    try:
        return [m.id for m in list_models(router.config.routing_bind, timeout_s=2.0)]
    except RouterQueryError:  # the router is busy: ask again
        return []


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=stack.url, headers=headers, timeout=180) as http:
        yield http


# Raw JSON text, written as it is into a body: what json.dumps would never write.
class Raw:
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text[:80]!r})"


def dumps(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        items = (f"{dumps(k) if isinstance(k, Raw) else json.dumps(k)}: {dumps(v)}"
                 for k, v in value.items())  # fmt: skip
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


def _nested(depth: int, kind: int) -> Raw:
    if kind == 0:
        return Raw("[" * depth + "]" * depth)
    if kind == 1:
        return Raw('{"a": ' * depth + "1" + "}" * depth)
    return Raw('[{"a": ' * (depth // 2) + "null" + "}]" * (depth // 2))


deep = st.builds(_nested, st.integers(1, 3000) | st.sampled_from([127, 128, 129, 990, 1000]),
                 st.integers(0, 2))  # fmt: skip
big_ints = st.one_of(
    st.sampled_from(
        [2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30, 2**31, -1, 0]
    ),
    st.integers(-(2**80), 2**80),
).map(lambda i: Raw(str(i))) | st.just(Raw("1" + "0" * 5000))
odd_floats = st.sampled_from(
    [
        "NaN",
        "Infinity",
        "-Infinity",
        "1e400",
        "-1e400",
        "1e-400",
        "1.7976931348623157e308",
        "-0.0",
        "0.1e1",
        "1E2",
    ]
).map(Raw) | st.floats().map(
    lambda f: Raw(json.dumps(f)) if f == f and abs(f) != float("inf") else Raw("NaN")
)
odd_text = st.one_of(
    st.sampled_from(
        [
            '"a\\ud800b"',
            '"\\udc00"',
            '"\\ud800\\ud800"',
            '"\\ud83d\\ude00"',
            '"\\u0000"',
            '"x\\\\ud800"',
            '"\\ud800\\u0041"',
            '"\\uDBFF\\uDFFF"',
            '"\\u202e\\u200b\\ufeff"',
        ]
    ).map(Raw),
    st.text(max_size=12).map(lambda s: Raw(json.dumps(s, ensure_ascii=False))),
)
bad_schemas = st.sampled_from([
    {"enum": []}, {"type": "object", "properties": {"a": {"enum": []}}},
    {"type": "integer", "maximum": 2**70}, {"type": "array", "minItems": 10**9},
    {"type": "array", "minItems": 1}, {"$ref": "#"}, {"type": "string", "pattern": "\\p{L}"},
    {"type": "object", "patternProperties": {"(": {}}}, {"type": "string", "pattern": "a\u0000"},
    {"type": "array", "prefixItems": [{"enum": []}]}, {"type": "object", "minProperties": 1},
])  # fmt: skip
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6,
)  # fmt: skip
weird = st.one_of(deep, big_ints, odd_floats, odd_text, json_values)


json_schema_formats = st.builds(
    lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}},
    schemas | bad_schemas,
)
structured_outputs = (
    st.builds(lambda s: {"json": s}, schemas | bad_schemas)
    | st.builds(lambda r: {"regex": r}, st.sampled_from(["a+", "\\p{L}", "(", "\\bx", "[0-9]{2}"]))
    | st.just({"choice": []})
)
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _bodies(w: st.SearchStrategy[Any] | None) -> dict[str, st.SearchStrategy[Any]]:
    """Each endpoint's bodies: with `w` None only good values (most get a 200), else each
    field a good value or, one time in four, a value of `w`, plus fields of odd kinds."""

    def field(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return good if w is None else st.one_of(good, good, good, w)

    odd: dict[str, st.SearchStrategy[Any]] = {} if w is None else {
        "surprise": w,
        "response_format": json_schema_formats | w,
        "structured_outputs": structured_outputs | w,
        "tools": field(st.just(TOOLS)),
        "tool_choice": field(st.sampled_from(["none", "auto", "required"])),
    }  # fmt: skip
    text = st.text(min_size=1, max_size=20)
    sampling = {
        "n": field(st.integers(1, 2)),
        "top_k": field(st.integers(-1, 50)),
        "seed": field(st.integers(0, 2**40)),
        "min_tokens": field(st.integers(0, 2)),
        "stream_interval": field(st.integers(1, 3)),
        "temperature": field(st.floats(0, 2)),
        "top_p": field(st.floats(0.01, 1)),
        "stop": field(st.lists(st.text(min_size=1, max_size=3), max_size=2)),
        "bad_words": field(st.lists(st.text(min_size=1, max_size=3), max_size=2)),
        "logit_bias": field(
            st.dictionaries(st.integers(0, 300).map(str), st.floats(-5, 5), max_size=2)
        ),
        "stream": st.booleans(),
        "response_format": field(st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
    } | odd
    message = st.fixed_dictionaries(
        {"role": field(st.sampled_from(["user", "system", "assistant"])),
         "content": field(st.text(max_size=30))},
        optional={} if w is None else {"name": odd_text},
    )  # fmt: skip
    messages = st.lists(message, min_size=1, max_size=3)
    chat = st.fixed_dictionaries(
        {"model": field(st.just(CHAT)), "max_tokens": field(st.integers(1, 6)),
         "messages": messages if w is None else messages | w},
        optional=sampling | {"logprobs": field(st.booleans()),
                             "top_logprobs": field(st.integers(0, 3))},
    )  # fmt: skip
    prompt = st.text(min_size=1, max_size=30) | st.lists(
        st.integers(0, 300), min_size=1, max_size=4
    )
    completion = st.fixed_dictionaries(
        {"model": field(st.just(CHAT)), "max_tokens": field(st.integers(1, 6)),
         "prompt": field(prompt)},
        optional=sampling | {"logprobs": field(st.integers(0, 3)), "echo": field(st.booleans())},
    )  # fmt: skip
    surprise = {} if w is None else {"surprise": w}
    embedding = st.fixed_dictionaries(
        {"model": field(st.just(EMBED)),
         "input": field(text | st.lists(text, min_size=1, max_size=3))},
        optional={"encoding_format": field(st.sampled_from(["float", "base64"])),
                  **({} if w is None else {"dimensions": field(st.integers(1, 64))}), **surprise},
    )  # fmt: skip
    rerank = st.fixed_dictionaries(
        {"model": field(st.just(RERANK)), "query": field(text),
         "documents": field(st.lists(text, min_size=1, max_size=3))},
        optional={"top_n": field(st.integers(0, 3)), **surprise},
    )  # fmt: skip
    score = st.fixed_dictionaries(
        {"model": field(st.just(RERANK)), "text_1": field(text),
         "text_2": field(text | st.lists(text, min_size=1, max_size=3))},
        optional=surprise,
    )  # fmt: skip
    return {
        "/v1/chat/completions": chat,
        "/v1/completions": completion,
        "/v1/embeddings": embedding,
        "/v1/rerank": rerank,
        "/v1/score": score,
    }


_CLEAN, _MIXED = _bodies(None), _bodies(weird)
BODIES = {path: _CLEAN[path] | _MIXED[path] | _MIXED[path] | weird for path in _CLEAN}
chat_bodies = _CLEAN["/v1/chat/completions"] | _MIXED["/v1/chat/completions"]


SEEN: collections.Counter[tuple[str, int]] = collections.Counter()  # (path, status): shown


def check(response: httpx.Response, what: str) -> int:
    """Never a 5xx; an error in OpenAI's shape and vocabulary."""
    status = response.status_code
    words = what.split(" ")
    key = (
        "/".join(words[1].strip("'\"").split("/")[:3]) if words[0] in ("GET", "POST") else words[0]
    )
    SEEN[key, status] += 1
    assert status < 500, f"{what} -> {status} {response.text[:600]}"
    if status >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] in TYPES, error
        assert error["code"] is None or isinstance(error["code"], str), error
        assert isinstance(error["message"], str) and error["message"].strip(), error
    return status


def post(client: httpx.Client, path: str, body: Any) -> int:
    text = dumps(body) if not isinstance(body, Raw) else body.text
    content = text.encode("utf-8", "surrogatepass")  # raw, lone surrogates included
    what = f"POST {path} {text[:400]!r}"
    with client.stream(
        "POST", path, content=content, headers={"Content-Type": "application/json"}
    ) as response:
        response.read()
    status = check(response, what)
    if status == 200 and response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith('data: {"error"'):  # vLLM checks some fields only mid-stream
                error = json.loads(line[6:])["error"]
                assert error["type"] in TYPES and error["message"], error
                assert error["type"] != "server_error", f"{what} -> an error event: {error}"
    return status


@pytest.mark.parametrize("path", list(BODIES))
def test_generated_bodies_never_get_a_5xx(client: httpx.Client, path: str) -> None:
    seen: set[int] = set()

    @fuzz(40)
    @given(body=BODIES[path])
    def run(body: Any) -> None:
        seen.add(post(client, path, body))

    run()
    assert 200 in seen and any(400 <= s < 500 for s in seen), seen


_URL_TEXT = st.characters(blacklist_categories=("Cc", "Cs"))  # what a URL path can carry


@fuzz(30)
@given(
    model_id=st.text(_URL_TEXT, max_size=20)
    | st.sampled_from([CHAT, "nope", "../../etc", "a/b", "%00", "%ED%A0%80", " "]),
    file_id=st.text(_URL_TEXT, max_size=20) | st.sampled_from(["file-", "file-" + "0" * 40]),
)
def test_models_files_and_batches_lookups_never_get_a_5xx(
    client: httpx.Client, model_id: str, file_id: str
) -> None:
    check(client.get("/v1/models"), "GET /v1/models")
    for path in (f"/v1/models/{model_id}", f"/v1/files/{file_id}", f"/v1/batches/{file_id}",
                 f"/v1/files/{file_id}/content"):  # fmt: skip
        check(client.get(path), f"GET {path!r}")
    check(client.post(f"/v1/batches/{file_id}/cancel"), f"cancel {file_id!r}")


batch_lines = st.one_of(
    st.builds(
        lambda i, body: {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": body},
        st.integers(0, 10**6), chat_bodies,
    ),
    weird,
)  # fmt: skip


@fuzz(20)
@given(
    lines=st.lists(batch_lines, min_size=1, max_size=4),
    batch=st.fixed_dictionaries(
        {"endpoint": st.just("/v1/chat/completions") | weird,
         "completion_window": st.just("24h") | weird},
        optional={"metadata": weird},
    ),
)  # fmt: skip
def test_files_and_batches_never_get_a_5xx(
    client: httpx.Client, lines: list[Any], batch: dict[str, Any]
) -> None:
    content = "\n".join(dumps(line) for line in lines).encode("utf-8", "surrogatepass")
    upload = client.post(
        "/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}
    )
    if check(upload, f"upload {content[:300]!r}") != 200:
        return
    file_id = upload.json()["id"]
    created = client.post(
        "/v1/batches",
        content=dumps(batch | {"input_file_id": file_id}).encode("utf-8", "surrogatepass"),
        headers={"Content-Type": "application/json"},
    )
    if check(created, f"batch {batch!r}") == 200:
        batch_id = created.json()["id"]
        check(client.get(f"/v1/batches/{batch_id}"), "GET batch")
        check(client.post(f"/v1/batches/{batch_id}/cancel"), "cancel batch")
    check(client.get(f"/v1/files/{file_id}/content"), "GET file content")


def test_the_crash_classes_of_issue_17_are_400s_naming_the_field(client: httpx.Client) -> None:
    base = {"model": CHAT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for extra, param in [
        ({"top_k": Raw(str(10**30))}, "top_k"),
        ({"stop": Raw('"a\\ud800b"')}, "stop"),
        ({"best_of": _nested(300, 0)}, None),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"enum": []}}}}}},
         "response_format.json_schema.schema"),
        ({"temperature": Raw("NaN")}, "temperature"),
    ]:  # fmt: skip
        response = client.post(
            "/v1/chat/completions",
            content=dumps(base | extra).encode("utf-8", "surrogatepass"),
            headers={"Content-Type": "application/json"},
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.text
