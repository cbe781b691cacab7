"""The gateway's part in issue 18, against a real router and a simulated engine guarded the
way `hpcserve engine` guards vLLM (the engine token in its environment): the engine refuses
direct calls; the gateway presents the token, writes one audit line per request (never the
text, never the key), counts refused keys and logs them without the key, and serves TLS
itself to the official openai client."""

from __future__ import annotations

import json
import logging
import os
import ssl
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from hpcserve.config import (
    ApiKey,
    ConfigError,
    GatewayConfig,
    dump_config,
    hash_api_key,
    parse_config,
)
from hpcserve.contracts import protocol as p
from hpcserve.contracts.engine_token import TOKEN_ENV, auth_headers
from hpcserve.contracts.private_files import write_private
from hpcserve.gateway.app import Gateway, build_app
from hpcserve.router.server import RouterServer
from tests.ports import free_port
from tests.services import gateway_argv, sim_engine_argv, stop, wait_healthy

MODEL = "tiny"
TOKEN = "engine-token-for-the-tests-3f9a1c"
KEYS = {"team-a": "sk-team-a-0123456789", "team-b": "sk-team-b-9876543210"}
PROMPT = "PROMPT-TEXT-NEVER-LOGGED"


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    """A simulated engine that, like vLLM under `hpcserve engine`, holds the engine token."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        sim_engine_argv(port, MODEL, 1),
        env={**os.environ, TOKEN_ENV: TOKEN},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        stop(proc)


def gateway_for(
    router: RouterServer, engine: str, token: str = TOKEN, **settings: object
) -> Gateway:
    router.registry.register(p.Register("r1", MODEL, engine), now=1e12)
    config = GatewayConfig(
        api_keys=[ApiKey(tenant=t, sha256=hash_api_key(k)) for t, k in KEYS.items()],
        **settings,  # type: ignore[arg-type]
    )
    return Gateway(
        config,
        routing_endpoint=router.config.routing_bind,
        configured_models={MODEL},
        engine_token=token,
    )


def sdk(http: TestClient | httpx.Client, base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, http_client=http, max_retries=0)


def chat_body() -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}


def chat(client: openai.OpenAI, model: str = MODEL, **options: object) -> Any:
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=4, **options
    )


def test_the_engine_answers_only_callers_with_the_engine_token(engine: str) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/reset_prefix_cache"):
        for headers in ({}, {"Authorization": "Bearer sk-team-a-0123456789"}):
            assert httpx.post(engine + path, json=chat_body(), headers=headers).status_code == 401
    served = httpx.post(
        engine + "/v1/chat/completions", json=chat_body(), headers=auth_headers(TOKEN)
    )
    assert served.status_code == 200
    assert httpx.get(engine + "/health").status_code == 200
    assert "vllm:" in httpx.get(engine + "/metrics").text


def test_each_request_has_one_audit_line_without_its_text_or_key(
    router: RouterServer, engine: str, tmp_path: Path
) -> None:
    audit = tmp_path / "audit" / "gateway.log"
    gateway = gateway_for(router, engine, audit_log=str(audit))
    with TestClient(build_app(gateway)) as http:
        a = sdk(http, "http://testserver", KEYS["team-a"])
        reply = chat(a, extra_headers={"X-Request-Id": "req-a1"})
        stream = chat(a, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        with pytest.raises(openai.NotFoundError):
            chat(a, "no-such-model")
        with pytest.raises(openai.AuthenticationError):
            chat(sdk(http, "http://testserver", "sk-WRONG-KEY-VALUE"))
        sdk(http, "http://testserver", KEYS["team-b"]).models.list()
        assert http.get("/health").status_code == 200  # not audited
    text = audit.read_text()
    assert stat.S_IMODE(audit.stat().st_mode) == 0o600
    assert stat.S_IMODE(audit.parent.stat().st_mode) == 0o700
    for secret in (PROMPT, "sk-WRONG-KEY-VALUE", *KEYS.values(), TOKEN):
        assert secret not in text
    assert reply.choices[0].message.content and reply.choices[0].message.content not in text
    assert streamed and streamed not in text
    lines = [json.loads(line) for line in text.splitlines()]
    key_a = hash_api_key(KEYS["team-a"])[:12]
    got = [(x["tenant"], x["key_id"], x["path"], x["model"], x["status"]) for x in lines]
    # In request order, except that a stream's line is written when its end has been sent,
    # which may come after the client's next request: compared as a multiset.
    assert sorted(got) == sorted([
        ("team-a", key_a, "/v1/chat/completions", MODEL, 200),
        ("team-a", key_a, "/v1/chat/completions", MODEL, 200),
        ("team-a", key_a, "/v1/chat/completions", "no-such-model", 404),
        ("", "", "/v1/chat/completions", "", 401),
        ("team-b", hash_api_key(KEYS["team-b"])[:12], "/v1/models", "", 200),
    ])  # fmt: skip
    chats = [x for x in lines if x["status"] == 200 and x["model"] == MODEL]
    (first,) = [x for x in chats if x["request_id"] == "req-a1"]
    (streamed_line,) = [x for x in chats if x is not first]
    assert first["replica"] == "r1"
    assert reply.usage is not None
    assert (first["prompt_tokens"], first["completion_tokens"]) == (
        reply.usage.prompt_tokens,
        reply.usage.completion_tokens,
    )
    # A stream's line is written at its end, with its tokens.
    assert streamed_line["completion_tokens"] > 0 and len(streamed_line["request_id"]) == 24
    assert all(x["client"] and x["time"].endswith("Z") for x in lines)


def test_refused_keys_are_counted_by_reason_and_logged_without_the_key(
    router: RouterServer, engine: str, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = gateway_for(router, engine, audit_log="")
    with caplog.at_level(logging.WARNING), TestClient(build_app(gateway)) as http:
        for headers in (
            {},
            {"Authorization": "Token sk-MALFORMED"},
            {"Authorization": "Bearer sk-INVALID"},
        ):
            assert (
                http.post("/v1/chat/completions", json=chat_body(), headers=headers).status_code
                == 401
            )
        assert (
            http.get("/v1/models", headers={"Authorization": "Bearer sk-INVALID"}).status_code
            == 401
        )
        metrics = http.get("/metrics").text
    for reason, count in (("missing", 1), ("malformed", 1), ("invalid", 2)):
        assert f'hpcserve_gateway_auth_failures_total{{reason="{reason}"}} {count:.1f}' in metrics
    logged = [r.getMessage() for r in caplog.records if "401" in r.getMessage()]
    assert logged and "missing" in logged[0]  # then at most one line per 10 s, with a count
    assert not any("sk-" in r.getMessage() for r in caplog.records)


def test_audit_lines_go_to_the_service_log_by_default_and_nowhere_when_off(
    router: RouterServer, engine: str, capfd: pytest.CaptureFixture[str]
) -> None:
    assert GatewayConfig().audit_log == "-"
    for setting, expected in (("-", 1), ("", 0)):
        gateway = gateway_for(router, engine, audit_log=setting)
        with TestClient(build_app(gateway)) as http:
            assert chat(sdk(http, "http://testserver", KEYS["team-a"])).choices
        err = capfd.readouterr().err
        audit_lines = [line for line in err.splitlines() if line.startswith("audit {")]
        assert len(audit_lines) == expected, err
        if expected:
            assert json.loads(audit_lines[0].removeprefix("audit "))["tenant"] == "team-a"


def test_an_engine_refusing_the_gateways_token_is_a_502_not_the_clients_401(
    router: RouterServer, engine: str
) -> None:
    gateway = gateway_for(router, engine, token="another-deployments-token", audit_log="")
    with TestClient(build_app(gateway)) as http:
        response = http.post(
            "/v1/chat/completions",
            json=chat_body(),
            headers={"Authorization": f"Bearer {KEYS['team-a']}"},
        )
    assert response.status_code == 502
    assert "refused the gateway's engine token" in response.json()["error"]["message"]


# -- TLS ---------------------------------------------------------------------------------


def self_signed(directory: Path, name: str = "gateway") -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (openssl; nothing downloaded)."""
    cert, key = directory / f"{name}-cert.pem", directory / f"{name}-key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    os.chmod(key, 0o600)
    return cert, key


def gateway_config(
    router: RouterServer, state: Path, engine: dict[str, object] | None = None, **gateway: object
) -> tuple[Path, int]:
    """A config file for `hpcserve gateway` in `state` (made), and its port."""
    state.mkdir()
    port = free_port()
    config = parse_config({
        "state_dir": str(state),
        "router": {"registry_bind": router.config.registry_bind,
                   "routing_bind": router.config.routing_bind, "allow_plain_loopback": True},
        "gateway": {"port": port, "audit_log": "",
                    "api_keys": [{"tenant": "team-a", "sha256": hash_api_key(KEYS["team-a"])}],
                    **gateway},
        "engine": engine or {},
        "pools": [{"name": MODEL, "model_path": "/nonexistent", "engine": "sim"}],
    })  # fmt: skip
    path = state / "hpcserve.toml"
    path.write_text(dump_config(config))
    return path, port


def test_the_gateway_serves_tls_to_the_openai_client(
    router: RouterServer, engine: str, tmp_path: Path
) -> None:
    router.registry.register(p.Register("r1", MODEL, engine), now=1e12)
    cert, key = self_signed(tmp_path)
    token_file = write_private(tmp_path / "engine-token", TOKEN.encode())  # the engine's
    path, port = gateway_config(
        router,
        tmp_path / "state",
        engine={"token_file": str(token_file)},
        tls_cert=str(cert),
        tls_key=str(key),
    )
    url = f"https://127.0.0.1:{port}"
    with (tmp_path / "gateway.log").open("wb") as log:
        proc = subprocess.Popen(gateway_argv(path), stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(verify=ssl.create_default_context(cafile=cert), timeout=30) as http:
            wait_healthy(url, proc, http=http)
            reply = chat(sdk(http, url, KEYS["team-a"]))
            assert reply.choices[0].message.content
        with pytest.raises(httpx.TransportError):  # no plain HTTP on that port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(url + "/health", timeout=5)  # a client that does not trust it
    finally:
        stop(proc)


def test_tls_settings_are_checked_at_start_naming_the_key(
    router: RouterServer, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=r"gateway\.tls_key: gateway\.tls_cert is set"):
        parse_config({"gateway": {"tls_cert": "/etc/cert.pem"}})
    cert, key = self_signed(tmp_path)
    other_cert, _ = self_signed(tmp_path, "other")
    for i, (cert_file, message) in enumerate([
        (tmp_path / "missing.pem", "gateway.tls_cert: "),
        (key, "do not load as a certificate chain"),  # a key is no certificate
        (other_cert, "do not load as a certificate chain"),  # another key's certificate
    ]):  # fmt: skip
        path, _ = gateway_config(
            router, tmp_path / f"state{i}", tls_cert=str(cert_file), tls_key=str(key)
        )
        run = subprocess.run(gateway_argv(path), capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and "config error" in run.stderr, run.stderr
        assert message in run.stderr, run.stderr
    assert cert.exists()


def test_an_audit_line_that_cannot_be_written_is_counted_and_the_request_goes_on(
    router: RouterServer, engine: str, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = gateway_for(router, engine, audit_log="/dev/full")  # every write: ENOSPC
    with caplog.at_level(logging.ERROR), TestClient(build_app(gateway)) as http:
        assert chat(sdk(http, "http://testserver", KEYS["team-a"])).choices
        assert http.get("/v1/models").status_code == 401
        metrics = http.get("/metrics").text
    assert "hpcserve_gateway_audit_failures_total 2.0" in metrics
    assert [r.getMessage() for r in caplog.records if "audit" in r.getMessage()] == [
        "cannot write the audit log /dev/full: [Errno 28] No space left on device"
    ]
    assert stat.S_IMODE(os.stat("/dev/full").st_mode) == 0o666  # a device is never tightened


def test_the_engines_health_probe_presents_the_token(engine: str) -> None:
    """Without it the probe would be refused (401), which it takes for a model it cannot
    probe: the one-token generation must really run."""
    from hpcserve.health.engine_checks import GenerationProbe

    probed = GenerationProbe(engine, MODEL, engine_token=TOKEN).run(30)
    assert (probed.ok, probed.detail) == (True, "")
    refused = GenerationProbe(engine, MODEL).run(30)
    assert "answered 401" in refused.detail
