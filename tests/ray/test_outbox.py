"""Streamed answers' later batches travel many per message (no cluster): a replica's `Outbox`
takes them from several answers, one drain message carries them all, the ingress's `Mux`
hands each to its answer, and the `Relay` sends an answer whole and in order, then stops."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from slotserve.ray.outbox import OUTBOXED, Batch, Mux, Outbox, split  # noqa: E402
from slotserve.ray.relay import Relay  # noqa: E402
from slotserve.ray.server import REPLICA_HEADER  # noqa: E402

REPLICA = "r1"
START = {"type": "http.response.start", "status": 200,
         "headers": [(REPLICA_HEADER.encode(), REPLICA.encode())]}


def body(text: str, more: bool = True) -> dict[str, Any]:
    return {"type": "http.response.body", "body": text.encode(), "more_body": more}


def answer(tokens: list[str]) -> list[Batch]:
    return [[START, body(tokens[0])], *[[body(t)] for t in tokens[1:-1]],
            [body(tokens[-1], more=False)]]


class Call:
    """An answer's own call as the ingress sees it (Ray's generator: iterate, cancel)."""

    def __init__(self, batches: AsyncIterator[Batch]) -> None:
        self.batches, self.cancelled = batches, False

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> Batch:
        return await self.batches.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


async def paced(batches: list[Batch], delay: float) -> AsyncIterator[Batch]:
    for b in batches:
        yield b
        await asyncio.sleep(delay)


def test_split_sends_the_first_batch_and_counts_the_rest() -> None:
    async def go() -> tuple[list[Batch], list[tuple[str, Batch]]]:
        box = Outbox()
        own = [b async for b in split(paced(answer(["a", "b", "c"]), 0), box, "s1")]
        return own, box.items

    own, boxed = asyncio.run(go())
    assert own == [[START, body("a")], [{"type": OUTBOXED, "count": 2}]]
    assert boxed == [("s1", [body("b")]), ("s1", [body("c", more=False)])]
    # A whole answer in its first batch sends nothing to the outbox and no count.
    single = [[START, body("{}", more=False)]]
    assert asyncio.run(_split_all(single)) == single


async def _split_all(batches: list[Batch]) -> list[Batch]:
    return [b async for b in split(paced(batches, 0), Outbox(), "s")]


def test_one_drain_message_carries_every_answer_of_a_step_and_ends_with_them() -> None:
    async def go() -> list[list[tuple[str, Batch]]]:
        box = Outbox()
        answers = {f"s{i}": answer(["x", f"{i}a", f"{i}b"]) for i in range(8)}

        async def one(sid: str) -> None:
            async for _ in split(paced(answers[sid], 0.05), box, sid):
                pass

        tasks = [asyncio.create_task(one(sid)) for sid in answers]
        await asyncio.sleep(0.01)  # every answer is streaming
        messages = [m async for m in box.drain()]  # returns once all have ended
        await asyncio.gather(*tasks)
        return messages

    messages = asyncio.run(go())
    # Two later batches per answer, eight answers: one message per "step", not per token.
    assert len(messages) == 2
    assert all(len(m) == 8 for m in messages)
    assert sorted(sid for sid, _ in messages[1]) == [f"s{i}" for i in range(8)]


def test_relay_sends_each_answer_whole_through_the_mux() -> None:
    async def go() -> dict[str, bytes]:
        box = Outbox()
        drains = []

        def open_drain(replica: str) -> AsyncIterator[list[tuple[str, Batch]]]:
            assert replica == REPLICA
            drains.append(replica)
            return box.drain()

        mux = Mux(open_drain)
        out: dict[str, bytes] = {}

        async def client(sid: str) -> None:
            mux.register(sid)
            call = Call(split(paced(answer([f"{sid}:", *"abcdef", "!"]), 0.01), box, sid))
            first = await call.__anext__()
            sent: list[dict[str, Any]] = []

            async def send(message: Any) -> None:
                sent.append(message)

            await Relay(first, call, mux, sid)(  # type: ignore[arg-type]
                {"type": "http"}, _never, send)
            assert sent[-1]["more_body"] is False and not call.cancelled
            out[sid] = b"".join(m.get("body", b"") for m in sent)

        await asyncio.gather(*(client(f"s{i}") for i in range(5)))
        assert not mux.queues and drains  # every answer unregistered; the pump ran
        await asyncio.sleep(0.05)
        assert not mux.pumps  # and it stopped with nothing streaming
        return out

    out = asyncio.run(go())
    assert out == {f"s{i}": f"s{i}:abcdef!".encode() for i in range(5)}


async def _never() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {}


def test_a_replica_dying_mid_answer_ends_it_with_an_error_event() -> None:
    from ray.exceptions import RayActorError

    async def dies() -> AsyncIterator[Batch]:
        yield [START, body("a")]
        await asyncio.sleep(0.01)
        raise RayActorError()

    async def go() -> tuple[list[dict[str, Any]], Mux]:
        box = Outbox()
        mux = Mux(lambda replica: box.drain())
        mux.register("s")
        call = Call(dies())
        first = await call.__anext__()
        sent: list[dict[str, Any]] = []

        async def send(message: Any) -> None:
            sent.append(message)

        await Relay(first, call, mux, "s")(  # type: ignore[arg-type]
            {"type": "http"}, _never, send)
        return sent, mux

    sent, mux = asyncio.run(go())
    assert sent[:2] == [START, body("a")]
    assert sent[-1]["more_body"] is False and b"replica_died" in sent[-1]["body"]
    assert not mux.queues
