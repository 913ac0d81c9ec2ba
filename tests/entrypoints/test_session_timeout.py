"""An idle paused session times out inside a running AsyncLLM: the engine loop ticks
schedule() while sessions are paused, even with no other work."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from slotserve.entrypoints.async_llm import AsyncLLM, StreamingInput
from slotserve.sampling_params import SamplingParams


def test_idle_paused_session_times_out_in_the_engine_loop() -> None:
    engine = AsyncLLM.from_engine_args(streaming_session_timeout_s=0.5, num_blocks=64,
                                       max_num_seqs=4, check=True)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    never = asyncio.Event()

    async def chunks() -> AsyncIterator[StreamingInput]:
        yield StreamingInput("To be, or not", params)
        await never.wait()  # the client goes quiet without ending the session

    async def run() -> tuple[int, int, float]:
        async def consume() -> None:
            async for _ in engine.generate(chunks(), params, "idle-session"):
                pass

        task = asyncio.create_task(consume())
        paused = 0
        for _ in range(100):  # the first chunk runs, then the session pauses
            await asyncio.sleep(0.05)
            paused = (await engine.get_stats()).num_paused_sessions
            if paused:
                break
        for _ in range(100):  # then the idle timeout ends it: nothing else wakes the loop
            await asyncio.sleep(0.1)
            stats = await engine.get_stats()
            if stats.num_paused_sessions == 0:
                break
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return paused, stats.num_paused_sessions, stats.kv_cache_usage

    try:
        paused, after, usage = asyncio.run(run())
    finally:
        engine.shutdown()
    assert paused == 1
    assert after == 0 and usage == 0.0
