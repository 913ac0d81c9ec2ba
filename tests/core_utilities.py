"""Test utilities of the engine core, called by name like its own (`call_utility("name",
*args)`): importing this module adds them to EngineCore. tests/conftest.py imports it and names
it in SLOTSERVE_PLUGINS, so a core in a child process imports it too."""

from __future__ import annotations

import sys
import time
from typing import Any

from slotserve.engine.core import EngineCore

POISON = 3333  # a prompt token: install_request_fault's fault is tied to the request with it


def install_fault(core: Any, after: int) -> None:
    """Make execute_model raise on its `after`-th call from now (0 = the next call)."""
    runner = core.model_runner
    real = runner.execute_model
    calls = [0]

    def execute_model(scheduler_output: Any, grammar_output: Any = None) -> Any:
        calls[0] += 1
        if calls[0] == after + 1:
            raise RuntimeError("injected fault in the forward pass")
        return real(scheduler_output, grammar_output)

    runner.execute_model = execute_model


def remove_fault(core: Any) -> None:
    del core.model_runner.execute_model


def break_scheduler(core: Any) -> None:
    scheduler = core.scheduler
    real = scheduler.schedule

    def schedule(now: float | None = None) -> Any:
        # A step that only delivers the last request's releases still succeeds, so the next
        # request is the one that meets the fault.
        if scheduler.requests:
            raise RuntimeError("scheduler state corrupted (injected)")
        return real(now)

    scheduler.schedule = schedule


def install_request_fault(core: Any) -> None:
    """The worker's forward pass fails whenever the request with the poison token is in the
    batch (a fault tied to one request, found by the worker running the batch one by one)."""
    runner = core.model_runner
    real = runner._execute

    def execute(so: Any, ids: list[str], grammar_output: Any = None) -> Any:
        index = runner.slots.req_id_to_index
        if any(POISON in runner.batch.token_ids[index[r]][:runner.batch.num_tokens[index[r]]]
               for r in ids):
            raise RuntimeError("injected fault tied to one request")
        return real(so, ids, grammar_output)

    runner._execute = execute


def remove_request_fault(core: Any) -> None:
    del core.model_runner._execute


def count_added_requests(core: Any) -> None:
    """From now on, record the id of every request that reaches the core."""
    add = core.add_request
    core.added_request_ids = []

    def counting_add(request: Any) -> None:
        core.added_request_ids.append(request.request_id)
        add(request)

    core.add_request = counting_add


def stop_counting_requests(core: Any) -> list[str]:
    """The ids recorded since count_added_requests; recording stops."""
    del core.add_request
    ids: list[str] = core.__dict__.pop("added_request_ids")
    return ids


def counted_requests(core: Any) -> list[str]:
    return list(core.added_request_ids)


def core_state(core: Any) -> dict[str, Any]:
    """What the engine core holds."""
    sched = core.scheduler
    pool = sched.kv_cache_manager.block_pool
    return {
        "requests": sorted(sched.requests),
        "used_blocks": pool.num_usable_blocks - pool.get_num_free_blocks(),
        "worker_slots": sorted(core.model_runner.slots.holders),
        "ledger": sorted(sched.slot_ledger.holders),
        "core_busy": core.has_requests(),
    }


def engine_core(core: Any) -> Any:
    """The core itself (a core in this process, engine_mode="thread")."""
    return core


def set_mask_budget(core: Any, seconds: float | None) -> float | None:
    """Set each client's mask-time budget per step; returns the one it replaces."""
    manager = core.structured_output_manager
    previous: float | None = manager.mask_budget_s
    manager.mask_budget_s = seconds
    return previous


def switch_interval(core: Any) -> float:
    """The core process's GIL switch interval (sys.getswitchinterval)."""
    return sys.getswitchinterval()


def hold(core: Any, seconds: float) -> None:
    """Keep the core busy inside a utility call."""
    time.sleep(seconds)


for _utility in (install_fault, remove_fault, break_scheduler, install_request_fault,
                 remove_request_fault, count_added_requests, stop_counting_requests,
                 counted_requests, core_state, engine_core, set_mask_budget, hold,
                 switch_interval):
    setattr(EngineCore, _utility.__name__, _utility)
