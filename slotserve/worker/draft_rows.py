"""Draft tokens in the worker's rows: written after a request's tokens before the verify pass
(not its tokens until accepted), then kept or dropped from what was sampled at each position;
and the grammar bitmask's rows, one per verified position of a request that verifies drafts
(`grammar_rows`)."""

from __future__ import annotations

import numpy as np

from slotserve.core.outputs import GrammarOutput
from slotserve.errors import InvariantViolation
from slotserve.worker.input_batch import InputBatch
from slotserve.worker.sampling_arrays import SamplingArrays


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


def grammar_rows(arrays: SamplingArrays, grammar_output: GrammarOutput, ids: list[str],
                 sample_ids: list[str]) -> None:
    """The bitmask rows of this run's requests (a step isolating a failure runs them one by
    one); every one of them must sample. `sample_ids`: the request of each sampled row; a
    request verifying drafts has a row per verified position, in order, as its bitmask has."""
    row_of: dict[str, list[int]] = {}
    for row, rid in enumerate(sample_ids):
        row_of.setdefault(rid, []).append(row)
    in_run = set(ids)
    rows: list[int] = []
    picks: list[int] = []
    for k, rid in enumerate(grammar_output.structured_output_request_ids):
        if rid not in in_run:
            continue
        free = row_of.get(rid)
        if not free:
            raise InvariantViolation(f"request {rid!r} has a grammar bitmask but does not "
                                     "sample in this step")
        rows.append(free.pop(0))
        picks.append(k)
    bitmask = grammar_output.ready_bitmask()
    if not rows:
        return
    if len(picks) != len(bitmask):
        bitmask = bitmask[picks]
    if rows != list(range(len(sample_ids))):
        arrays.grammar_rows = np.array(rows, dtype=np.int64)
    arrays.grammar_bitmask = bitmask
