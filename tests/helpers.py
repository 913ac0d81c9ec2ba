"""What the tests share (fixtures live in the conftest.py files): bounded waits, a real
`slotserve serve` process, the C-compiler requirement of the native kernels, scheduler
harnesses, a fake model runner, a hand-driven scheduler for worker tests, tiny random
checkpoints, a test tokenizer, and reading /metrics.

The reference model of the worker's slot table is the invariant checker's own
(`InvariantChecker.holders`); the real table is `slotserve.worker.slots.RequestSlots`.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from slotserve.check import InvariantChecker
from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    GrammarOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from slotserve.core.request import Request
from slotserve.core.scheduler import Scheduler
from slotserve.engine.llm_engine import LLMEngine
from slotserve.sampling_params import SamplingParams
from slotserve.worker.slots import RequestSlots

# Re-exported: the tests import them from here.
from tests.tiny_models import (
    TINY_MODELS as TINY_MODELS,
    TOKENIZER_BOS as TOKENIZER_BOS,
    TOKENIZER_EOS as TOKENIZER_EOS,
    VOCAB as VOCAB,
    TinyModel as TinyModel,
    build_bigram_model as build_bigram_model,
    build_tiny as build_tiny,
    build_tokenizer as build_tokenizer,
    hf_greedy as hf_greedy,
    randomize as randomize,
)

if TYPE_CHECKING:  # torch and transformers load only in the tests that build models
    pass

# ----- bounded waits: a regression fails the test instead of hanging it ----------------------

MAX_STEPS = 10_000


def bounded(pending: Callable[[], bool], max_steps: int = MAX_STEPS) -> Iterator[int]:
    """Yields step numbers while `pending()` holds; fails after max_steps of them."""
    for step in range(max_steps):
        if not pending():
            return
        yield step
    raise AssertionError(f"still pending after {max_steps} steps")


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str,
               interval_s: float = 0.05) -> None:
    """Polls `condition` until it holds; fails with `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


# ----- a real `slotserve serve` process --------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_process(*args: str, startup_s: float = 180.0
                  ) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`slotserve serve ARGS` on a free port, once /health answers: (process, base URL).
    Its stderr goes to a pipe (read it after it exited); it is killed if still running when
    the block ends."""
    import httpx

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "slotserve.entrypoints.cli", "serve", "--port", str(port),
         *args], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            return httpx.get(f"{base}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, startup_s, "the server's /health", interval_s=0.2)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


# ----- the native kernels --------------------------------------------------------------------

def require_compiler(what: str) -> None:
    """Skips (visibly) where no C compiler can build `what`; under CI (CI=true), whose images
    have one, fails instead, so the native paths are never skipped there."""
    from slotserve.models.native_build import find_compiler

    if find_compiler() is not None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and no C compiler: {what} cannot be built")
    pytest.skip(f"no C compiler: {what} cannot be built")


# ----- the scheduler, driven by hand ---------------------------------------------------------

EOS = 2


def make_scheduler(block_size: int = 16, num_blocks: int = 1024,
                   enable_prefix_caching: bool = True, **scheduler_config: Any) -> Scheduler:
    """A scheduler with test defaults; keywords other than the cache's go to SchedulerConfig."""
    config = {"max_num_seqs": 16, "max_num_batched_tokens": 8192, "max_model_len": 8192,
              **scheduler_config}
    return Scheduler(SchedulerConfig(**config),
                     CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                 enable_prefix_caching=enable_prefix_caching))


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


class Harness:
    """Scheduler + checker + a fake model that samples a fixed token. The checker is the
    reference model of the worker's slot table (`checker.holders`): it raises "No free
    indices" the moment a step would overflow it."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.checker = InvariantChecker(sched)

    def schedule(self) -> SchedulerOutput:
        out = self.sched.schedule(now=time.monotonic())
        self.checker.on_schedule(out)
        return out

    def step(self, token: int | dict[str, int] = 42
             ) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        out = self.schedule()
        return out, self.sched.update_from_output(out, sample_for(self.sched, out, token),
                                                  now=time.monotonic())

    def run_until_idle(self, token: int = 42, max_steps: int = MAX_STEPS) -> int:
        steps = 0
        for _ in bounded(self.sched.has_requests, max_steps):
            self.step(token)
            steps += 1
        return steps


# ----- a torch-free model runner ------------------------------------------------------------

# The fake_engine fixture: keywords are EngineArgs plus num_blocks, max_position_embeddings
# and fail_on_step (the fake runner's forward pass raises on that step).
FakeEngineFactory = Callable[..., LLMEngine]

def fake_next_token(context: list[int], vocab_size: int, eos: int | None) -> int:
    """A hash of the whole context: any mistake in what the worker is handed shows."""
    h = 0
    for t in context:
        h = (h * 1000003 + t + 1) % 2147483647
    if eos is not None and h % 97 == 0:
        return eos
    return 3 + h % (vocab_size - 3)  # 0..2 are special in the test tokenizer


class FakeModelRunner:
    """A torch-free stand-in for the ModelRunner whose next token is fake_next_token: equal
    outputs across engine configurations mean the worker saw the same contexts."""

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

    def execute_model(self, out: SchedulerOutput,
                      grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        self.num_steps += 1
        allowed = allowed_tokens(grammar_output, self.vocab_size)
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
            if rid in allowed:
                # Under a grammar: the fake token if allowed, else one the hash picks.
                ok = allowed.pop(rid)
                if t not in ok:
                    t = ok[fake_next_token(tokens, 1 << 30, None) % len(ok)]
            tokens.append(t)
            sampled.append([t])
            k = self.logprobs[rid]
            entry = {t: -0.25}
            for j in range(k or 0):
                entry.setdefault((t + j + 1) % self.vocab_size, -1.0 - j)
            logprobs.append(None if k is None else [entry])
        assert not allowed, f"grammar rows for requests that do not sample: {list(allowed)}"
        return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled, logprobs)


def allowed_tokens(grammar_output: GrammarOutput | None, vocab_size: int
                   ) -> dict[str, list[int]]:
    """Per request under a grammar, the token ids its bitmask row allows."""
    if grammar_output is None:
        return {}
    import numpy as np

    bitmask = grammar_output.ready_bitmask()
    out = {}
    for row, rid in enumerate(grammar_output.structured_output_request_ids):
        bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")[:vocab_size]
        out[rid] = np.nonzero(bits)[0].tolist()
    return out


# ----- a hand-driven scheduler for worker tests ----------------------------------------------

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

    def run(self, runner, chunk: int | None = None, max_steps: int = MAX_STEPS) -> None:
        for _ in bounded(self.has_unfinished, max_steps):
            self.update(runner.execute_model(self.schedule(chunk)))
        # Deliver the last releases, in a step that schedules nothing.
        runner.execute_model(self.schedule(chunk))


@contextmanager
def cli_server(args: list[str], timeout_s: float = 180.0) -> Iterator[str]:
    """`slotserve serve ARGS` on a free port, started as a user starts it (serve_process): its
    base URL once /health answers 200; terminated (SIGTERM) afterwards."""
    with serve_process(*args, startup_s=timeout_s) as (proc, base):
        try:
            yield base
        finally:
            proc.terminate()
            proc.wait(30)
