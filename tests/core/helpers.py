"""Shared helpers for scheduler tests: build schedulers and requests, fake a model step."""

from __future__ import annotations

from slotserve.check import InvariantChecker
from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from slotserve.core.request import Request
from slotserve.core.scheduler import Scheduler
from slotserve.sampling_params import SamplingParams

EOS = 2


def make_scheduler(max_num_seqs: int = 16, max_num_batched_tokens: int = 8192,
                   max_model_len: int = 8192, block_size: int = 16, num_blocks: int = 1024,
                   policy: str = "fcfs", enable_chunked_prefill: bool = True,
                   enable_prefix_caching: bool = True, long_prefill_token_threshold: int = 0,
                   streaming_session_timeout_s: float = 600.0) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len, policy=policy,  # type: ignore[arg-type]
                        enable_chunked_prefill=enable_chunked_prefill,
                        long_prefill_token_threshold=long_prefill_token_threshold,
                        streaming_session_timeout_s=streaming_session_timeout_s),
        CacheConfig(block_size=block_size, num_blocks=num_blocks,
                    enable_prefix_caching=enable_prefix_caching),
    )


def make_request(req_id: str, prompt: list[int] | int, max_tokens: int = 16, *,
                 priority: int = 0, arrival_time: float | None = None, resumable: bool = False,
                 stop_token_ids: list[int] | None = None, ignore_eos: bool = False,
                 min_tokens: int = 0, eos: int | None = EOS, cache_salt: str | None = None,
                 start: int = 100) -> Request:
    if isinstance(prompt, int):
        prompt = list(range(start, start + prompt))
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_token_ids,
                            ignore_eos=ignore_eos, min_tokens=min_tokens, temperature=0.0)
    return Request(req_id, prompt, params, eos_token_id=eos, priority=priority,
                   arrival_time=arrival_time, resumable=resumable, cache_salt=cache_salt)


def runner_output(ids: list[str], sampled: list[list[int]]) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=list(ids), req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled)


def sample_for(sched: Scheduler, out: SchedulerOutput, token: int | dict[str, int] = 42
               ) -> ModelRunnerOutput:
    """One token for every scheduled request whose prefill completes this step."""
    ids, sampled = [], []
    for rid in out.num_scheduled_tokens:
        r = sched.requests.get(rid)
        ids.append(rid)
        done = r is not None and r.num_computed_tokens >= r.num_tokens
        t = token.get(rid, 42) if isinstance(token, dict) else token
        sampled.append([t] if done else [])
    return runner_output(ids, sampled)


class WorkerSlots:
    """A faithful model of the MRV2 worker slot table, as in vLLM's regression tests."""

    def __init__(self, max_num_reqs: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.occupied: set[str] = set()

    def apply(self, out: SchedulerOutput) -> None:
        self.occupied -= out.finished_req_ids | out.preempted_req_ids
        for rid in out.scheduled_cached_reqs.req_ids:
            assert rid in self.occupied, f"cached req {rid} has no worker slot"
        for new in out.scheduled_new_reqs:
            self.occupied.discard(new.req_id)
            assert len(self.occupied) < self.max_num_reqs, "No free indices"
            self.occupied.add(new.req_id)


class Harness:
    """Scheduler + checker + a fake model that samples a fixed token."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.checker = InvariantChecker(sched)

    def schedule(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.checker.on_schedule(out)
        return out

    def step(self, token: int | dict[str, int] = 42):  # noqa: ANN201
        out = self.schedule()
        return out, self.sched.update_from_output(out, sample_for(self.sched, out, token))

    def run_until_idle(self, token: int = 42, max_steps: int = 10_000) -> int:
        steps = 0
        while self.sched.has_requests() and steps < max_steps:
            self.step(token)
            steps += 1
        return steps
