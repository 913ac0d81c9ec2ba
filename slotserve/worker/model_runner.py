"""The worker: applies each SchedulerOutput to its slot table, runs one forward pass over all
scheduled tokens, samples the requests whose prefill is complete.

Everything the runner knows arrives in SchedulerOutput (DESIGN.md section 2). It keeps its own
copy of each request's tokens in persistent per-slot buffers (`InputBatch`), and appends what it
samples, because those tokens are the next step's decode inputs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from slotserve.config import CacheConfig, EngineConfig, SchedulerConfig
from slotserve.core.outputs import (
    GrammarOutput,
    LogprobsEntry,
    ModelRunnerOutput,
    SchedulerOutput,
)
from slotserve.errors import InvariantViolation
from slotserve.lora.layers import LoRASlots
from slotserve.lora.request import LoRAConfig
from slotserve.memory import keep_freed_memory, resident_bytes
from slotserve.model_config import ModelConfig
from slotserve.models.attention import AttentionMetadataMap, BatchLayout
from slotserve.models.kv_storage import resolve_kv_cache_dtype
from slotserve.models.layers import DecoderForCausalLM
from slotserve.models.loader import load_model, parse_dtype
from slotserve.worker.draft_rows import grammar_metadata, verify_drafts, write_drafts
from slotserve.worker.input_batch import InputBatch
from slotserve.worker.kv_cache import allocate_kv_cache
from slotserve.worker.memory_usage import MemoryUsage
from slotserve.worker.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    mix_seed,
)
from slotserve.worker.slots import RequestSlots

logger = logging.getLogger(__name__)

# The worker and the scheduler disagree (an engine bug the checker names): the step fails as
# a whole instead of being isolated to a request.
_CONTRACT_ERRORS = (InvariantViolation, AssertionError)
_NEG_INF = float("-inf")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ModelRunner:
    def __init__(
        self,
        model: str | Path | tuple[DecoderForCausalLM, ModelConfig],
        config: EngineConfig | SchedulerConfig,
        cache_config: CacheConfig | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        seed: int | None = None,
        native_attention: bool = True,
        quantization: str = "auto",
        lora_config: LoRAConfig | None = None,
    ) -> None:
        """Built from the engine's EngineConfig (`ModelRunner(model, config)`), or from its
        parts. `native_attention=False` keeps decode attention on the torch path even where
        the native CPU kernel would build; `quantization` is load_model's, for a runner that
        loads its model from a path."""
        if isinstance(config, EngineConfig):
            cache_config, dtype, device = config.cache_config, config.dtype, config.device
            seed, native_attention = config.seed, config.native_attention
            lora_config = config.lora_config
            config = config.scheduler_config
        assert cache_config is not None, "a SchedulerConfig comes with its CacheConfig"
        scheduler_config = config
        self.device = torch.device(device) if device not in (None, "auto") else default_device()
        self.dtype = parse_dtype(dtype)
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        if isinstance(model, tuple):
            self.model, self.model_config = model
        else:
            self.model, self.model_config = load_model(model, self.dtype, self.device,
                                                       max_positions=self.max_model_len + 1,
                                                       quantization=quantization)
        if self.model.rope_cos.shape[0] <= self.max_model_len:
            self.model.init_rope(self.max_model_len + 1)
        if self.device.type == "cpu":
            self.model.prepare_for_cpu()
        # The attention layer picks its kernels (native decode or torch) for this dtype/device.
        self.model.init_attention(native_attention)
        cfg = self.model_config
        # The adapter slot table (slotserve/lora); None: LoRA off, the layers are not wrapped.
        self.lora = (LoRASlots(self.model, cfg, lora_config, self.dtype, self.device)
                     if lora_config is not None else None)

        # Decided before the runner is built (EngineCore.from_engine_args), as for the
        # scheduler: both are built from the same CacheConfig.
        self.num_blocks = cache_config.num_blocks
        self.kv_cache_dtype = resolve_kv_cache_dtype(cache_config.cache_dtype, self.dtype)
        self.kv_caches = allocate_kv_cache(cfg, self.num_blocks, self.block_size,
                                           self.kv_cache_dtype, self.device)

        self.max_num_seqs = scheduler_config.max_num_seqs
        self.slots = RequestSlots(self.max_num_seqs)
        self.batch = InputBatch(self.max_num_seqs, self.max_model_len, self.block_size)
        self.lora_slot_of = np.full(self.max_num_seqs, -1, dtype=np.int64)  # by request slot
        self.sampler = Sampler(self.device, seed)
        self.vocab_size = cfg.vocab_size
        self.last_forward_s = 0.0
        self.memory = MemoryUsage.of(self.model, self.kv_caches)
        logger.info("memory: weights %.1f MiB (%.1f MiB of them quantized blocks), KV cache "
                    "%.1f MiB allocated for %d blocks (pages become resident as blocks are first "
                    "used), process resident %.1f MiB", self.memory.weights_bytes / 2**20,
                    self.memory.quantized_weights_bytes / 2**20,
                    self.memory.kv_cache_bytes / 2**20, self.num_blocks,
                    resident_bytes() / 2**20)
        if self.device.type == "cpu":
            # After the weights and the KV cache: each step's activations are then reused
            # from the heap instead of being page-faulted in again every step.
            keep_freed_memory()
        # Requests that failed here, until the scheduler releases them (reported as failed
        # whenever they are scheduled meanwhile).
        self.failed: dict[str, str] = {}

    @property
    def native_decode(self) -> bool:
        """Whether decode attention runs in the native kernel (chosen by the model)."""
        return self.model.attn_backend is not None and self.model.attn_backend.native

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
    @torch.inference_mode()
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

        input_ids, positions, meta = self._prepare_inputs(req_ids, slots, q_lens, num_computed,
                                                          num_decodes)
        cu = np.cumsum(q_lens)
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
        sampling_meta = self._sampling_metadata(row_slots, offsets)

        if self.lora is not None:
            self.lora.set_tokens(np.repeat(self.lora_slot_of[slots], q_lens))
        start = time.perf_counter()
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        # Every row sampled (a step of decodes; logits_pos rises, so it is then 0..T-1): no
        # copy of the rows.
        rows = hidden if len(logits_pos) == hidden.shape[0] else hidden.index_select(
            0, torch.from_numpy(logits_pos).to(self.device))
        logits = self.model.compute_logits(rows)
        if grammar_output is not None:
            # Waits for the bitmask here, after the forward pass it was filled beside.
            grammar_metadata(sampling_meta, grammar_output, ids,
                             [req_ids[r] for r in np.repeat(sample_rows, counts)],
                             self.vocab_size, self.device)
        sampled_out = self.sampler(logits, sampling_meta)
        sampled = sampled_out.sampled.cpu().numpy()
        self.last_forward_s += time.perf_counter() - start

        b.num_computed_tokens[slots] = seq_lens
        if offsets is None:
            b.append_sampled(sample_slots, sampled)
            return self._make_output(req_ids, sample_rows, sampled, sample_slots, sampled_out)
        kept = verify_drafts(b, sample_slots, counts, sampled)
        return self._make_output(req_ids, sample_rows, sampled, sample_slots, sampled_out,
                                 counts, kept)

    def _prepare_inputs(self, req_ids: list[str], slots: np.ndarray, q_lens: np.ndarray,
                        num_computed: np.ndarray, num_decodes: int
                        ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadataMap]:
        b, bs, dev = self.batch, self.block_size, self.device
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
        input_ids = b.token_ids[rows, positions]
        slot_mapping = b.block_table[rows, block_pos] * bs + positions % bs
        layout = BatchLayout(
            block_table=b.block_table, slots=slots, q_lens=q_lens, num_computed=num_computed,
            num_decodes=num_decodes,  # decodes come first
            block_size=bs, slot_mapping=torch.from_numpy(slot_mapping).to(dev))
        meta = self.model.build_attention_metadata(layout)
        return (torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), meta)

    def _sampling_metadata(self, slots: np.ndarray,
                           offsets: np.ndarray | None = None) -> SamplingMetadata:
        """`offsets`: per row, how many drafts precede the sampled position (a request's
        rows 0..k at once), for the positions' seeds, penalties and min_tokens."""
        b, dev = self.batch, self.device
        # The tokens before each row's position, drafts included (they follow num_tokens).
        ends = b.num_tokens[slots] if offsets is None else b.num_tokens[slots] + offsets

        def t(x: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(x)).to(dev)

        temp = b.temperature[slots]
        meta = SamplingMetadata(temperature=t(temp), all_greedy=bool((temp < 1e-5).all()))
        if len(slots) == 0:
            return meta
        if not meta.all_greedy:
            top_k, top_p, min_p = b.top_k[slots], b.top_p[slots], b.min_p[slots]
            if (top_k > 0).any():
                meta.top_k = t(top_k)
            if (top_p < 1.0).any():
                meta.top_p = t(top_p)
            if (min_p > 0.0).any():
                meta.min_p = t(min_p)
            seeds = {row: mix_seed(b.seeds[s], int(ends[row] - b.num_prompt_tokens[s]))
                     for row, s in enumerate(slots.tolist()) if b.seeds[s] is not None}
            meta.row_seeds = seeds or None
        rep = b.repetition_penalty[slots]
        if (rep != 1.0).any():
            meta.repetition_penalty = t(rep)
            meta.prompt_output_ids = t(b.padded_tokens(slots, np.zeros_like(slots), ends,
                                                       self.vocab_size))
        freq, pres = b.frequency_penalty[slots], b.presence_penalty[slots]
        if (freq != 0.0).any() or (pres != 0.0).any():
            meta.frequency_penalty, meta.presence_penalty = t(freq), t(pres)
            meta.output_ids = t(b.padded_tokens(slots, b.num_prompt_tokens[slots], ends,
                                                self.vocab_size))
        n_out = ends - b.num_prompt_tokens[slots]
        below = np.nonzero(n_out < b.min_tokens[slots])[0]
        if len(below):
            rows, toks = _row_pairs(below, [b.min_tokens_stop_ids[s] for s in slots[below]],
                                    self.vocab_size)
            if len(rows):
                meta.masked_rows, meta.masked_tokens = t(rows), t(toks)
        rows_l, toks_l, vals_l = [], [], []
        for row, slot in enumerate(slots.tolist()):
            bias = b.logit_bias[slot]
            if bias is not None:
                keep = bias[0] < self.vocab_size
                toks_l.append(bias[0][keep])
                vals_l.append(bias[1][keep])
                rows_l.append(np.full(len(toks_l[-1]), row, dtype=np.int64))
        if rows_l:
            meta.bias_rows, meta.bias_tokens = t(np.concatenate(rows_l)), t(np.concatenate(toks_l))
            meta.bias_values = t(np.concatenate(vals_l))
        nlp = b.num_logprobs[slots]
        if (nlp >= 0).any():
            meta.max_num_logprobs = int(nlp.max())
        return meta

    def _make_output(self, req_ids: list[str], sample_rows: np.ndarray, sampled: np.ndarray,
                     sample_slots: np.ndarray, out: SamplerOutput,
                     counts: np.ndarray | None = None,
                     kept: np.ndarray | None = None) -> ModelRunnerOutput:
        """`counts`/`kept`: per sampled request, its rows in `sampled` and how many of them
        verification kept (None: one each)."""
        sampled_lists: list[list[int]] = [[] for _ in req_ids]
        toks = sampled.tolist()
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
            lp = out.sampled_logprobs.cpu().tolist()
            top_ids = out.topk_ids.cpu().tolist() if out.topk_ids is not None else None
            top_lp = out.topk_logprobs.cpu().tolist() if out.topk_logprobs is not None else None
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
