"""The engine token (contracts/engine_token.py): made once, owner-only, never in an argv or
a job script; the guard in front of vLLM's routes; every caller of an engine presents it."""

from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from hpcserve.config import PlatformConfig, PoolConfig
from hpcserve.contracts.engine_token import (
    FILE_ENV,
    GUARD,
    TOKEN_ENV,
    EngineTokenError,
    EngineTokenGuard,
    auth_headers,
    ensure_token,
    read_token,
)
from hpcserve.engine_launch.vllm_args import EngineSpec, describe_env, vllm_argv, vllm_env
from hpcserve.poolmgr.render import render
from hpcserve.poolmgr.spec import build_job_spec


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_token_is_made_once_owner_only_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "state" / "secrets" / "engine-token"
    token = ensure_token(path)
    assert len(token) >= 40 and token == read_token(path) == ensure_token(path)
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["engine-token"]  # no temporary left


def test_components_starting_at_once_agree_on_one_token(tmp_path: Path) -> None:
    path = tmp_path / "secrets" / "engine-token"
    tokens: list[str] = []
    threads = [threading.Thread(target=lambda: tokens.append(ensure_token(path))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(tokens) == 8 and len(set(tokens)) == 1


def test_looser_modes_are_tightened_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "secrets" / "engine-token"
    ensure_token(path)
    os.chmod(path, 0o644)
    os.chmod(path.parent, 0o755)
    with caplog.at_level(logging.WARNING):
        ensure_token(path)
        os.chmod(path, 0o640)
        read_token(path)
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    tightened = [r.getMessage() for r in caplog.records if "owner only" in r.getMessage()]
    assert tightened == [f"{path.parent} was mode 0755: now 0700 (owner only)",
                         f"{path} was mode 0644: now 0600 (owner only)"]  # fmt: skip


def test_a_missing_or_empty_token_is_an_error_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(EngineTokenError, match=r"cannot read the engine token .*missing"):
        read_token(tmp_path / "missing")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(EngineTokenError, match="empty"):
        read_token(tmp_path / "empty")


def _app() -> Starlette:
    async def ok(request: Request) -> PlainTextResponse:
        return PlainTextResponse(f"served {request.url.path}")

    paths = ["/health", "/metrics", "/v1/chat/completions", "/v1/load_lora_adapter",
             "/invocations", "/rerank", "/score", "/tokenize", "/pooling", "/collective_rpc"]  # fmt: skip
    return Starlette(routes=[Route(p, ok, methods=["GET", "POST"]) for p in paths])


def test_the_guard_refuses_every_route_without_the_token_but_health_and_metrics() -> None:
    client = TestClient(EngineTokenGuard(_app(), token="s3cret"))
    # vLLM's own --api-key check leaves everything outside /v1, /v2, /inference and /cohere
    # open, /invocations (chat and completions) among them: the guard closes them all.
    for path in ("/v1/chat/completions", "/v1/load_lora_adapter", "/invocations", "/rerank",
                 "/score", "/tokenize", "/pooling", "/collective_rpc"):  # fmt: skip
        refused = client.post(path, json={})
        assert refused.status_code == 401, path
        assert refused.json()["error"]["type"] == "authentication_error"
        assert "s3cret" not in refused.text
        assert client.post(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.post(path, headers={"Authorization": "Basic s3cret"}).status_code == 401
        served = client.post(path, headers=auth_headers("s3cret"))
        assert (served.status_code, served.text) == (200, f"served {path}")
    for path in ("/health", "/metrics"):
        assert client.get(path).status_code == 200
        assert client.post(path).status_code == 401  # only reads are open


def test_the_guard_takes_the_token_from_vllms_variable_and_will_not_start_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    client = TestClient(EngineTokenGuard(_app()))
    assert client.post("/invocations", headers=auth_headers("from-env")).status_code == 200
    monkeypatch.delenv(TOKEN_ENV)
    with pytest.raises(EngineTokenError, match=TOKEN_ENV):
        EngineTokenGuard(_app())


def test_vllm_gets_the_guard_in_its_argv_and_the_token_only_in_its_environment() -> None:
    spec = EngineSpec("/m", "m", "vllm", "python", "0.0.0.0", 8000, token_guard=True)
    argv = vllm_argv(spec)
    assert argv[argv.index("--middleware") + 1] == GUARD
    env = vllm_env(spec, {"PATH": "/bin"}, engine_token="s3cret")
    assert env[TOKEN_ENV] == "s3cret"
    assert "s3cret" not in " ".join(argv) and "s3cret" not in describe_env(env)
    plain = EngineSpec("/m", "m", "vllm", "python", "0.0.0.0", 8000)
    assert "--middleware" not in vllm_argv(plain) and TOKEN_ENV not in vllm_env(plain, {})


def test_the_job_script_names_the_token_file_never_the_token(tmp_path: Path) -> None:
    config = PlatformConfig(
        state_dir=str(tmp_path), pools=[PoolConfig(name="p", model_path="/m", engine="sim")]
    )
    token = ensure_token(config.engine_token_path())
    script = render(build_job_spec(config, config.pools[0]))
    assert f"export {FILE_ENV}={tmp_path}/secrets/engine-token" in script
    assert token not in script
