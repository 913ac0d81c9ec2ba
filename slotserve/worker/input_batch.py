"""Persistent per-slot state of the worker, sized `max_num_seqs` and updated incrementally.

Row i belongs to whichever request holds slot i in `RequestSlots`. A new request overwrites its
row in full; a cached request only appends blocks and moves its computed cursor; a sampled token
is appended to the row's token list (it is the next step's input). Everything is numpy so the
per-step batch is built with vectorised index math, not Python loops over tokens.
"""

from __future__ import annotations

import math

import numpy as np

from slotserve.core.outputs import NewRequestData
from slotserve.errors import InvariantViolation
from slotserve.sampling_params import SamplingParams

_NO_IDS = np.zeros(0, dtype=np.int64)


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        # +1: the token sampled after the last computable position is still recorded.
        self.token_ids = np.zeros((max_num_seqs, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.max_blocks_per_req = math.ceil(max_model_len / block_size) + 1
        self.block_table = np.zeros((max_num_seqs, self.max_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.req_ids: list[str | None] = [None] * max_num_seqs

        # Sampling parameters, one entry per slot.
        self.params: list[SamplingParams | None] = [None] * max_num_seqs
        self.temperature = np.ones(max_num_seqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_seqs, dtype=np.int64)
        self.top_p = np.ones(max_num_seqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_seqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_seqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_seqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_seqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_logprobs = np.full(max_num_seqs, -1, dtype=np.int64)  # -1: not requested
        self.seeds: list[int | None] = [None] * max_num_seqs
        # Tokens masked below min_tokens: the EOS id (unless ignored) plus stop_token_ids.
        self.min_tokens_stop_ids: list[np.ndarray] = [_NO_IDS] * max_num_seqs
        # logit_bias as (token ids, values), or None.
        self.logit_bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * max_num_seqs

    def add_request(self, slot: int, new: NewRequestData) -> None:
        n = len(new.prefill_token_ids)
        if n > self.max_model_len:
            raise InvariantViolation(f"request {new.req_id!r} has {n} prefill tokens, more "
                                     f"than max_model_len={self.max_model_len}")
        if new.num_output_tokens > n or not 0 <= new.num_computed_tokens <= n:
            raise InvariantViolation(
                f"request {new.req_id!r}: num_output_tokens={new.num_output_tokens}, "
                f"num_computed_tokens={new.num_computed_tokens} with {n} prefill tokens")
        self.req_ids[slot] = new.req_id
        self.token_ids[slot, :n] = new.prefill_token_ids
        self.num_tokens[slot] = n
        self.num_prompt_tokens[slot] = n - new.num_output_tokens
        self.num_computed_tokens[slot] = new.num_computed_tokens
        # Clear the row so blocks of a previous holder never leak into a padded gather.
        self.block_table[slot] = 0
        self.num_blocks[slot] = 0
        self._append_blocks(slot, new.block_ids)

        sp = new.sampling_params
        self.params[slot] = sp
        self.temperature[slot] = sp.temperature
        self.top_k[slot] = sp.top_k
        self.top_p[slot] = sp.top_p
        self.min_p[slot] = sp.min_p
        self.repetition_penalty[slot] = sp.repetition_penalty
        self.frequency_penalty[slot] = sp.frequency_penalty
        self.presence_penalty[slot] = sp.presence_penalty
        self.min_tokens[slot] = sp.min_tokens
        self.num_logprobs[slot] = -1 if sp.logprobs is None else sp.logprobs
        self.seeds[slot] = sp.seed
        stop_ids = set(sp.stop_token_set)
        if new.eos_token_id is not None:
            stop_ids.add(new.eos_token_id)
        self.min_tokens_stop_ids[slot] = (np.fromiter(sorted(stop_ids), dtype=np.int64)
                                          if stop_ids else _NO_IDS)
        bias = sp.logit_bias
        self.logit_bias[slot] = None if not bias else (
            np.fromiter(bias.keys(), dtype=np.int64, count=len(bias)),
            np.fromiter(bias.values(), dtype=np.float32, count=len(bias)))

    def update_cached(self, slot: int, new_block_ids: list[int] | None,
                      num_computed_tokens: int) -> None:
        if new_block_ids:
            self._append_blocks(slot, new_block_ids)
        self.num_computed_tokens[slot] = num_computed_tokens

    def remove_request(self, slot: int) -> None:
        self.req_ids[slot] = None
        self.params[slot] = None

    def _append_blocks(self, slot: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[slot])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise InvariantViolation(
                f"request {self.req_ids[slot]!r} would hold {end} KV blocks; at most "
                f"{self.max_blocks_per_req} fit max_model_len={self.max_model_len}")
        self.block_table[slot, start:end] = block_ids
        self.num_blocks[slot] = end

    def num_output_tokens(self, slot: int) -> int:
        return int(self.num_tokens[slot] - self.num_prompt_tokens[slot])

    def append_sampled(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        # The cap only bites for a token sampled past max_model_len, which the scheduler
        # discards anyway (the request is length-capped).
        pos = np.minimum(self.num_tokens[slots], self.max_model_len)
        self.token_ids[slots, pos] = tokens
        self.num_tokens[slots] = pos + 1

    def padded_tokens(self, slots: np.ndarray, start: np.ndarray, end: np.ndarray,
                      pad: int) -> np.ndarray:
        """Token ids [start, end) of each slot as rows padded with `pad` (for penalties)."""
        width = max(int((end - start).max()), 1)
        cols = start[:, None] + np.arange(width)[None, :]
        valid = cols < end[:, None]
        cols = np.minimum(cols, self.token_ids.shape[1] - 1)
        out = self.token_ids[slots[:, None], cols]
        return np.where(valid, out, pad)
