"""KV-cache events on a ZMQ PUB socket, in vLLM's wire format: a subscriber decodes every
batch and replays BlockStored / BlockRemoved / AllBlocksCleared into a set of hashes, which
must be exactly the hashes the engine's KV cache holds, through evictions and a reset."""

from __future__ import annotations

import time
from typing import Any

import zmq

from slotserve.engine.kv_events import DEFAULT_TOPIC, decode_batch
from slotserve.sampling_params import SamplingParams
from tests.helpers import FakeEngineFactory

ENDPOINT = "ipc:///tmp/slotserve-test-kv-events-{}"


def run(engine: Any, prompts: list[list[int]], max_tokens: int = 3) -> None:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", {"prompt_token_ids": p},
                           SamplingParams(max_tokens=max_tokens, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()


def drain(sub: zmq.Socket[bytes], view: set[bytes], seqs: list[int]) -> list[list[Any]]:
    """Apply every batch that has arrived to `view`; the events, in order."""
    seen: list[list[Any]] = []
    while sub.poll(300):
        topic, seq, payload = sub.recv_multipart()
        assert topic == DEFAULT_TOPIC.encode()
        seqs.append(int.from_bytes(seq, "big"))
        ts, events = decode_batch(payload)
        assert abs(ts - time.time()) < 60
        for ev in events:
            kind = ev[0]
            if kind == "BlockStored":
                _, hashes, parent, tokens, block_size, lora_id, medium = ev
                assert block_size == 16 and len(tokens) == 16 * len(hashes)
                assert parent is None or isinstance(parent, bytes)
                assert lora_id is None and medium is None
                view.update(hashes)
            elif kind == "BlockRemoved":
                _, hashes, medium = ev
                view.difference_update(hashes)
            else:
                assert ev == ["AllBlocksCleared"]
                view.clear()
            seen.append(ev)
    return seen


def test_events_replay_to_the_caches_own_view(fake_engine: FakeEngineFactory) -> None:
    endpoint = ENDPOINT.format(time.monotonic_ns())
    # 12 usable blocks: the second wave of prompts evicts the first's blocks.
    engine = fake_engine(num_blocks=13, kv_events_endpoint=endpoint, max_num_seqs=2)
    core = engine.engine_core.engine_core  # type: ignore[attr-defined]
    pool = core.scheduler.kv_cache_manager.block_pool
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.3)  # a PUB socket drops what it sends before the subscription arrives
    view: set[bytes] = set()
    seqs: list[int] = []
    try:
        shared = list(range(10, 42))  # two full blocks shared by both prompts
        run(engine, [shared + [50 + i for i in range(20)], shared + [90] * 20])
        events = drain(sub, view, seqs)
        stored = [ev for ev in events if ev[0] == "BlockStored"]
        assert stored and view == set(pool.cached_block_hash_to_block)
        # The chain: a stored block's parent is the hash of the block before it.
        first = next(ev for ev in stored if ev[3] == shared[:16])
        second = next(ev for ev in stored if ev[3] == shared[16:32])
        assert first[2] is None and second[2] == first[1][0]

        run(engine, [[200 + i] * 60 for i in range(3)])  # evicts
        events = drain(sub, view, seqs)
        assert any(ev[0] == "BlockRemoved" for ev in events)
        assert view == set(pool.cached_block_hash_to_block)

        assert core.reset_prefix_cache()
        drain(sub, view, seqs)
        assert view == set() == set(pool.cached_block_hash_to_block)
        assert seqs == list(range(len(seqs)))  # numbered from 0, none lost
    finally:
        sub.close(linger=0)
        assert core.kv_events is not None
        core.kv_events.close()


def test_off_by_default_costs_nothing(fake_engine: FakeEngineFactory) -> None:
    engine = fake_engine()
    core = engine.engine_core.engine_core  # type: ignore[attr-defined]
    run(engine, [list(range(40))])
    assert core.kv_events is None
    assert core.scheduler.kv_cache_manager.block_pool.kv_events is None
