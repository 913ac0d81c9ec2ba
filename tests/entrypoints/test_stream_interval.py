"""`--stream-interval N` (vLLM's stream_interval) on the one-process server: a stream's SSE
events go on in batches of N after the first, the last never held back, so a client gets the
same text in about N times fewer HTTP chunks. Through a real server and the official `openai`
client (its HTTP transport counting the chunks of each reply's body), in process on the
shared engine and as `slotserve serve --stream-interval 4`; a bad value is refused at
startup. The rule itself is the Ray path's too (tests/ray/test_coalesce.py)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from slotserve.entrypoints.openai.api_server import build_app
from slotserve.entrypoints.openai.stream_interval import StreamInterval
from slotserve.errors import ConfigError
from tests.entrypoints.conftest import MODEL_NAME, Served, start_server
from tests.helpers import serve_process

NUM_TOKENS = 48


class _CountedStream(httpx.SyncByteStream):
    def __init__(self, stream: httpx.SyncByteStream, counts: list[int]) -> None:
        self.stream, self.counts = stream, counts

    def __iter__(self) -> Iterator[bytes]:
        for part in self.stream:
            self.counts[-1] += 1
            yield part

    def close(self) -> None:
        self.stream.close()


class ChunkCounter(httpx.HTTPTransport):
    """An HTTP transport that counts the chunks each reply's body arrives in (one per write
    of the server: h11 hands out a chunked body chunk by chunk); `counts[-1]`, the last."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: list[int] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        assert isinstance(response.stream, httpx.SyncByteStream)
        self.counts.append(0)
        response.stream = _CountedStream(response.stream, self.counts)
        return response


def streamed_and_whole(base: str, model: str) -> tuple[str, str, int]:
    """(the streamed text, the same completion unstreamed, the stream's body chunks)."""
    counter = ChunkCounter()
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                           timeout=120, http_client=httpx.Client(transport=counter))
    args = dict(model=model, prompt="To be, or not to be", max_tokens=NUM_TOKENS,
                temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(stream=True, **args))  # type: ignore[call-overload]
    streamed_chunks = counter.counts[-1]
    assert chunks[-1].choices[0].finish_reason == "length"
    whole = client.completions.create(**args)  # type: ignore[call-overload]
    assert whole.usage is not None and whole.usage.completion_tokens == NUM_TOKENS
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, whole.choices[0].text, streamed_chunks


def test_the_rule_sends_the_first_then_every_interval_and_the_last() -> None:
    rule = StreamInterval(3)
    assert [rule.due(1) for _ in range(7)] == [True, False, False, True, False, False, True]
    assert rule.due(1, last=True)  # the last goes whatever the count
    assert not rule.due(0, last=True)  # nothing held: nothing to send
    assert all(StreamInterval(1).due(1) for _ in range(3))
    late = StreamInterval(3)
    assert not late.due(0) and late.due(1)  # the first goes once there is something


def test_a_stream_goes_in_batches_of_the_interval(served: Served) -> None:
    app = build_app(served.engine, served_model_names=[MODEL_NAME], shutdown_engine=False,
                    stream_interval=4)
    batched = start_server(served.loop, app)
    try:
        text4, whole4, chunks4 = streamed_and_whole(batched.base_url, MODEL_NAME)
    finally:
        batched.stop()
    text1, whole1, chunks1 = streamed_and_whole(served.url, MODEL_NAME)
    assert text4 == whole4 == text1 == whole1 != ""
    # One chunk per engine output at interval 1 (AsyncLLM may merge outputs a slow reader
    # left queued); at 4: the first, one per 4 outputs after it, the rest with [DONE].
    assert chunks4 <= NUM_TOKENS // 4 + 3, (chunks4, chunks1)
    assert chunks4 * 2 < chunks1, (chunks4, chunks1)


@pytest.mark.timeout(600)
def test_serve_with_a_stream_interval() -> None:
    with serve_process("--threads", "1", "--stream-interval", "4",
                       "--served-model-name", "bard") as (_, base):
        text, whole, chunks = streamed_and_whole(base, "bard")
    assert text == whole != ""
    assert chunks <= NUM_TOKENS // 4 + 3, chunks


@pytest.mark.parametrize("argv", [["--stream-interval", "0"], ["--stream-interval", "-3"],
                                  ["--stream-interval", "0", "--data-parallel-size", "2"]])
def test_a_bad_interval_is_refused_at_startup(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Exit code 2 and one error line, before any engine (or Ray) starts."""
    from slotserve.entrypoints.async_llm import AsyncLLM
    from slotserve.entrypoints.cli import main

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine was started")

    monkeypatch.setattr(AsyncLLM, "from_engine_args", started)
    assert main(["serve", *argv, "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: stream_interval (--stream-interval) must be an integer of "
                          "at least 1") and err.count("\n") == 1, err
    with pytest.raises(ConfigError, match="at least 1"):
        build_app(object(), served_model_names=["m"],  # type: ignore[arg-type]
                  stream_interval=int(argv[1]))
