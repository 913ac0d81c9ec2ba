"""The hostile and careless clients of benchmarks/chaos.py (issue 11), run in a process of their
own so that their own CPU use does not slow the normal clients' measurements:

    python benchmarks/chaos_hostile.py http://127.0.0.1:8000 --seconds 100 --sessions 32

Each pattern loops until the time is up and counts what the server answered (a refusal as its
status and the field it names, `400 response_format`); the counts are printed as one JSON
object. `--only CLASS[,CLASS]` runs just those patterns (method names of Hostile: grammars,
burst, ...), `--skip` leaves some out. Localhost only: the URL must be a loopback address.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlparse

import httpx
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

Counts = Counter[str]

BIG_PROMPT = json.dumps({"prompt": "To be, or not to be, that is the question. " * 160_000,
                         "max_tokens": 16}).encode()  # 7 MB
STOP_BOMB = json.dumps({"prompt": "Hello", "max_tokens": 16, "n": 64,
                        "stop_token_ids": list(range(800_000))}).encode()  # 6 MB
GARBAGE: list[dict[str, Any]] = [
    {"top_k": 2**63}, {"seed": 2**64}, {"temperature": 1e308}, {"repetition_penalty": 1e-300},
    {"logit_bias": {str(i): 100 for i in range(5000)}}, {"stop": ["x" * 50_000]},
    {"priority": -1000}, {"max_tokens": 2**70}, {"prompt": ""}, {"prompt": [10**9]},
    {"prompt": ["a"] * 256, "n": 64}, {"min_tokens": 10**12},
]


def outcome(r: httpx.Response) -> str:
    """The status, and for a refusal the field its error names (`400 tools`): a grammar
    refused for the right field, not one the client never sent."""
    if r.status_code < 400:
        return str(r.status_code)
    try:
        param = r.json()["error"].get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        param = None
    return f"{r.status_code} {param}" if param else str(r.status_code)


class Hostile:
    def __init__(self, url: str, seconds: float, sessions: int,
                 skip: tuple[str, ...] = (), only: tuple[str, ...] = ()) -> None:
        self.skip = skip
        self.only = only
        self.url = url
        parsed = urlparse(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.ws_url = url.replace("http", "ws", 1) + "/v1/sessions"
        self.deadline = time.monotonic() + seconds
        self.num_sessions = sessions
        # The chaos run's server has sessions // 2 slots (chaos.py: 2 x slots sessions).
        self.wide_n = max(1, min(64, sessions // 4))
        self.counts: dict[str, Counts] = {}

    def count(self, pattern: str, outcome: object) -> None:
        self.counts.setdefault(pattern, Counter())[str(outcome)] += 1

    def runs(self, task: Any) -> bool:
        """Whether a pattern's coroutine is run: not skipped, and named by --only if given."""
        name = getattr(task, "__qualname__", "")
        return (not any(k in name for k in self.skip)
                and (not self.only or any(k in name for k in self.only)))

    def alive(self) -> bool:
        return time.monotonic() < self.deadline

    async def every(self, period: float, fn: Callable[[], Awaitable[None]]) -> None:
        while self.alive():
            with contextlib.suppress(Exception):
                await fn()
            await asyncio.sleep(period)

    # ----- HTTP ------------------------------------------------------------------------------

    async def post(self, http: httpx.AsyncClient, pattern: str, body: bytes | dict[str, Any],
                   path: str = "/v1/completions") -> None:
        try:
            if isinstance(body, bytes):
                r = await http.post(path, content=body,
                                    headers={"content-type": "application/json"})
            else:
                r = await http.post(path, json=body)
            self.count(pattern, outcome(r))
        except httpx.HTTPError as exc:
            self.count(pattern, type(exc).__name__)

    async def burst(self, http: httpx.AsyncClient) -> None:
        """One client asks for an hour of work (256 prompts x n=64, as in the report), and
        keeps 8 requests of 8 sequences each in flight, as fast as they are answered."""
        hour = {"prompt": ["Friends, Romans, countrymen"] * 256, "n": 64, "max_tokens": 128,
                "user": "burst"}
        body = {"prompt": ["Friends, Romans, countrymen"] * 4, "n": 2, "max_tokens": 32,
                "user": "burst", "ignore_eos": True}

        async def one() -> None:
            while self.alive():
                await self.post(http, "burst_8_seqs", body)

        await asyncio.gather(self.every(1.0, lambda: self.post(http, "burst_16384_seqs", hour)),
                             *(one() for _ in range(8)))

    async def garbage(self, http: httpx.AsyncClient) -> None:
        rng = random.Random(1)

        async def one() -> None:
            await self.post(http, "numeric_and_list_garbage",
                            {"prompt": "Hi", "max_tokens": 4, **rng.choice(GARBAGE)})
        await self.every(0.2, one)

    async def grammars(self, http: httpx.AsyncClient) -> None:
        """Issue 22's grammars: a distinct memory-heavy pattern per request, first-token
        failures, a 0.9 MB schema, an ambiguous Lark grammar under n=64, a pydantic-style
        tool with $ref; each must be a 400 or a bounded 200, never a 500."""
        count = itertools.count(1)
        big = {"type": "object", "properties": {
            f"p{i}": {"type": "string", "pattern": f"^[a-z]{{1,{i % 40 + 1}}}$"}
            for i in range(12_000)}}
        addr = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"], "additionalProperties": False}
        ref_tool = {"type": "function", "function": {"name": "visit", "parameters": {
            "$defs": {"Addr": addr}, "type": "object", "required": ["home"],
            "properties": {"home": {"$ref": "#/$defs/Addr"}}}}}

        def so(spec: dict[str, Any], **kw: Any) -> dict[str, Any]:
            return {"prompt": "Hi", "max_tokens": 16, "user": "grammar",
                    "structured_outputs": spec, **kw}

        async def memory() -> None:
            n = next(count)
            await self.post(http, "grammar_memory_distinct", so({"json": {
                "type": "string", "pattern": f"^((a{{100}}){{100}}){{{n}}}$"}}))

        async def first_token() -> None:
            await self.post(http, "grammar_first_token_failure", so(random.choice([
                {"regex": "a{1000000}"}, {"grammar": 'start: "a"~1000000'},
                {"grammar": 'start: "a" start'}, {"regex": "((a{50}){50}){50}"}])))

        async def ref_tools() -> None:
            await self.post(http, "tool_with_ref", {
                "messages": [{"role": "user", "content": "Hi"}], "tools": [ref_tool],
                "tool_choice": "required", "max_tokens": 32, "user": "grammar"},
                "/v1/chat/completions")

        await asyncio.gather(
            self.every(0.5, memory), self.every(0.5, first_token),
            self.every(5.0, lambda: self.post(http, "grammar_0.9MB_schema", so({"json": big}))),
            # n as large as the server's slots let one client have (the n=64 needs
            # 64 slots; past them it is a 400 for n, and no mask is ever filled).
            self.every(5.0, lambda: self.post(http, "grammar_ambiguous_wide", so(
                {"grammar": 'start: s\ns: s s | "a" | "b"'}, n=self.wide_n))),
            self.every(2.0, ref_tools))

    async def admin_and_auth(self, http: httpx.AsyncClient) -> None:
        async def one() -> None:
            r = await http.post("/reset_prefix_cache?reset_running_requests=true")
            self.count("admin_endpoint", r.status_code)
        await self.every(1.0, one)

    # ----- raw sockets -----------------------------------------------------------------------

    async def hold_socket(self, pattern: str, payload: bytes, dribble: bool) -> None:
        """Open a connection, send `payload` (a byte a second when dribbling) and wait for the
        server to give up on it; then again."""
        while self.alive():
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            except OSError as exc:
                self.count(pattern, type(exc).__name__)
                await asyncio.sleep(1)
                continue
            start = time.monotonic()
            try:
                if dribble:
                    for b in payload:
                        writer.write(bytes([b]))
                        await writer.drain()
                        try:
                            data = await asyncio.wait_for(reader.read(65536), 1.0)
                            break
                        except TimeoutError:
                            continue
                    else:
                        data = await reader.read(65536)
                else:
                    writer.write(payload)
                    await writer.drain()
                    data = await asyncio.wait_for(reader.read(65536), 600)
                status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP") else "closed"
                self.count(pattern, f"{status} after {round(time.monotonic() - start)}s")
            except (OSError, TimeoutError) as exc:
                self.count(pattern, type(exc).__name__)
            finally:
                writer.close()

    async def disconnect_mid_upload(self) -> None:
        async def one() -> None:
            _, writer = await asyncio.open_connection(self.host, self.port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 100000\r\n\r\n{\"prompt\": \""
                         + b"x" * 30_000)
            await writer.drain()
            writer.close()
            self.count("disconnect_mid_upload", "sent")
        await self.every(0.2, one)

    # ----- WebSockets ------------------------------------------------------------------------

    async def idle_session(self) -> None:
        """A session that runs one chunk and goes quiet: it holds a slot until the grace
        period lets a waiting request take it, and is ended after the idle timeout."""
        while self.alive():
            try:
                async with connect(self.ws_url, open_timeout=30, max_size=None) as ws:
                    await ws.recv()
                    await ws.send(json.dumps({"type": "input", "prompt": "Now is the winter",
                                              "max_tokens": 4, "ignore_eos": True}))
                    while self.alive():
                        try:
                            msg = json.loads(await asyncio.wait_for(ws.recv(), 1.0))
                        except TimeoutError:
                            continue
                        if msg["type"] == "session.done":
                            self.count("idle_session", f"ended: {msg['reason']}")
                            break
            except (OSError, WebSocketException) as exc:
                self.count("idle_session", type(exc).__name__)
                await asyncio.sleep(1)

    async def ws_abuse(self) -> None:
        big = "x" * 6_000_000
        rng = random.Random(2)

        async def one() -> None:
            kind = rng.choice(["big_frame", "binary_and_flood", "after_end", "empty_first"])
            try:
                async with connect(self.ws_url, open_timeout=30, max_size=None) as ws:
                    await ws.recv()
                    if kind == "big_frame":
                        await ws.send(json.dumps({"type": "input", "prompt": big}))
                        await ws.recv()
                    elif kind == "binary_and_flood":
                        await ws.send(b"\x00\xffbinary")
                        msg = json.loads(await ws.recv())
                        self.count("ws_binary_frame", msg.get("error", {}).get("code"))
                        for i in range(1000):
                            await ws.send(json.dumps({"type": "input", "max_tokens": 1,
                                                      "prompt": [1, 300 + i % 50]}))
                        self.count("ws_flood_then_close", "closed")
                        return
                    else:
                        prompt = "Once more" if kind == "after_end" else ""
                        await ws.send(json.dumps({"type": "input", "prompt": prompt,
                                                  "max_tokens": 2}))
                        await ws.send(json.dumps({"type": "end"}))
                        await ws.send(json.dumps({"type": "input", "prompt": "late",
                                                  "max_tokens": 2}))
                        codes = []
                        while True:
                            msg = json.loads(await ws.recv())
                            if msg["type"] == "error":
                                codes.append(msg["error"]["code"] or msg["error"]["param"])
                            if msg["type"] == "session.done":
                                break
                        self.count("ws_" + kind, ",".join(codes))
            except ConnectionClosed as exc:
                self.count("ws_" + kind, f"close {exc.rcvd.code if exc.rcvd else None}")
            except InvalidStatus as exc:
                self.count("ws_" + kind, exc.response.status_code)
        await self.every(1.0, one)

    async def run(self) -> dict[str, dict[str, int]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=self.url, timeout=120, limits=limits) as http:
            request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                       b"application/json\r\nContent-Length: 1000\r\n\r\n")
            tasks = [
                self.burst(http), self.garbage(http), self.admin_and_auth(http),
                self.grammars(http),
                self.every(3.0, lambda: self.post(http, "prompt_7MB", BIG_PROMPT)),
                self.every(3.0, lambda: self.post(http, "stop_token_ids_800k", STOP_BOMB)),
                self.every(3.0, lambda: self.post(
                    http, "chat_7MB", {"messages": [{"role": "user", "content": "ab " * 2_300_000}]},
                    "/v1/chat/completions")),
                *(self.hold_socket("idle_socket", b"", False) for _ in range(300)),
                *(self.hold_socket("slow_headers", request, True) for _ in range(40)),
                *(self.hold_socket("slow_body", request + b"{\"prompt\": ", False)
                  for _ in range(20)),
                self.disconnect_mid_upload(),
                *(self.idle_session() for _ in range(self.num_sessions)),
                self.ws_abuse(),
            ]
            running = [asyncio.ensure_future(t) for t in tasks if self.runs(t)]
            for coro in tasks:
                if not self.runs(coro):
                    coro.close()  # a coroutine never started
            # Connections the server has not given up on by then are simply closed.
            _, pending = await asyncio.wait(running,
                                            timeout=self.deadline - time.monotonic() + 5)
            for t in pending:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        return {k: dict(v) for k, v in sorted(self.counts.items())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url")
    p.add_argument("--seconds", type=float, default=100.0)
    p.add_argument("--sessions", type=int, default=32, help="idle WebSocket sessions held")
    p.add_argument("--skip", default="", help="patterns left out, comma separated (method "
                   "names of Hostile: burst, garbage, hold_socket, idle_session, ...)")
    p.add_argument("--only", default="", help="run only these patterns, comma separated "
                   "(the same names as --skip: grammars, burst, ws_abuse, ...)")
    p.add_argument("--ready-line", action="store_true", help="print `ready` once imported, "
                   "before any pattern starts (chaos.py starts its phase then)")
    a = p.parse_args()
    if urlparse(a.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        print("chaos_hostile talks to localhost only", file=sys.stderr)
        return 2
    skip = tuple(k for k in a.skip.split(",") if k)
    only = tuple(k for k in a.only.split(",") if k)
    if a.ready_line:
        print("ready", flush=True)
    counts = asyncio.run(Hostile(a.url, a.seconds, a.sessions, skip, only).run())
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
