"""AsyncLLM directly: delta outputs, cancellation and abort, streaming-input sessions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from slotserve.entrypoints.async_llm import StreamingInput, merge_deltas
from slotserve.errors import RequestValidationError
from slotserve.outputs import CompletionOutput, RequestOutput
from slotserve.sampling_params import SamplingParams
from tests.entrypoints.conftest import Served, is_drained

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def out(text: str, tokens: list[int], finish: str | None = None,
        finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [], [CompletionOutput(0, text, tokens, None, None, finish)],
                         finished)


def test_merge_deltas_never_crosses_a_chunk_boundary() -> None:
    merged = merge_deltas([out("a", [1]), out("b", [2], "length"), out("c", [3]),
                           out("d", [4]), out("", [], "stop", finished=True)])
    assert [(m.outputs[0].text, m.outputs[0].token_ids, m.outputs[0].finish_reason)
            for m in merged] == [("ab", [1, 2], "length"), ("cd", [3, 4], "stop")]
    assert merged[-1].finished


def test_deltas_add_up_to_the_full_output(any_mode: Served) -> None:
    engine = any_mode.engine
    prompt_ids = engine.tokenize("To be, or not")

    async def run() -> tuple[str, list[int], list[str | None]]:
        text, tokens, reasons = "", [], []
        async for o in engine.generate("To be, or not", GREEDY):
            # The prompt comes with every output, in process mode too.
            assert o.prompt == "To be, or not" and o.prompt_token_ids == prompt_ids
            text += o.outputs[0].text
            tokens += o.outputs[0].token_ids
            reasons.append(o.outputs[0].finish_reason)
        return text, tokens, reasons

    text, tokens, reasons = any_mode.loop.run(run())
    again = any_mode.loop.run(run())
    assert len(tokens) == 12 and reasons[-1] == "length" and set(reasons[:-1]) <= {None}
    assert (text, tokens) == again[:2]  # greedy: deterministic


def test_cancelled_consumer_frees_its_request(drained: Served) -> None:
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def run() -> None:
        async def consume() -> None:
            async for _ in drained.engine.generate("Friends, Romans", long, "cancel-me"):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Leaving early by `break` frees it too.
        async for _ in drained.engine.generate("Friends, Romans", long, "break-me"):
            break

    drained.loop.run(run())
    assert is_drained(drained.wait_drained())


def test_abort_ends_the_stream_with_abort(drained: Served) -> None:
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, n=2)

    async def run() -> list[RequestOutput]:
        outs = []
        async for o in drained.engine.generate("Friends, Romans", long, "abort-me"):
            outs.append(o)
            if len(outs) == 3:
                await drained.engine.abort("abort-me")
        return outs

    outs = drained.loop.run(run())
    assert outs[-1].finished
    assert [c.finish_reason for c in outs[-1].outputs] == ["abort", "abort"]


def test_duplicate_request_id_is_refused(drained: Served) -> None:
    async def run() -> None:
        gen = drained.engine.generate("Hello", GREEDY, "same-id")
        await gen.__anext__()
        with pytest.raises(RequestValidationError):
            async for _ in drained.engine.generate("Hello", GREEDY, "same-id"):
                pass
        await gen.aclose()

    drained.loop.run(run())


def test_session_ending_while_paused_adds_no_extra_finish(drained: Served) -> None:
    """The input ends only after the last chunk paused, and the consumer is slow: the
    engine's output for the session's end must not read as one more chunk finishing."""
    chunk = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def run() -> list[RequestOutput]:
        gate = asyncio.Event()

        async def inputs() -> AsyncIterator[StreamingInput]:
            yield StreamingInput("Now is the winter", chunk)
            yield StreamingInput([300, 301], chunk)
            await gate.wait()

        outs = []
        async for o in drained.engine.generate(inputs()):
            outs.append(o)
            if sum(c.finish_reason is not None for x in outs for c in x.outputs) == 2:
                gate.set()
                await asyncio.sleep(0.5)  # the end-of-session output arrives meanwhile
        return outs

    outs = drained.loop.run(run())
    finishes = [c.finish_reason for o in outs for c in o.outputs if c.finish_reason]
    assert finishes == ["length", "length"]
    assert sum(len(c.token_ids) for o in outs for c in o.outputs) == 6
