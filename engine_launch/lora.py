"""The engine's side of multi-LoRA: the pool's LoRA plan, static adapters staged before vLLM
starts, and adapters loaded and unloaded at run time on the router's request.

The pool manager writes a `LoraPlan` (JSON) for a pool with LoRA on and passes its path to
the job (HPCSERVE_LORA_PLAN). Every adapter, static or on demand, is staged like a model:
copied from its source into the node cache and verified against its digest manifest, then
vLLM loads the cached copy. Run-time loads go through vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in vLLM's environment).

`RuntimeAdapters` does the slow part (staging, HTTP) on one worker thread; the engine's
serve loop hands it the router's LoadAdapter messages and collects the AdapterLoaded
answers, so heartbeats never wait for a copy.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import urllib.error
import urllib.request
from pathlib import Path

import msgspec

from hpcserve.contracts import protocol as p
from hpcserve.contracts.engine_token import auth_headers
from hpcserve.contracts.lora_plan import LoraPlan

log = logging.getLogger(__name__)

# The registry has no versions for adapters: their cache key is NAME@1-<digest>.
ADAPTER_CACHE_VERSION = 1


def read_plan(path: str) -> LoraPlan:
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=LoraPlan)
    except (OSError, msgspec.DecodeError) as err:
        raise ValueError(f"cannot read the LoRA plan {path}: {err}") from None


def stage_adapter(name: str, source: str, manifest_json: bytes, cache_dir: str) -> Path:
    """Copy an adapter into the node cache (or find it there, verified); its cached path."""
    from hpcserve.modelcache.cache import NodeCache
    from hpcserve.modelcache.manifest import decode_manifest
    from hpcserve.modelcache.stage import stage

    staged = stage(
        decode_manifest(manifest_json),
        Path(source),
        NodeCache(Path(cache_dir)),
        name=name,
        version=ADAPTER_CACHE_VERSION,
        lease_pid=os.getpid(),
    )
    log.info(
        "adapter %s %s at %s",
        name,
        "staged" if staged.copied else "found in the node cache",
        staged.path,
    )
    return staged.path


def _post(
    url: str, body: dict[str, str], timeout_s: float, engine_token: str = ""
) -> tuple[int, str]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **auth_headers(engine_token)},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode("utf-8", "replace")


class RuntimeAdapters:
    """Adapters loaded into one vLLM server; changed only on this object's worker thread."""

    def __init__(
        self,
        vllm_url: str,
        cache_dir: str,
        loaded: list[str],
        *,
        http_timeout_s: float = 60.0,
        engine_token: str = "",
    ) -> None:
        self.vllm_url = vllm_url
        self.cache_dir = cache_dir
        self._token = engine_token  # vLLM refuses adapter changes from anyone without it
        self.http_timeout_s = http_timeout_s
        self._loaded = list(loaded)
        self._lock = threading.Lock()
        self._requests: queue.Queue[p.LoadAdapter | None] = queue.Queue()
        self._answers: queue.Queue[p.AdapterLoaded] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="lora-loader", daemon=True)
        self._thread.start()

    @property
    def loaded(self) -> list[str]:
        with self._lock:
            return list(self._loaded)

    def submit(self, msg: p.LoadAdapter) -> None:
        self._requests.put(msg)

    def answers(self) -> list[p.AdapterLoaded]:
        out: list[p.AdapterLoaded] = []
        while True:
            try:
                out.append(self._answers.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._requests.put(None)

    def _work(self) -> None:
        while (msg := self._requests.get()) is not None:
            error = ""
            try:
                for name in msg.unload:
                    self._unload(name)
                if msg.adapter not in self.loaded:
                    self._load(msg)
            except Exception as err:  # reported to the router, which tells the client
                error = str(err) or type(err).__name__
                log.warning("cannot load LoRA adapter %s: %s", msg.adapter, error)
            self._answers.put(p.AdapterLoaded(msg.replica_id, msg.adapter, error, self.loaded))

    def _load(self, msg: p.LoadAdapter) -> None:
        path = stage_adapter(msg.adapter, msg.source, msg.manifest, self.cache_dir)
        status, text = _post(
            self.vllm_url + "/v1/load_lora_adapter",
            {"lora_name": msg.adapter, "lora_path": str(path)},
            self.http_timeout_s,
            self._token,
        )
        if status != 200 and "already been loaded" not in text:
            raise RuntimeError(f"vLLM answered {status} to loading {msg.adapter}: {text[:300]}")
        with self._lock:
            self._loaded.append(msg.adapter)
        log.info("LoRA adapter %s loaded into vLLM", msg.adapter)

    def _unload(self, name: str) -> None:
        status, text = _post(
            self.vllm_url + "/v1/unload_lora_adapter",
            {"lora_name": name},
            self.http_timeout_s,
            self._token,
        )
        if status not in (200, 404):
            raise RuntimeError(f"vLLM answered {status} to unloading {name}: {text[:300]}")
        with self._lock:
            if name in self._loaded:
                self._loaded.remove(name)
        log.info("LoRA adapter %s unloaded", name)
