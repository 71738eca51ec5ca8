"""A tiny OpenAI-compatible streaming server on asyncio streams, for the bench tests.

POST /v1/completions streams `max_tokens` chunks ("t0 ", "t1 ", ...) `--delay-ms` apart, then a
usage chunk when asked, then `data: [DONE]`. POST /v1/chat/completions wants `messages` (a 400
without them) and streams as OpenAI's chat does: a role-only chunk, `max_completion_tokens` (or
`max_tokens`) content deltas, an empty delta with finish_reason; its usage counts
`CHAT_TEMPLATE_TOKENS` more prompt tokens than the messages' words, as a chat template adds some.
A prompt containing "FAIL" gets an HTTP 500, one containing "EMPTY" a finished stream without text
(as when EOS comes first).
GET /health, /v1/models and /metrics (a `fake:requests_total` counter) answer too. One request
per connection (`Connection: close`), chunked transfer encoding.

Run in a thread (`FakeServer().start()`) or as a script (`python fake_server.py --port P`, which
the sweep test starts and stops with SIGINT).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading

CHAT_TEMPLATE_TOKENS = 3


class FakeServer:
    def __init__(self, delay_s: float = 0.002, port: int = 0):
        self.delay_s = delay_s
        self.port = port
        self.payloads: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None

    # -- running in a background thread (tests) --
    def start(self) -> FakeServer:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self.handle, "127.0.0.1", self.port))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert ready.wait(10), "fake server did not start"
        return self

    def stop(self) -> None:
        assert self._loop is not None and self._server is not None

        async def close() -> None:
            self._server.close()
            await self._server.wait_closed()
            asyncio.get_running_loop().stop()

        asyncio.run_coroutine_threadsafe(close(), self._loop)
        self._thread.join(10)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- HTTP --
    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            method, path, _ = request_line.split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (h.partition(":") for h in header_lines if h)}
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            if method == "POST" and path == "/v1/completions":
                await self.completions(json.loads(body), writer)
            elif method == "POST" and path == "/v1/chat/completions":
                await self.chat_completions(json.loads(body), writer)
            elif path == "/health":
                await self.respond(writer, 200, b"")
            elif path == "/v1/models":
                await self.respond(writer, 200, json.dumps(
                    {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}).encode())
            elif path == "/metrics":
                text = ("# TYPE fake:requests_total counter\n"
                        f"fake:requests_total {len(self.payloads)}\n")
                await self.respond(writer, 200, text.encode(), "text/plain")
            else:
                await self.respond(writer, 404, b'{"error": {"message": "not found"}}')
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def respond(self, writer, status: int, body: bytes,
                      content_type: str = "application/json") -> None:
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: "
                     f"{len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()

    async def completions(self, payload: dict, writer: asyncio.StreamWriter) -> None:
        self.payloads.append(payload)
        await self.stream(payload, writer, payload["prompt"], int(payload.get("max_tokens", 16)),
                          chat=False)

    async def chat_completions(self, payload: dict, writer: asyncio.StreamWriter) -> None:
        self.payloads.append(payload)
        if "messages" not in payload:
            await self.respond(writer, 400, b'{"error": {"message": "missing messages"}}')
            return
        prompt = " ".join(m["content"] for m in payload["messages"])
        n = payload.get("max_completion_tokens", payload.get("max_tokens", 16))
        await self.stream(payload, writer, prompt, int(n), chat=True)

    async def stream(self, payload: dict, writer: asyncio.StreamWriter, prompt: str, n: int,
                     chat: bool) -> None:
        if "FAIL" in prompt:
            await self.respond(writer, 500, b'{"error": {"message": "asked to fail"}}')
            return
        obj = "chat.completion.chunk" if chat else "text_completion"

        def choice(text: str | None, finish_reason: str | None) -> dict:
            if not chat:
                return {"index": 0, "text": text or "", "finish_reason": finish_reason}
            return {"index": 0, "delta": {} if text is None else {"content": text},
                    "finish_reason": finish_reason}

        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
            n = 0 if "EMPTY" in prompt else n
            if chat:  # the role comes first, before any token
                role = {"index": 0, "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None}
                await self.event(writer, {"object": obj, "choices": [role]})
            if n == 0:  # EOS first: one chunk with no text
                await self.event(writer, {"object": obj, "choices": [choice(None, "stop")]})
            for i in range(n):
                await asyncio.sleep(self.delay_s)
                last = i == n - 1
                finish = "length" if last and not chat else None
                await self.event(writer, {"object": obj, "choices": [choice(f"t{i} ", finish)]})
                if last and chat:  # chat ends a choice with an empty delta
                    await self.event(writer, {"object": obj, "choices": [choice(None, "length")]})
            if (payload.get("stream_options") or {}).get("include_usage"):
                num_prompt = len(prompt.split()) + (CHAT_TEMPLATE_TOKENS if chat else 0)
                usage = {"prompt_tokens": num_prompt, "completion_tokens": n,
                         "total_tokens": num_prompt + n}
                await self.event(writer, {"choices": [], "usage": usage})
            await self.event(writer, "[DONE]")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        finally:
            self.in_flight -= 1

    async def event(self, writer: asyncio.StreamWriter, data: dict | str) -> None:
        text = data if isinstance(data, str) else json.dumps(data)
        chunk = f"data: {text}\n\n".encode()
        writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        await writer.drain()


async def _serve_forever(server: FakeServer) -> None:
    s = await asyncio.start_server(server.handle, "127.0.0.1", server.port)
    async with s:
        await s.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, default=2.0)
    args, _unknown = parser.parse_known_args()  # server flags of a sweep setting: ignored
    with contextlib.suppress(KeyboardInterrupt):  # the sweep stops us with SIGINT
        asyncio.run(_serve_forever(FakeServer(args.delay_ms / 1000.0, args.port)))
