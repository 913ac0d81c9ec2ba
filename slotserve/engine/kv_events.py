"""KV-cache events on a ZMQ PUB socket in vLLM's wire format (`--kv-events-endpoint`), so the
KV-aware routers that read vLLM's events (llm-d, NVIDIA Dynamo, Ray's) can route to slotserve.

The block pool records events as it caches, evicts and clears blocks (`BlockPool.kv_events`,
already in vLLM's array layout: `["BlockStored", hashes, parent, token_ids, block_size,
lora_id, medium]`, `["BlockRemoved", hashes, medium]`, `["AllBlocksCleared"]`); after each
step the engine core hands them here and one `KVEventBatch` goes out, `[ts, events]`, as a
three-part message: topic, an 8-byte big-endian sequence number, the msgpack payload (what
vLLM's `ZmqEventPublisher` sends). Block hashes are the KV cache's own 32-byte digests.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import zmq

DEFAULT_TOPIC = "kv-events"


class KVEventPublisher:
    def __init__(self, endpoint: str, topic: str = DEFAULT_TOPIC) -> None:
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        # A slow subscriber must not grow this process without bound: past this many
        # messages the PUB socket drops (ZMQ's own high-water mark).
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self._topic = topic.encode()
        self._seq = 0

    @property
    def endpoint(self) -> str:
        return str(self._socket.getsockopt_string(zmq.LAST_ENDPOINT))

    def publish(self, events: list[list[Any]]) -> None:
        if not events:
            return
        payload = msgpack.packb([time.time(), events], use_bin_type=True)
        self._socket.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload])
        self._seq += 1

    def close(self) -> None:
        self._socket.close(linger=0)


def decode_batch(payload: bytes) -> tuple[float, list[list[Any]]]:
    """A batch as sent: (timestamp, events); for subscribers and tests."""
    ts, events = msgpack.unpackb(payload, raw=False)[:2]
    return float(ts), list(events)
