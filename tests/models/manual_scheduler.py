"""A tiny hand-driven scheduler for worker tests: the real one is not needed to drive a runner.

Requests are admitted all at once; each step gives every unfinished request up to `chunk`
tokens (so prefills may be chunked) and allocates the blocks those tokens need. Finished
requests are reported once in `finished_req_ids`; `preempt()` reports a preemption and re-admits
the request (prompt + outputs so far) as a new request on the next step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from slotserve.core.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from slotserve.sampling_params import SamplingParams


@dataclass
class ManualRequest:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_id: int | None = None
    outputs: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    needs_new: bool = True  # next schedule sends it as NewRequestData

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.max_tokens


class ManualScheduler:
    def __init__(self, block_size: int = 4, num_blocks: int = 4096) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, 0, -1))  # block 0 is the null block
        self.requests: dict[str, ManualRequest] = {}
        self.pending_finished: set[str] = set()
        self.pending_preempted: set[str] = set()

    def add(self, req_id: str, prompt: list[int], params: SamplingParams | None = None,
            max_tokens: int = 8, eos_token_id: int | None = None) -> ManualRequest:
        req = ManualRequest(req_id, list(prompt), params or SamplingParams(temperature=0.0),
                            max_tokens, eos_token_id)
        self.requests[req_id] = req
        return req

    def _allocate(self, req: ManualRequest, upto: int) -> list[int]:
        need = math.ceil(upto / self.block_size) - len(req.blocks)
        new = [self.free.pop() for _ in range(max(need, 0))]
        req.blocks.extend(new)
        return new

    def preempt(self, req_id: str) -> None:
        req = self.requests[req_id]
        self.free.extend(reversed(req.blocks))
        req.blocks, req.num_computed, req.needs_new = [], 0, True
        self.pending_preempted.add(req_id)

    def schedule(self, chunk: int | None = None, only: set[str] | None = None
                 ) -> SchedulerOutput:
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        num_sched: dict[str, int] = {}
        for req in self.requests.values():
            if req.done or (only is not None and req.req_id not in only):
                continue
            remaining = len(req.tokens) - req.num_computed
            n = remaining if chunk is None else min(chunk, remaining)
            new_blocks = self._allocate(req, req.num_computed + n)
            if req.needs_new:
                new_reqs.append(NewRequestData(
                    req_id=req.req_id, prompt_token_ids=list(req.prompt),
                    prefill_token_ids=list(req.tokens), block_ids=list(req.blocks),
                    num_computed_tokens=req.num_computed, sampling_params=req.params,
                    num_output_tokens=len(req.outputs), eos_token_id=req.eos_token_id))
                req.needs_new = False
            else:
                cached.req_ids.append(req.req_id)
                cached.new_block_ids.append(new_blocks or None)
                cached.num_computed_tokens.append(req.num_computed)
            num_sched[req.req_id] = n
            req.num_computed += n
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_sched, total_num_scheduled_tokens=sum(num_sched.values()),
            finished_req_ids=self.pending_finished, preempted_req_ids=self.pending_preempted)
        self.pending_finished, self.pending_preempted = set(), set()
        return out

    def update(self, out: ModelRunnerOutput) -> None:
        for req_id, idx in out.req_id_to_index.items():
            req = self.requests[req_id]
            req.outputs.extend(out.sampled_token_ids[idx])
            if out.logprobs is not None and out.logprobs[idx]:
                req.logprobs.extend(out.logprobs[idx])
            if req.done and req_id not in self.pending_finished:
                self.pending_finished.add(req_id)
                self.free.extend(reversed(req.blocks))
                req.blocks = []

    def has_unfinished(self) -> bool:
        return any(not r.done for r in self.requests.values())

    def run(self, runner, chunk: int | None = None, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.has_unfinished():
                break
            self.update(runner.execute_model(self.schedule(chunk)))
        # Deliver the last releases, in a step that schedules nothing.
        runner.execute_model(self.schedule(chunk))
