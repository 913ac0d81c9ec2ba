"""Draft tokens in the worker's rows: written after a request's tokens before the verify pass
(not its tokens until accepted), then kept or dropped from what was sampled at each position."""

from __future__ import annotations

import numpy as np

from slotserve.errors import InvariantViolation
from slotserve.worker.input_batch import InputBatch


def write_drafts(b: InputBatch, req_ids: list[str], slots: np.ndarray,
                 drafts: dict[str, list[int]]) -> np.ndarray:
    """Put each request's drafts after its tokens (the row's num_tokens stays: they are not
    its tokens until verified); their counts, per request."""
    n = np.zeros(len(req_ids), dtype=np.int64)
    for i, rid in enumerate(req_ids):
        d = drafts.get(rid)
        if d:
            slot, start = int(slots[i]), int(b.num_tokens[slots[i]])
            if start + len(d) > b.max_model_len:
                raise InvariantViolation(f"request {rid!r}: {len(d)} drafts after {start} "
                                         f"tokens pass max_model_len={b.max_model_len}")
            b.token_ids[slot, start:start + len(d)] = d
            n[i] = len(d)
    return n


def verify_drafts(b: InputBatch, slots: np.ndarray, counts: np.ndarray,
                  sampled: np.ndarray) -> np.ndarray:
    """Keep, per request, the longest run of drafts that equal what was sampled at their
    positions, plus the token sampled after them; append those to the row.

    Each position is sampled from the target distribution as if the drafts before it were
    the request's tokens (greedy: the argmax). For a one-hot proposal d this is exactly
    rejection sampling: d is kept with probability p(d), and when it is not, the sampled
    token is distributed as p with d removed and renormalised (the residual max(p - q, 0)).
    """
    kept = np.empty(len(slots), dtype=np.int64)
    start = 0
    for i, (slot, c) in enumerate(zip(slots.tolist(), counts.tolist(), strict=True)):
        pos = int(b.num_tokens[slot])
        drafts = b.token_ids[slot, pos:pos + c - 1]
        rows = sampled[start:start + c]
        a = 0
        while a < c - 1 and rows[a] == drafts[a]:
            a += 1
        b.token_ids[slot, pos:pos + a + 1] = rows[:a + 1]
        b.num_tokens[slot] = pos + a + 1
        # Computed: the step's input token and the accepted drafts, not the one sampled last.
        b.num_computed_tokens[slot] = pos + a
        kept[i] = a + 1
        start += c
    return kept
