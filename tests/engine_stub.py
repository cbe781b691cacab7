"""An engine stub for gateway tests: a small HTTP server on loopback that records each POST
body's bytes and answers it as a subclass says (the real vLLM engines are in
tests/integration/)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
JSON = "application/json"
EVENT_STREAM = "text/event-stream"


def chat_answer(content: str, finish_reason: str, **extra: Any) -> bytes:
    """A chat completion of model "m" with USAGE."""
    return json.dumps({
        "id": "c", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": finish_reason,
                     "message": {"role": "assistant", "content": content}}],
        "usage": USAGE, **extra,
    }).encode()  # fmt: skip


def chat_stream(events: list[dict[str, Any]]) -> bytes:
    """Chat completion chunks of model "m" (each event's choices, usage...), then [DONE]."""
    return b"".join(
        b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk",
                                 "created": 0, "model": "m", **e}).encode() + b"\n\n"
        for e in events
    ) + b"data: [DONE]\n\n"  # fmt: skip


class StubEngine:
    """Records each request body's bytes in `raw`; answers with `answer` (on the server's
    thread, one per request)."""

    def __init__(self) -> None:
        self.raw: list[bytes] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                engine.raw.append(body)
                status, media, data = engine.answer(body)
                self.send_response(status)
                self.send_header("content-type", media)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, body: bytes) -> tuple[int, str, bytes]:
        """(status, content type, bytes) for a request body."""
        raise NotImplementedError

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
