"""The engine core in a child process: killed, it is noticed at once and every waiting caller
gets EngineDeadError (streams, utility calls, and whoever calls later)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest

from slotserve.entrypoints.async_llm import AsyncLLM
from slotserve.errors import EngineDeadError
from slotserve.sampling_params import SamplingParams


def test_killed_engine_process_fails_every_waiting_caller() -> None:
    llm = AsyncLLM.from_engine_args(engine_mode="process", threads=1, num_blocks=64,
                                    max_num_seqs=4, max_model_len=512, check=True)
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def run() -> tuple[list[Any], float]:
        started = [asyncio.Event(), asyncio.Event()]

        async def consume(i: int) -> None:
            async for _ in llm.generate("To be, or not", params, f"r{i}"):
                started[i].set()

        streams = [asyncio.create_task(consume(i)) for i in range(2)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        held = asyncio.ensure_future(llm.call_utility("hold", 60))
        await asyncio.sleep(0.2)  # the core is now inside the call
        pid = llm.engine.engine_core.pid  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        results = await asyncio.wait_for(
            asyncio.gather(*streams, held, return_exceptions=True), 10)
        noticed = time.monotonic() - killed
        # Whoever comes later is refused at once.
        with pytest.raises(EngineDeadError):
            await llm.get_stats()
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate("Now is", params):
                pass
        return results, noticed

    try:
        results, noticed = asyncio.run(run())
    finally:
        llm.shutdown()
    assert [type(r) for r in results] == [EngineDeadError] * 3, results
    # At once, not when the core's 60 s call would have ended or the 10 s wait ran out.
    # Measured: 0.35 s with two busy loops beside the suite on 2 cores.
    assert noticed < 3.0, noticed
    assert llm.errored


PLUGIN = '''
import sys

from slotserve.engine.core import EngineCore


def _modules_loaded(self, names):
    main = getattr(sys.modules["__main__"], "__file__", None)
    return sorted(n for n in names if n in sys.modules), main


EngineCore.modules_loaded = _modules_loaded
'''


def test_engine_process_is_a_fresh_interpreter_on_the_callers_path(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The child finds a plugin that only the caller's sys.path holds (as under spawn), and
    runs without the caller's main module or the HTTP stack (spawn re-imported them: ~18 MB
    of the served core, plus a resource-tracker process)."""
    (tmp_path / "core_probe_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    llm = AsyncLLM.from_engine_args(engine_mode="process", threads=1, num_blocks=16,
                                    max_num_seqs=1, max_model_len=64, check=True,
                                    plugins="core_probe_plugin")
    try:
        loaded, main = asyncio.run(llm.call_utility(
            "modules_loaded", ["core_probe_plugin", "fastapi", "uvicorn", "pytest"]))
    finally:
        llm.shutdown()
    assert loaded == ["core_probe_plugin"]
    assert main is None  # `python -c`, not the caller's script
