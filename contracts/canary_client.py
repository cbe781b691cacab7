"""Running numerical canaries against one engine (contracts/canary.py has the format and the
comparison): the prompts one after another (never batched together, so the record does
not depend on how they were batched), over vLLM's /v1/completions with the deployment's
engine token (contracts/engine_token.py), within one deadline for all of them.

Used by `hpcserve models canary record|check` (modelcache/canary.py), by the engine before
it registers (engine_launch/engine.py) and by the health monitor (health/canary.py).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcserve.contracts.canary import (
    CanaryAnswer,
    CanaryError,
    CanarySettings,
    GoldenRecord,
    Mismatch,
    check_settings,
    compare,
    decode_record,
    parse_answer,
    request_body,
)
from hpcserve.contracts.engine_token import auth_headers


class CanaryRunError(RuntimeError):
    """The canaries could not be run (no answer in time, an HTTP error, a bad answer)."""


def _request(
    base_url: str, path: str, body: dict[str, Any] | None, engine_token: str, timeout_s: float
) -> Any:
    headers = {"Content-Type": "application/json", **auth_headers(engine_token)}
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base_url.rstrip("/") + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=max(timeout_s, 0.001)) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        text = err.read().decode("utf-8", "replace")[:200]
        raise CanaryRunError(f"{path} answered {err.code}: {text}") from None
    except TimeoutError:
        raise CanaryRunError(f"{path}: no answer within {timeout_s:.0f}s") from None
    except (urllib.error.URLError, OSError) as err:
        raise CanaryRunError(f"{path} unreachable: {getattr(err, 'reason', err)}") from None
    except ValueError as err:
        raise CanaryRunError(f"{path} answered something that is not JSON: {err}") from None


def served_model(base_url: str, *, engine_token: str = "", timeout_s: float = 10.0) -> str:
    """The model an engine serves (the first of its /v1/models)."""
    body = _request(base_url, "/v1/models", None, engine_token, timeout_s)
    try:
        return str(body["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        raise CanaryRunError("/v1/models lists no model") from None


def decode_canaries(
    base_url: str,
    model: str,
    settings: CanarySettings,
    *,
    engine_token: str = "",
    deadline_s: float = 60.0,
    clock: Callable[[], float] = time.monotonic,
) -> list[CanaryAnswer]:
    """Each prompt decoded greedily by the engine at `base_url`, in order."""
    check_settings(settings)
    end = clock() + deadline_s
    answers = []
    for prompt in settings.prompts:
        left = end - clock()
        if left <= 0:
            raise CanaryRunError(f"the canaries took longer than {deadline_s:g}s")
        body = request_body(model, prompt, settings)
        reply = _request(base_url, "/v1/completions", body, engine_token, left)
        try:
            answers.append(parse_answer(prompt, reply))
        except CanaryError as err:
            raise CanaryRunError(f"/v1/completions: {err}") from None
    return answers


def record_golden(
    base_url: str,
    model: str,
    model_ref: str,
    settings: CanarySettings | None = None,
    *,
    engine_token: str = "",
    deadline_s: float = 60.0,
) -> GoldenRecord:
    """Decode the canaries on a replica of `model_ref`: its golden record (not stored)."""
    settings = settings or CanarySettings()
    answers = decode_canaries(
        base_url, model, settings, engine_token=engine_token, deadline_s=deadline_s
    )
    return GoldenRecord(
        model_ref=model_ref,
        settings=settings,
        answers=answers,
        recorded_at=time.time(),
        recorded_from=base_url,
    )


def check_replica(
    base_url: str,
    model: str,
    golden: GoldenRecord,
    *,
    engine_token: str = "",
    deadline_s: float = 60.0,
) -> Mismatch | None:
    """Decode the canaries on a replica and compare with `golden` (CanaryRunError if it
    cannot be run)."""
    answers = decode_canaries(
        base_url, model, golden.settings, engine_token=engine_token, deadline_s=deadline_s
    )
    return compare(golden, answers)


def load_record(path: str | Path) -> GoldenRecord | None:
    """The golden record in `path`; None when there is no such file (no record yet)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise CanaryError(f"cannot read the golden record {path}: {err.strerror}") from None
    try:
        return decode_record(data)
    except CanaryError as err:
        raise CanaryError(f"{path}: {err}") from None
