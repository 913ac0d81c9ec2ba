"""What startup built is frozen out of GC passes while the engine core loop and the server
run (gc_freeze), and given back to the collector when they end (so an engine built and
dropped in one process does not keep its model in frozen cycles)."""

from __future__ import annotations

import asyncio
import gc
import time

from fastapi.testclient import TestClient

from slotserve.entrypoints.async_llm import AsyncLLM
from slotserve.entrypoints.openai.api_server import build_app
from slotserve.sampling_params import SamplingParams


def small_engine() -> AsyncLLM:
    return AsyncLLM.from_engine_args(engine_mode="thread", threads=1, num_blocks=64,
                                     max_num_seqs=4, max_model_len=512, check=True, seed=0)


async def generate(llm: AsyncLLM) -> str:
    text = ""
    async for out in llm.generate("To be, or not", SamplingParams(max_tokens=4, temperature=0,
                                                                  ignore_eos=True)):
        text = out.outputs[0].text
    return text


def test_the_core_loop_freezes_while_it_runs_and_thaws_after() -> None:
    gc.unfreeze()
    llm = small_engine()
    try:
        deadline = time.monotonic() + 30
        while gc.get_freeze_count() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        frozen = gc.get_freeze_count()
        assert asyncio.run(generate(llm))  # steps go on, collections skip what was frozen
    finally:
        llm.shutdown()
    assert frozen > 1000, frozen
    assert gc.get_freeze_count() == 0


def test_the_server_freezes_for_its_lifespan() -> None:
    llm = small_engine()
    try:
        app = build_app(llm, served_model_names=["m"], shutdown_engine=False)
        gc.unfreeze()  # the core loop froze at its start
        with TestClient(app) as client:
            frozen = gc.get_freeze_count()
            assert client.get("/health").status_code == 200
        assert frozen > 1000, frozen
        assert gc.get_freeze_count() == 0
    finally:
        llm.shutdown()
