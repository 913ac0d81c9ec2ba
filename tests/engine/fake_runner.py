"""A torch-free stand-in for the ModelRunner: a deterministic "language model" whose next
token is a hash of the whole context the worker holds.

Because every token depends on the entire context, any mistake in what the engine hands the
worker (a lost token across a preemption, a wrong prefix-cache hit, a chunk applied twice)
changes the outputs, so comparing outputs across engine configurations tests the plumbing.
"""

from __future__ import annotations

from slotserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from slotserve.worker.slots import RequestSlots

FIRST_NORMAL_TOKEN = 3  # 0..2 are special in the test tokenizer


def fake_next_token(context: list[int], vocab_size: int, eos: int | None) -> int:
    h = 0
    for t in context:
        h = (h * 1000003 + t + 1) % 2147483647
    if eos is not None and h % 97 == 0:
        return eos
    return FIRST_NORMAL_TOKEN + h % (vocab_size - FIRST_NORMAL_TOKEN)


class FakeModelRunner:
    def __init__(self, max_num_seqs: int, vocab_size: int,
                 fail_on_step: int | None = None) -> None:
        self.slots = RequestSlots(max_num_seqs)
        self.vocab_size = vocab_size
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.eos: dict[str, int | None] = {}
        self.logprobs: dict[str, int | None] = {}
        self.num_steps = 0
        self.fail_on_step = fail_on_step
        self.last_forward_s = 0.0
        self.scheduled_log: list[SchedulerOutput] = []

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        self.scheduled_log.append(out)
        if self.fail_on_step is not None and self.num_steps == self.fail_on_step:
            raise RuntimeError("injected forward failure")
        for rid in out.released_req_ids:
            self.tokens.pop(rid, None)
        self.slots.apply(out)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prefill_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
            self.eos[new.req_id] = new.eos_token_id
            self.logprobs[new.req_id] = new.sampling_params.logprobs
        cached = out.scheduled_cached_reqs
        for rid, n in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self.computed[rid] = n
        ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        logprobs: list[list[dict[int, float]] | None] = []
        for rid in ids:
            n = out.num_scheduled_tokens[rid]
            tokens = self.tokens[rid]
            self.computed[rid] += n
            assert self.computed[rid] <= len(tokens), (rid, self.computed[rid], len(tokens))
            if self.computed[rid] < len(tokens):
                sampled.append([])
                logprobs.append(None)
                continue
            t = fake_next_token(tokens, self.vocab_size, self.eos[rid])
            tokens.append(t)
            sampled.append([t])
            k = self.logprobs[rid]
            if k is None:
                logprobs.append(None)
            else:
                entry = {t: -0.25}
                for j in range(k):
                    entry.setdefault((t + j + 1) % self.vocab_size, -1.0 - j)
                logprobs.append([entry])
        return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled, logprobs)
