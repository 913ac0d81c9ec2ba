"""The worker's bookkeeping, without the model: applies each SchedulerOutput to its slot table,
builds one step's inputs over all scheduled tokens, and turns what was sampled for the requests
whose prefill is complete into the step's output.

Everything the runner knows arrives in SchedulerOutput (DESIGN.md section 2). It keeps its own
copy of each request's tokens in persistent per-slot buffers (`InputBatch`), and appends what it
samples, because those tokens are the next step's decode inputs.

It imports no torch, so a runner whose model and sampler are native code (no torch in the
process) keeps the same slot table and step logic as the torch `ModelRunner`. A subclass
implements the model half, called in this order in each run (a step, or after a failure each
of its requests alone):

- `_prepare_sampling(arrays)`, optional: the run's `SamplingArrays` (numpy, no grammar yet)
  before the forward pass, for a sampler that copies them to a device (the torch runner makes
  its tensors there, before the forward pass as vLLM does; default: nothing);
- `_forward(inputs, logits_indices)`: run the model over the run's tokens (`StepInputs`, numpy
  as built here) and return the logits of the flattened token positions `logits_indices`, in
  that order, in whatever type its sampler takes;
- `_sample(logits, arrays)`: sample every row of those logits as `arrays` says, now with the
  grammar's rows (`grammar_rows`, `grammar_bitmask`: the bitmask is computed beside the forward
  pass and only waited for after it). Returns `SampledArrays`.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import numpy as np

from slotserve.core.outputs import (
    GrammarOutput,
    LogprobsEntry,
    ModelRunnerOutput,
    SchedulerOutput,
)
from slotserve.errors import InvariantViolation
from slotserve.worker.draft_rows import grammar_rows, verify_drafts, write_drafts
from slotserve.worker.input_batch import InputBatch
from slotserve.worker.sampling_arrays import SampledArrays, SamplingArrays, mix_seed
from slotserve.worker.slots import RequestSlots

if TYPE_CHECKING:
    from slotserve.config import CacheConfig, SchedulerConfig
    from slotserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# The worker and the scheduler disagree (an engine bug the checker names): the step fails as
# a whole instead of being isolated to a request.
_CONTRACT_ERRORS = (InvariantViolation, AssertionError)
_NEG_INF = float("-inf")

# The logits of a step's sampled rows, as the subclass's model makes them and its sampler takes
# them (a torch.Tensor for ModelRunner).
LogitsT = TypeVar("LogitsT")


class AdapterSlots(Protocol):
    """The model's LoRA adapter slots (slotserve/lora/layers.py's LoRASlots)."""

    def load(self, slot: int, lora: LoRARequest) -> None:
        """Put an adapter into a slot."""

    def set_tokens(self, token_slots: np.ndarray) -> None:
        """The adapter slot of each of the step's tokens (-1: the base model)."""


@dataclass(slots=True)
class StepInputs:
    """One step's model inputs (numpy, on the host), requests in batch order with the decodes
    first; what `BatchLayout` holds for attention, plus the flattened tokens."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64: each token's KV cache slot
    block_table: np.ndarray  # [max_num_seqs, max_blocks_per_req] int64, one row per slot
    slots: np.ndarray  # [num_reqs] int64: each request's row of block_table
    q_lens: np.ndarray  # [num_reqs] int64 tokens scheduled this step
    num_computed: np.ndarray  # [num_reqs] int64 tokens already in the KV cache
    cu_num_tokens: np.ndarray  # [num_reqs] int64: each request's end in the step's tokens
    # The first num_decodes requests are decodes: one token each, or a token and its drafts.
    num_decodes: int


class StepRunner(ABC, Generic[LogitsT]):
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 vocab_size: int, lora: AdapterSlots | None = None) -> None:
        """`lora`: the adapter slots of a model built with LoRA (None: LoRA off)."""
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        self.vocab_size = vocab_size
        self.lora = lora
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.slots = RequestSlots(self.max_num_seqs)
        self.batch = InputBatch(self.max_num_seqs, self.max_model_len, self.block_size)
        self.lora_slot_of = np.full(self.max_num_seqs, -1, dtype=np.int64)  # by request slot
        # Seconds spent in the forward pass and sampling in the last step.
        self.last_forward_s = 0.0
        # Requests that failed here, until the scheduler releases them (reported as failed
        # whenever they are scheduled meanwhile).
        self.failed: dict[str, str] = {}

    # ---------------------------------------------------------------- the model's half
    def _prepare_sampling(self, arrays: SamplingArrays) -> None:
        """The run's sampling arrays (no grammar yet), before `_forward`; the same object
        then comes to `_sample`."""

    @abstractmethod
    def _forward(self, inputs: StepInputs, logits_indices: np.ndarray) -> LogitsT:
        """Run the model over the run's tokens, writing their KV (idempotent: a failed step
        is rerun request by request); the logits at `logits_indices` [num_rows] (rising)."""

    @abstractmethod
    def _sample(self, logits: LogitsT, arrays: SamplingArrays) -> SampledArrays:
        """Sample each row of `logits` (row i of `arrays`); the result on the host."""

    # ---------------------------------------------------------------- state updates
    def _apply_state(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.failed.pop(req_id, None)
            slot = self.slots.req_id_to_index.get(req_id)
            if slot is not None:
                self.batch.remove_request(slot)
        # Releases, stale same-id slots and claims, in the contract's order, with typed errors
        # (a slot table that disagrees with the scheduler fails the whole step).
        new_slots = self.slots.apply(so)
        bad_loras = self._load_loras(so)
        # One request's bad state (a value its row cannot hold, a block table past its end)
        # fails that request only: it keeps its slot until the scheduler releases it.
        for new, slot in zip(so.scheduled_new_reqs, new_slots, strict=True):
            try:
                self.lora_slot_of[slot] = new.lora_slot
                if new.lora_slot in bad_loras:
                    raise bad_loras[new.lora_slot]
                self.batch.add_request(slot, new)
            except _CONTRACT_ERRORS:
                raise
            except Exception as exc:  # noqa: BLE001 - isolated to this request
                self.batch.remove_request(slot)
                self._mark_failed(new.req_id, exc)
        cached = so.scheduled_cached_reqs
        index = self.slots.req_id_to_index
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                    cached.num_computed_tokens, strict=True):
            if req_id in self.failed:
                continue
            try:
                self.batch.update_cached(index[req_id], new_blocks, num_computed)
            except _CONTRACT_ERRORS:
                raise
            except Exception as exc:  # noqa: BLE001 - isolated to this request
                self._mark_failed(req_id, exc)

    def _load_loras(self, so: SchedulerOutput) -> dict[int, Exception]:
        """The output's adapter loads; a slot whose adapter fails to load fails the requests
        that would use it."""
        failed: dict[int, Exception] = {}
        if so.lora_loads and self.lora is None:
            raise InvariantViolation("adapter loads sent to a worker without LoRA")
        for slot, lora in so.lora_loads.items():
            try:
                self.lora.load(slot, lora)  # type: ignore[union-attr]  # checked above
            except Exception as exc:  # noqa: BLE001 - isolated to its requests
                failed[slot] = exc
        return failed

    def _mark_failed(self, req_id: str, exc: BaseException) -> None:
        logger.error("request %s failed in the worker: %s: %s", req_id, type(exc).__name__, exc,
                     exc_info=exc)
        self.failed[req_id] = f"{type(exc).__name__}: {exc}"

    # ---------------------------------------------------------------- the step
    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        """Run one step. A failure is isolated to the requests that cause it: if the batch
        fails, each request runs alone (KV writes are idempotent, and nothing else changes
        before a run succeeds), and only those that fail alone are reported in `failed`.
        A broken contract (InvariantViolation, SlotOverflowError) still fails the step.
        `grammar_output` holds the token bitmask of the requests under a grammar that sample
        in this step; it is applied to their logits before sampling."""
        so = scheduler_output
        self._apply_state(so)
        self.last_forward_s = 0.0
        failed = self.failed
        # A request listed with 0 tokens has nothing to run; it is simply left out.
        ids = [r for r, n in so.num_scheduled_tokens.items() if n > 0 and r not in failed]
        outputs: list[ModelRunnerOutput] = []

        if ids:
            try:
                outputs.append(self._execute(so, ids, grammar_output))
            except _CONTRACT_ERRORS:
                raise
            except Exception as exc:  # noqa: BLE001 - isolated below
                if len(ids) == 1:
                    self._mark_failed(ids[0], exc)
                else:
                    logger.warning("a step of %d requests failed (%s: %s); running them one "
                                   "by one to isolate the failure", len(ids),
                                   type(exc).__name__, exc)
                    for rid in ids:
                        try:
                            outputs.append(self._execute(so, [rid], grammar_output))
                        except _CONTRACT_ERRORS:
                            raise
                        except Exception as one:  # noqa: BLE001 - this request's own
                            self._mark_failed(rid, one)
        scheduled_failed = ({r: failed[r] for r in so.num_scheduled_tokens if r in failed}
                            if failed else None)
        return _merge_outputs(outputs, scheduled_failed or None)

    def _execute(self, so: SchedulerOutput, ids: list[str],
                 grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        """One forward pass and sampling over `ids`; the worker's state moves only when it
        succeeds."""
        b = self.batch
        index = self.slots.req_id_to_index
        try:
            slots = np.fromiter((index[r] for r in ids), dtype=np.int64, count=len(ids))
        except KeyError as exc:
            raise InvariantViolation(f"scheduled request {exc.args[0]!r} holds no worker "
                                     f"slot") from exc
        q_lens = np.fromiter((so.num_scheduled_tokens[r] for r in ids), dtype=np.int64,
                             count=len(ids))
        # Decodes first (one token, or one and its drafts): they form the batched decode group
        # in attention.
        drafts = so.scheduled_spec_decode_tokens
        decode = q_lens == 1
        if drafts:
            decode |= q_lens == 1 + np.fromiter((len(drafts.get(r, ())) for r in ids),
                                                dtype=np.int64, count=len(ids))
        # With LoRA, by adapter slot within each group (slotserve/lora/layers.py).
        num_decodes = int(decode.sum())
        if self.lora is None and num_decodes in (0, len(ids)):
            req_ids = ids  # one group: already in order
        else:
            order = (np.argsort(~decode, kind="stable") if self.lora is None
                     else np.lexsort((self.lora_slot_of[slots], ~decode)))
            slots, q_lens = slots[order], q_lens[order]
            req_ids = [ids[i] for i in order]
        num_computed = b.num_computed_tokens[slots]
        seq_lens = num_computed + q_lens
        # Drafts sit after a request's tokens (not counted in them until accepted).
        n_drafts = write_drafts(b, req_ids, slots, drafts) if drafts else np.zeros_like(q_lens)
        known = b.num_tokens[slots] + n_drafts
        if (seq_lens > known).any():
            bad = int(np.argmax(seq_lens > known))
            raise InvariantViolation(
                f"request {req_ids[bad]!r}: {int(q_lens[bad])} tokens scheduled after "
                f"{int(num_computed[bad])} computed, but the worker knows "
                f"{int(known[bad])} tokens")

        inputs = self._prepare_inputs(req_ids, slots, q_lens, num_computed, num_decodes)
        cu = inputs.cu_num_tokens
        # Only requests whose prefill completes this step produce a token; one with k drafts
        # is sampled at its last k + 1 positions (a row each: `offsets` 0..k).
        done = seq_lens == known
        sample_rows = np.nonzero(done)[0]
        sample_slots = slots[sample_rows]
        counts = 1 + n_drafts[sample_rows]
        if len(counts) and counts.max() > 1:
            offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            logits_pos = np.repeat(cu[sample_rows] - counts, counts) + offsets
            row_slots = np.repeat(sample_slots, counts)
        else:
            offsets, logits_pos, row_slots = None, cu[sample_rows] - 1, sample_slots
        arrays = self._sampling_arrays(row_slots, offsets)
        self._prepare_sampling(arrays)

        if self.lora is not None:
            self.lora.set_tokens(np.repeat(self.lora_slot_of[slots], q_lens))
        start = time.perf_counter()
        logits = self._forward(inputs, logits_pos)
        if grammar_output is not None:
            # Waits for the bitmask here, after the forward pass it was filled beside.
            grammar_rows(arrays, grammar_output, ids,
                         [req_ids[r] for r in np.repeat(sample_rows, counts)])
        out = self._sample(logits, arrays)
        self.last_forward_s += time.perf_counter() - start

        b.num_computed_tokens[slots] = seq_lens
        if offsets is None:
            b.append_sampled(sample_slots, out.sampled)
            return self._make_output(req_ids, sample_rows, sample_slots, out)
        kept = verify_drafts(b, sample_slots, counts, out.sampled)
        return self._make_output(req_ids, sample_rows, sample_slots, out, counts, kept)

    def _prepare_inputs(self, req_ids: list[str], slots: np.ndarray, q_lens: np.ndarray,
                        num_computed: np.ndarray, num_decodes: int) -> StepInputs:
        b, bs = self.batch, self.block_size
        num_reqs = len(slots)
        cu = np.cumsum(q_lens)
        starts = cu - q_lens
        total = int(cu[-1])
        req_of_token = np.repeat(np.arange(num_reqs), q_lens)
        positions = np.arange(total) - starts[req_of_token] + num_computed[req_of_token]
        rows = slots[req_of_token]
        block_pos = positions // bs
        if (block_pos >= b.num_blocks[rows]).any():
            bad = int(np.argmax(block_pos >= b.num_blocks[rows]))
            raise InvariantViolation(
                f"request {req_ids[req_of_token[bad]]!r} has no KV block for position "
                f"{int(positions[bad])} ({int(b.num_blocks[rows[bad]])} blocks held)")
        return StepInputs(
            input_ids=b.token_ids[rows, positions], positions=positions,
            slot_mapping=b.block_table[rows, block_pos] * bs + positions % bs,
            block_table=b.block_table, slots=slots, q_lens=q_lens, num_computed=num_computed,
            cu_num_tokens=cu, num_decodes=num_decodes)  # decodes come first

    def _sampling_arrays(self, slots: np.ndarray,
                         offsets: np.ndarray | None = None) -> SamplingArrays:
        """`offsets`: per row, how many drafts precede the sampled position (a request's
        rows 0..k at once), for the positions' seeds, penalties and min_tokens."""
        b = self.batch
        # The tokens before each row's position, drafts included (they follow num_tokens).
        ends = b.num_tokens[slots] if offsets is None else b.num_tokens[slots] + offsets
        temp = b.temperature[slots]
        arrays = SamplingArrays(temperature=temp, all_greedy=bool((temp < 1e-5).all()))
        if len(slots) == 0:
            return arrays
        if not arrays.all_greedy:
            top_k, top_p, min_p = b.top_k[slots], b.top_p[slots], b.min_p[slots]
            if (top_k > 0).any():
                arrays.top_k = top_k
            if (top_p < 1.0).any():
                arrays.top_p = top_p
            if (min_p > 0.0).any():
                arrays.min_p = min_p
            seeds = {row: mix_seed(b.seeds[s], int(ends[row] - b.num_prompt_tokens[s]))
                     for row, s in enumerate(slots.tolist()) if b.seeds[s] is not None}
            arrays.row_seeds = seeds or None
        rep = b.repetition_penalty[slots]
        if (rep != 1.0).any():
            arrays.repetition_penalty = rep
            arrays.prompt_output_ids = b.padded_tokens(slots, np.zeros_like(slots), ends,
                                                       self.vocab_size)
        freq, pres = b.frequency_penalty[slots], b.presence_penalty[slots]
        if (freq != 0.0).any() or (pres != 0.0).any():
            arrays.frequency_penalty, arrays.presence_penalty = freq, pres
            arrays.output_ids = b.padded_tokens(slots, b.num_prompt_tokens[slots], ends,
                                                self.vocab_size)
        n_out = ends - b.num_prompt_tokens[slots]
        below = np.nonzero(n_out < b.min_tokens[slots])[0]
        if len(below):
            rows, toks = _row_pairs(below, [b.min_tokens_stop_ids[s] for s in slots[below]],
                                    self.vocab_size)
            if len(rows):
                arrays.masked_rows, arrays.masked_tokens = rows, toks
        rows_l, toks_l, vals_l = [], [], []
        for row, slot in enumerate(slots.tolist()):
            bias = b.logit_bias[slot]
            if bias is not None:
                keep = bias[0] < self.vocab_size
                toks_l.append(bias[0][keep])
                vals_l.append(bias[1][keep])
                rows_l.append(np.full(len(toks_l[-1]), row, dtype=np.int64))
        if rows_l:
            arrays.bias_rows, arrays.bias_tokens = np.concatenate(rows_l), np.concatenate(toks_l)
            arrays.bias_values = np.concatenate(vals_l)
        nlp = b.num_logprobs[slots]
        if (nlp >= 0).any():
            arrays.max_num_logprobs = int(nlp.max())
        return arrays

    def _make_output(self, req_ids: list[str], sample_rows: np.ndarray,
                     sample_slots: np.ndarray, out: SampledArrays,
                     counts: np.ndarray | None = None,
                     kept: np.ndarray | None = None) -> ModelRunnerOutput:
        """`counts`/`kept`: per sampled request, its rows in `out` and how many of them
        verification kept (None: one each)."""
        sampled_lists: list[list[int]] = [[] for _ in req_ids]
        toks = out.sampled.tolist()
        if counts is None or kept is None:
            starts = list(range(len(toks)))
            n_kept = [1] * len(toks)
        else:
            starts = (np.cumsum(counts) - counts).tolist()
            n_kept = kept.tolist()
        for row, s0, n in zip(sample_rows.tolist(), starts, n_kept, strict=True):
            sampled_lists[row] = toks[s0:s0 + n]
        logprobs: list[list[LogprobsEntry] | None] | None = None
        if out.sampled_logprobs is not None:
            nlp_all = self.batch.num_logprobs
            logprobs = [[] if nlp_all[self.slots.req_id_to_index[r]] >= 0 else None
                        for r in req_ids]
            lp = out.sampled_logprobs.tolist()
            top_ids = out.topk_ids.tolist() if out.topk_ids is not None else None
            top_lp = out.topk_logprobs.tolist() if out.topk_logprobs is not None else None
            for row, slot, s0, m in zip(sample_rows.tolist(), sample_slots.tolist(), starts,
                                        n_kept, strict=True):
                n = int(nlp_all[slot])
                if n < 0:
                    continue
                entries: list[LogprobsEntry] = []
                for i in range(s0, s0 + m):
                    entry: LogprobsEntry = {toks[i]: float(lp[i])}
                    if n and top_ids is not None and top_lp is not None:
                        for tok, val in zip(top_ids[i][:n], top_lp[i][:n], strict=True):
                            if val != _NEG_INF:  # a token a grammar disallowed
                                entry.setdefault(tok, float(val))
                    entries.append(entry)
                logprobs[row] = entries
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled_lists,
            logprobs=logprobs,
        )


def _row_pairs(rows: np.ndarray, ids: list[np.ndarray], vocab_size: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """(row, token id) pairs for each row's ids, ids outside the vocabulary dropped."""
    counts = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    all_rows = np.repeat(rows.astype(np.int64), counts)
    all_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    keep = (all_ids >= 0) & (all_ids < vocab_size)
    return all_rows[keep], all_ids[keep]


def _merge_outputs(outputs: list[ModelRunnerOutput],
                   failed: dict[str, str] | None) -> ModelRunnerOutput:
    """The outputs of the runs of one step (one, or one per request after a failure)."""
    if len(outputs) == 1 and failed is None:
        return outputs[0]
    req_ids: list[str] = []
    sampled: list[list[int]] = []
    logprobs: list[list[LogprobsEntry] | None] = []
    any_logprobs = False
    for out in outputs:
        req_ids.extend(out.req_ids)
        sampled.extend(out.sampled_token_ids)
        if out.logprobs is None:
            logprobs.extend([None] * len(out.req_ids))
        else:
            any_logprobs = True
            logprobs.extend(out.logprobs)
    return ModelRunnerOutput(req_ids=req_ids,
                             req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=sampled,
                             logprobs=logprobs if any_logprobs else None, failed=failed)
