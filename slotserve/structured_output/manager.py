"""StructuredOutputManager (vLLM's name): compiles grammars off the step loop, caches them by
their text, and fills each step's token bitmask.

- `make_request(text)` gives a request its grammar at once, a `CompilingGrammar`: the
  scheduler keeps the request WAITING_FOR_GRAMMAR (no slot, no block) until its
  `is_ready()`. `request_grammar(text, client)` returns a future of the compiled grammar.
  Compiles run on background threads (llguidance drops the GIL while it builds), so the step
  loop never waits for one, round-robin over the clients the API names, at most one per
  client at a time (structured_output.compile_queue); a cached text answers at once. A
  compile that fails (the parser limits of structured_output.limits, or a failure within the
  first token), or takes longer than `compile_timeout_s`, fails with GrammarCompileError
  carrying a bounded excerpt of the library's message. A request's own deadline runs from
  when the core admitted it (or from when the tokenizer, built once before the first
  grammar, is ready): waiting behind its client's other compiles counts; a compile that no
  request waits for any more is cancelled before it starts.
- The cache of compiled grammars is bounded in bytes (`max_cached_bytes`, each entry charged
  what the process grew by while compiling it, at least its text) as well as in entries.
  Failed grammars stay out of it: only their message is remembered (a short list, so that a
  client resending one is refused without a compile; not for timeouts, which depend on the
  load), and the memory their compile took goes back to the system.
- `grammar_bitmask(requests, scheduler_output)` builds the GrammarOutput of a step: one row
  per request that samples in it and has a grammar, filled from the matchers the scheduler
  advanced. Each client's rows may take `mask_budget_s` of a step together (docs/
  STRUCTURED_OUTPUTS.md, "Mask-time budget"): past it, its costliest rows' requests are
  refused after this step (their grammar fails, and the scheduler ends them with an error),
  so one client's ambiguous grammar under n=64 cannot slow every other stream's step.
  Requests without a client (offline use) are never refused. With `overlap=True` the rows are filled on a helper thread while the forward
  pass runs (the engine's default when the model runs on an accelerator); the worker waits
  for them just before sampling.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import llguidance
import numpy as np
import numpy.typing as npt

from slotserve.core.outputs import GrammarOutput, SchedulerOutput
from slotserve.core.request import Request
from slotserve.core.structured_output import StructuredOutputRequest
from slotserve.memory import resident_bytes, trim_heap
from slotserve.structured_output.backend import (
    GrammarCompileError,
    GuidanceBackend,
    GuidanceGrammar,
    allocate_bitmask,
)
from slotserve.structured_output.compile_queue import FairCompileExecutor
from slotserve.structured_output.limits import RateLimitedLog

CompiledGrammar = llguidance.LLMatcher
logger = logging.getLogger(__name__)
_failure_log = RateLimitedLog(logger)
# Failed grammar texts whose message is remembered (each message is a bounded excerpt; the
# text is kept only as its hash).
MAX_REMEMBERED_FAILURES = 256
# What one client's grammar masks may take of a step (all its rows together). A JSON schema's
# mask for a 262k vocabulary takes 0.1-1 ms; an ambiguous Lark grammar's grows with every
# token (n=64 of `s: s s | "a" | "b"` took 80 ms per step).
DEFAULT_MASK_BUDGET_S = 0.01
# The error code of a request refused for its masks' cost (a 400 for the client).
GRAMMAR_TOO_EXPENSIVE = "grammar_too_expensive"


@dataclass(slots=True)
class StructuredOutputStats:
    """Cumulative: grammars compiled (cache misses) and the seconds they took; bitmask rows
    filled, the seconds spent filling them, and the part of that the step loop waited for
    (all of it without overlap; only what the forward pass did not hide with it). Now: the
    compiled grammars cached and the bytes they are charged."""

    num_compiled: int = 0
    compile_s: float = 0.0
    num_failed: int = 0
    cached_bytes: int = 0
    cached_entries: int = 0
    num_mask_rows: int = 0
    num_mask_refused: int = 0
    mask_fill_s: float = 0.0
    mask_wait_s: float = 0.0


class StructuredOutputManager:
    def __init__(self, backend: GuidanceBackend, max_num_seqs: int, *,
                 compile_timeout_s: float = 10.0, max_cached: int = 512,
                 max_cached_bytes: int = 128 << 20, overlap: bool = True,
                 mask_budget_s: float | None = DEFAULT_MASK_BUDGET_S) -> None:
        self.backend = backend
        self.compile_timeout_s = compile_timeout_s
        self.max_cached = max_cached
        self.max_cached_bytes = max_cached_bytes
        self.overlap = overlap
        self.mask_budget_s = mask_budget_s
        self.stats = StructuredOutputStats()
        # Called (on the compile thread) when a compile starts and when it ends: wakes an idle
        # step loop, which then knows the compile's deadline, or admits its requests.
        self.on_progress: Callable[[], None] | None = None
        # When the tokenizer became ready: no request's deadline runs before.
        self.tokenizer_ready_at: float | None = None
        # Requests waiting for each text's compile (a compile none waits for is cancelled).
        self._waiters: dict[str, int] = {}
        self._cache: OrderedDict[str, tuple[CompiledGrammar, int]] = OrderedDict()
        self._failures: OrderedDict[int, str] = OrderedDict()
        self._inflight: dict[str, concurrent.futures.Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self._compiler = FairCompileExecutor("slotserve-grammar")
        self._filler = (concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="slotserve-bitmask") if overlap else None)
        self._max_num_seqs = max_num_seqs
        self._bitmask: npt.NDArray[np.int32] | None = None

    # ----- compiling ---------------------------------------------------------------------------

    def request_grammar(self, grammar: str, client: str = ""
                        ) -> concurrent.futures.Future[CompiledGrammar]:
        with self._lock:
            cached = self._cache.get(grammar)
            failure = self._failures.get(hash(grammar)) if cached is None else None
            if cached is not None or failure is not None:
                done: concurrent.futures.Future[CompiledGrammar] = concurrent.futures.Future()
                if cached is not None:
                    self._cache.move_to_end(grammar)
                    done.set_result(cached[0])
                else:
                    assert failure is not None
                    done.set_exception(GrammarCompileError(failure))
                return done
            future = self._inflight.get(grammar)
            if future is None:
                future = self._compiler.submit(self._compile, grammar, size=len(grammar),
                                               client=client)
                self._inflight[grammar] = future
                # Once the future is done, not before: a loop woken earlier would find it
                # still pending, and with its compile no longer started, no deadline to
                # wake it again.
                future.add_done_callback(lambda _: self._progress())
            return future

    def _compile(self, grammar: str) -> CompiledGrammar:
        result: CompiledGrammar | GrammarCompileError
        start = time.monotonic()
        timed_out = False
        try:
            self.backend.prepare()  # built once, outside any grammar's time
            start = time.monotonic()
            if self.tokenizer_ready_at is None:
                self.tokenizer_ready_at = start
                self._progress()  # the loop now knows its requests' deadlines
            before = resident_bytes()
            result = self.backend.compile(grammar)
            cost = max(resident_bytes() - before, len(grammar))
        except GrammarCompileError as exc:
            result = exc
        except Exception as exc:  # noqa: BLE001 - a library failure fails this grammar only
            result = GrammarCompileError(f"{type(exc).__name__}: {exc}")
        took = time.monotonic() - start
        if not isinstance(result, GrammarCompileError) and took > self.compile_timeout_s:
            timed_out = True
            result = GrammarCompileError(
                f"compiling the grammar took {took:.1f} s, more than the limit of "
                f"{self.compile_timeout_s:g} s")
        with self._lock:
            self.stats.num_compiled += 1
            self.stats.compile_s += took
            if isinstance(result, GrammarCompileError):
                self.stats.num_failed += 1
                if not timed_out:
                    self._remember_failure(grammar, str(result))
            else:
                self._cache[grammar] = (result, cost)
                self.stats.cached_bytes += cost
                self._evict()
                self.stats.cached_entries = len(self._cache)
            self._inflight.pop(grammar, None)
            self._waiters.pop(grammar, None)
        if isinstance(result, GrammarCompileError):
            message = str(result)
            _failure_log.warning("grammar of %d bytes refused: %s", len(grammar), message)
            del result  # with it the library's temporaries (the matcher of a timed-out compile)
            trim_heap()
            raise GrammarCompileError(message)
        return result

    def _remember_failure(self, grammar: str, message: str) -> None:
        self._failures[hash(grammar)] = message
        while len(self._failures) > MAX_REMEMBERED_FAILURES:
            self._failures.popitem(last=False)

    def _evict(self) -> None:
        """Drop the least recently used grammars until the cache is within both bounds (the
        newest stays even alone over the byte bound: its requests are about to use it)."""
        evicted = False
        while len(self._cache) > 1 and (len(self._cache) > self.max_cached or
                                        self.stats.cached_bytes > self.max_cached_bytes):
            _, (_, cost) = self._cache.popitem(last=False)
            self.stats.cached_bytes -= cost
            evicted = True
        if evicted:
            trim_heap()

    def clear_cache(self) -> None:
        """Drop every compiled grammar (requests running keep their own matchers) and hand
        the heap back: what the cache held, measured."""
        with self._lock:
            self._cache.clear()
            self.stats.cached_bytes = self.stats.cached_entries = 0
        trim_heap()

    def _progress(self) -> None:
        if self.on_progress is not None:
            self.on_progress()

    def make_request(self, grammar: str, client: str | None = None) -> StructuredOutputRequest:
        """One request's grammar, compiling (or cached) from this moment, in the turn of
        `client` (None: the anonymous client)."""
        with self._lock:
            self._waiters[grammar] = self._waiters.get(grammar, 0) + 1
        return StructuredOutputRequest(CompilingGrammar(self, grammar, client))

    def release(self, grammar: str, future: concurrent.futures.Future[CompiledGrammar]
                ) -> None:
        """A request stopped waiting for `grammar`; its compile is cancelled when it has not
        started and no other request waits for it."""
        with self._lock:
            left = self._waiters.get(grammar, 0) - 1
            if left > 0:
                self._waiters[grammar] = left
                return
            self._waiters.pop(grammar, None)
            if self._inflight.get(grammar) is future and future.cancel():
                del self._inflight[grammar]

    def next_deadline(self, requests: Iterable[Request]) -> float | None:
        """The earliest deadline of these waiting requests (None before the tokenizer is
        ready: the manager wakes the loop once it is)."""
        deadlines = [d for g in _compiling(requests) if (d := g.deadline()) is not None]
        return min(deadlines, default=None)

    def wait(self, requests: Iterable[Request], timeout: float) -> None:
        """Block until one of these waiting requests' grammars is compiled, or timeout."""
        futures = [g.future for g in _compiling(requests)]
        if futures:
            concurrent.futures.wait(futures, timeout=max(0.0, timeout),
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    # ----- bitmasks ----------------------------------------------------------------------------

    def grammar_bitmask(self, requests: Mapping[str, Request],
                        scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The rows of the requests that sample in this step (their prefill completes) and
        have a grammar, in the order of num_scheduled_tokens."""
        rows: list[tuple[str, GuidanceGrammar, list[int]]] = []
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for rid in scheduler_output.num_scheduled_tokens:
            r = requests.get(rid)
            # schedule() advanced num_computed_tokens already: equal means it samples (a
            # request with drafts advanced by them too).
            d = drafts.get(rid, [])
            if (r is None or r.structured_output_request is None
                    or r.num_computed_tokens < r.num_tokens + len(d)):
                continue
            grammar = r.structured_output_request.grammar
            assert isinstance(grammar, GuidanceGrammar)
            rows.append((rid, grammar, d))
        if not rows:
            return None
        # A request verifying k drafts samples k + 1 positions: a row for each, the i-th
        # as if the first i drafts were kept.
        ids = [rid for rid, _, d in rows for _ in range(1 + len(d))]
        if self._bitmask is None or len(self._bitmask) < len(ids):
            self._bitmask = allocate_bitmask(max(self._max_num_seqs, len(ids)),
                                             self.backend.ll_tokenizer.vocab_size)
        bitmask = self._bitmask[:len(ids)]
        if self._filler is None:
            self._fill(rows, bitmask)
            return GrammarOutput(ids, bitmask)
        future = self._filler.submit(self._fill, rows, bitmask)

        def wait() -> None:
            start = time.perf_counter()
            future.result()
            self.stats.mask_wait_s += time.perf_counter() - start

        return GrammarOutput(ids, bitmask, wait)

    def _fill(self, rows: list[tuple[str, GuidanceGrammar, list[int]]],
              bitmask: npt.NDArray[np.int32]) -> None:
        start = time.perf_counter()
        # A row's cost is the CPU time of this thread (llguidance fills it here): a loaded
        # machine that preempts the thread makes no grammar look costly.
        last = time.thread_time()
        spent: dict[str, list[tuple[float, CompilingGrammar]]] = {}
        i = 0
        for _, grammar, drafts in rows:
            grammar.fill_bitmask(bitmask, i, drafts)
            i += 1 + len(drafts)
            now = time.thread_time()
            if isinstance(grammar, CompilingGrammar) and grammar.client is not None:
                spent.setdefault(grammar.client, []).append((now - last, grammar))
            last = now
        took = time.perf_counter() - start
        if self.mask_budget_s is not None:
            for costs in spent.values():
                self._enforce_mask_budget(costs, self.mask_budget_s)
        self.stats.num_mask_rows += i
        self.stats.mask_fill_s += took
        if self._filler is None:
            self.stats.mask_wait_s += took

    def _enforce_mask_budget(self, costs: list[tuple[float, CompilingGrammar]],
                             budget_s: float) -> None:
        """One client's costliest rows, until the rest fit its budget for a step, are over
        it: the second time a row is, its request is refused (a one-off spike, the lexer
        building states for a new part of a large schema, is not)."""
        total = spent = sum(took for took, _ in costs)
        if total <= budget_s:
            return
        for took, grammar in sorted(costs, key=lambda c: c[0], reverse=True):
            if total <= budget_s:
                break
            total -= took
            grammar.mask_strikes += 1
            if grammar.mask_strikes < 2:
                continue
            grammar.refuse(
                f"the grammar is too costly to follow: the token masks of its client's "
                f"{len(costs)} constrained sequences took {spent * 1e3:.1f} ms of one step "
                f"(this one's {took * 1e3:.1f} ms), over the budget of {budget_s * 1e3:g} ms "
                "per client and step (an ambiguous grammar, or too many constrained "
                "sequences at once)", GRAMMAR_TOO_EXPENSIVE)
            self.stats.num_mask_refused += 1
            _failure_log.warning("a constrained request refused: its client's %d masks took "
                                 "%.1f ms of a step", len(costs), spent * 1e3)

    def shutdown(self) -> None:
        self._compiler.shutdown()
        if self._filler is not None:
            self._filler.shutdown(wait=False, cancel_futures=True)


class CompilingGrammar(GuidanceGrammar):
    """A request's matcher from the moment its grammar is asked for: ready once the compile
    ended (the matcher is then a fresh copy of the compiled one), failed, or ran past the
    manager's limit counted from the request's admission (`error` says which, and the
    scheduler refuses the request)."""

    __slots__ = ("text", "future", "admitted", "client", "mask_strikes", "_manager")

    def __init__(self, manager: StructuredOutputManager, text: str, client: str | None = None
                 ) -> None:
        # The matcher is set once the compile is done: nothing advances it before.
        self._consumed: list[int] = []
        self._error: str | None = None
        self._refusal: str | None = None
        self.text, self._manager = text, manager
        self.admitted, self.client = time.monotonic(), client
        self.mask_strikes = 0
        self.future = manager.request_grammar(text, client or "")

    def deadline(self) -> float | None:
        ready_at = self._manager.tokenizer_ready_at
        if ready_at is None:
            return None
        return max(self.admitted, ready_at) + self._manager.compile_timeout_s

    def is_ready(self) -> bool:
        if self._error is not None or hasattr(self, "matcher"):
            return True
        if self.future.done() and not self.future.cancelled():
            self._manager.release(self.text, self.future)
            try:
                self.matcher = self.future.result().deep_copy()
            except Exception as exc:  # noqa: BLE001 - GrammarCompileError, or a library failure
                self._error = f"invalid grammar: {exc}"
            return True
        deadline = self.deadline()
        if deadline is None or time.monotonic() <= deadline:
            return False
        self._manager.release(self.text, self.future)
        self._error = ("the grammar was not compiled within the limit of "
                       f"{self._manager.compile_timeout_s:g} s")
        return True


def _compiling(requests: Iterable[Request]) -> list[CompilingGrammar]:
    return [g for r in requests if r.structured_output_request is not None
            and isinstance(g := r.structured_output_request.grammar, CompilingGrammar)]
