"""`slotserve serve` as a user runs it: a real process with the bundled model (its engine core in
a child process, the default), driven over HTTP and WebSocket, stopped by SIGINT (Ctrl-C) and
by SIGTERM: exit code 0 and no process of its family left. The limit flags, `--no-webui` and
`--tool-call-parser` are shown to reach the server by what it then does. The refusals at
startup are checked in-process, and one as the CLI in a subprocess with a deadline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.helpers import REPO, serve_process, wait_until

PING = {"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


def _family(pid: int) -> set[int]:
    """Every live descendant of pid (the engine core, multiprocessing's helpers)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited (reaping it is its new parent's business)


def _stop(proc: subprocess.Popen[str], sig: signal.Signals) -> None:
    """Signal the server; it must shut down gracefully, leave no process behind and exit
    cleanly: 0 for SIGINT, which the CLI catches; for SIGTERM uvicorn re-raises the signal
    once it has shut down (so a supervisor sees how it ended), which is 0 or -SIGTERM."""
    family = _family(proc.pid)
    assert family, "the engine core should run in a child process"
    proc.send_signal(sig)
    code = proc.wait(60)
    err = proc.stderr.read() if proc.stderr else ""
    wait_until(lambda: not any(_alive(p) for p in family), 15,
               f"the server's children {sorted(family)} to exit")
    assert code in ((0,) if sig == signal.SIGINT else (0, -sig)), (code, err[-3000:])
    assert "Application shutdown complete" in err, err[-3000:]
    assert "Traceback" not in err and " ERROR " not in err, err[-3000:]


def _client(base: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.timeout(600)
def test_serve_with_its_flags_then_sigint() -> None:
    with serve_process("--threads", "1", "--max-request-body-bytes", "4096",
                       "--max-ws-message-bytes", "2048", "--max-waiting-seqs", "8",
                       "--max-client-share", "0.5", "--tool-call-parser", "llama3_json",
                       "--served-model-name", "bard") as (proc, base):
        c = _client(base)
        assert [m.id for m in c.models.list().data] == ["bard"]
        out = c.completions.create(model="bard", prompt="To be, or not", max_tokens=4,
                                   temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
        # --max-request-body-bytes 4096: a 5 kB body is refused unread.
        body = json.dumps({"model": "bard", "prompt": "a" * 5000}).encode()
        r = httpx.post(f"{base}/v1/completions", content=body, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        # --max-waiting-seqs 8 with --max-client-share 0.5: 4 sequences a client, so n=5 can
        # never be admitted.
        r = httpx.post(f"{base}/v1/completions", timeout=30, json={
            "model": "bard", "prompt": "To be", "max_tokens": 2, "n": 5})
        assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large", r.text
        # --max-ws-message-bytes 2048: a 3 kB message closes the session with 1009.
        with connect(f"{base.replace('http', 'ws')}/v1/sessions", open_timeout=30) as ws:
            json.loads(ws.recv(timeout=30))
            ws.send(json.dumps({"type": "input", "prompt": "x" * 3000, "max_tokens": 1}))
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
        # --tool-call-parser llama3_json: the bundled model's template knows no tool-call
        # format, so without the flag tools are refused; with it a call is forced and parsed.
        chat = c.chat.completions.create(
            model="bard", messages=[{"role": "user", "content": "Ping, please."}],
            tools=[PING], tool_choice="required", parallel_tool_calls=False, max_tokens=64,
            temperature=0)
        (call,) = chat.choices[0].message.tool_calls or []
        assert call.function.name == "ping" and json.loads(call.function.arguments) == {}
        assert chat.choices[0].finish_reason == "tool_calls"
        _stop(proc, signal.SIGINT)


@pytest.mark.timeout(600)
def test_serve_without_the_web_page_then_sigterm() -> None:
    """`--no-webui` with a key: no page (its paths need the key like any other path), the
    engine state still served (from the engine child); then SIGTERM."""
    key = "sigterm-key"
    auth = {"Authorization": f"Bearer {key}"}
    with serve_process("--threads", "1", "--no-webui", "--api-key", key, "--max-num-seqs", "2",
                       "--num-blocks", "32") as (proc, base):
        assert httpx.get(f"{base}/", timeout=30).status_code == 401
        assert httpx.get(f"{base}/", headers=auth, timeout=30).status_code == 404
        assert httpx.get(f"{base}/webui/app.js", headers=auth, timeout=30).status_code == 404
        state = httpx.get(f"{base}/v1/engine/state", headers=auth, timeout=30).json()
        assert state["max_num_seqs"] == 2 and state["num_blocks"] == 31
        c = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
        (model,) = [m.id for m in c.models.list().data]
        out = c.completions.create(model=model, prompt="Now is the winter", max_tokens=3,
                                   temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
        _stop(proc, signal.SIGTERM)


REFUSED: list[tuple[list[str], dict[str, str], str]] = [
    (["--api-key", ""], {}, "--api-key (or its environment variable) is empty"),
    (["--api-key", "   "], {}, "--api-key (or its environment variable) is empty"),
    ([], {"SLOTSERVE_API_KEY": ""}, "--api-key (or its environment variable) is empty"),
    (["--api-key", "k", "--admin-api-key", ""], {}, "--admin-api-key (or its environment"),
    (["--enable-admin-endpoints"], {}, "--enable-admin-endpoints needs --admin-api-key"),
]


@pytest.mark.parametrize(("argv", "env", "message"), REFUSED,
                         ids=["empty", "blank", "empty-env", "empty-admin", "admin-no-key"])
def test_empty_keys_are_refused_at_startup(argv: list[str], env: dict[str, str], message: str,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Each refused before the engine starts: exit code 2 and one error line. In-process (the
    parser reads the keys' environment variables when it is built); the engine's constructor
    fails the test if the refusal comes too late. The CLI in a subprocess: the test below."""
    from slotserve.entrypoints.async_llm import AsyncLLM
    from slotserve.entrypoints.cli import main

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine was started")

    monkeypatch.setattr(AsyncLLM, "from_engine_args", started)
    for k in ("SLOTSERVE_API_KEY", "SLOTSERVE_ADMIN_API_KEY"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["serve", *argv, "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, (argv, err)


def test_an_empty_key_from_the_environment_is_refused_by_the_cli_process() -> None:
    """As a user runs it: `slotserve serve` with SLOTSERVE_API_KEY set but empty exits 2 with
    one error line, well within a deadline no model load would meet."""
    argv, env, message = REFUSED[2]
    clean = {k: v for k, v in os.environ.items()
             if k not in ("SLOTSERVE_API_KEY", "SLOTSERVE_ADMIN_API_KEY")}
    proc = subprocess.run(
        [sys.executable, "-m", "slotserve.entrypoints.cli", "serve", *argv, "--port", "1"],
        cwd=REPO, env={**clean, "PYTHONPATH": str(REPO), **env},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=90)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"error: {message}") and proc.stderr.count("\n") == 1, \
        proc.stderr
