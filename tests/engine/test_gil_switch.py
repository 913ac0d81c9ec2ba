"""The server process and the engine core process hand the GIL over every 0.5 ms, not
CPython's 5 ms: a thread busy with pure-Python work (a large schema, a chat render) otherwise
holds the event loop or the step loop for 5 ms at each handover (slotserve/gil_switch.py)."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest

from slotserve.entrypoints.async_llm import AsyncLLM
from slotserve.gil_switch import SWITCH_INTERVAL_S, shorten_switch_interval


@pytest.fixture
def restore_interval() -> Any:
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_shortens_and_never_lengthens(restore_interval: float) -> None:
    sys.setswitchinterval(0.005)
    assert shorten_switch_interval() == 0.005
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
    sys.setswitchinterval(0.0001)  # someone chose a shorter one: kept
    assert shorten_switch_interval() == pytest.approx(0.0001)
    assert sys.getswitchinterval() == pytest.approx(0.0001)


def test_the_engine_core_process_uses_the_short_interval(restore_interval: float) -> None:
    sys.setswitchinterval(0.005)  # the caller's own setting does not decide the child's
    llm = AsyncLLM.from_engine_args(engine_mode="process", threads=1, num_blocks=16,
                                    max_num_seqs=1, max_model_len=64, check=True)
    try:
        interval = asyncio.run(llm.call_utility("switch_interval"))
    finally:
        llm.shutdown()
    assert interval == pytest.approx(SWITCH_INTERVAL_S)


def test_serve_shortens_it_before_uvicorn_runs(restore_interval: float,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    from slotserve.entrypoints import log_limits
    from slotserve.entrypoints.cli import main

    sys.setswitchinterval(0.005)
    seen: list[float] = []
    # The server's log filters would stay on this process's handlers (pytest's among them).
    monkeypatch.setattr(log_limits, "install", lambda *a, **k: None)
    monkeypatch.setattr(uvicorn.Server, "run",
                        lambda self, *a, **k: seen.append(sys.getswitchinterval()))
    assert main(["serve", "--engine-mode", "thread", "--threads", "1", "--max-model-len",
                 "64", "--port", "1"]) == 0
    assert seen == [pytest.approx(SWITCH_INTERVAL_S)]


def test_a_bad_setting_is_a_config_error(monkeypatch: pytest.MonkeyPatch,
                                         restore_interval: float) -> None:
    from slotserve.errors import ConfigError
    from slotserve.gil_switch import SWITCH_INTERVAL_ENV

    for bad in ("fast", "0", "-1", "5"):
        monkeypatch.setenv(SWITCH_INTERVAL_ENV, bad)
        with pytest.raises(ConfigError, match=SWITCH_INTERVAL_ENV):
            shorten_switch_interval()
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, "0.005")  # CPython's default: an A/B baseline
    sys.setswitchinterval(0.005)
    shorten_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(0.005)
