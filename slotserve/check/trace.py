"""Record the events that drive a scheduler, and replay them deterministically.

Everything that changes scheduler state comes through five calls: add_request,
finish_requests, reset_prefix_cache, schedule and update_from_output, which
SchedulerObserver (check/observer.py) records as they are made. A trace is a JSON-lines
file of those calls (with the sampled tokens the model returned), so a failure seen in a
server replays offline, with the invariant checker on, down to the step that broke a rule:

    SLOTSERVE_TRACE=/tmp/trace.jsonl slotserve serve ...      # record
    python -m slotserve.check.trace /tmp/trace.jsonl           # replay with the checker

Each schedule() and update_from_output() call is recorded with the engine's clock (`now`), so
idle-session timeouts replay at the same step.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import IO, Any

from slotserve.check.checker import InvariantChecker
from slotserve.check.grammar import ReplayGrammar
from slotserve.check.observer import SchedulerObserver
from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from slotserve.core.request import Request, RequestStatus
from slotserve.core.scheduler import Scheduler
from slotserve.core.structured_output import StructuredOutputRequest
from slotserve.lora.request import LoRARequest
from slotserve.sampling_params import SamplingParams, StructuredOutputsParams
from slotserve.spec_decode.config import SpeculativeConfig


def _params_dict(p: SamplingParams) -> dict[str, Any]:
    out = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)
           if not f.name.startswith("_")}
    if p.structured_outputs is not None:
        out["structured_outputs"] = dataclasses.asdict(p.structured_outputs)
    return out


class TraceRecorder:
    def __init__(self, path: str, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig) -> None:
        self._f: IO[str] = open(path, "w")  # noqa: SIM115 - lives as long as the engine
        self._num_schedules = 0
        self._step_of: dict[int, int] = {}
        self._last_update = 0
        self._write({"event": "config", "scheduler": dataclasses.asdict(scheduler_config),
                     "cache": dataclasses.asdict(cache_config)})

    def _write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def add_request(self, r: Request) -> None:
        self._write({"event": "add", "id": r.request_id, "prompt": r.prompt_token_ids,
                     "params": _params_dict(r.sampling_params), "eos": r.eos_token_id,
                     "priority": r.priority, "arrival_time": r.arrival_time,
                     "resumable": r.resumable, "cache_salt": r.cache_salt,
                     "grammar": r.use_structured_output,
                     "lora": dataclasses.astuple(r.lora_request) if r.lora_request else None})

    def finish_requests(self, ids: list[str], status: RequestStatus) -> None:
        self._write({"event": "finish", "ids": list(ids), "status": status.name})

    def reset_prefix_cache(self, reset_running_requests: bool) -> None:
        self._write({"event": "reset", "reset_running_requests": reset_running_requests})

    def schedule(self, out: SchedulerOutput | None, now: float | None = None) -> None:
        """Record a schedule(now) call; `out` is None when it raised (the replay raises there
        too)."""
        self._num_schedules += 1
        if out is not None:
            self._step_of[id(out)] = self._num_schedules
        record: dict[str, Any] = {"event": "schedule", "step": self._num_schedules, "now": now}
        if out is not None and out.scheduled_spec_decode_tokens:
            record["drafts"] = out.scheduled_spec_decode_tokens  # what a replay must repeat
        self._write(record)

    def update(self, out: SchedulerOutput, mro: ModelRunnerOutput,
               now: float | None = None) -> None:
        self._last_update = self._step_of.pop(id(out))
        record: dict[str, Any] = {"event": "update", "step": self._last_update,
                                  "req_ids": mro.req_ids, "sampled": mro.sampled_token_ids,
                                  "now": now}
        if mro.failed:
            record["failed"] = mro.failed
        self._write(record)

    def grammars_ready(self, ready: dict[str, str | None]) -> None:
        """The requests whose grammar the call just recorded found compiled (or failed)."""
        self._write({"event": "ready", "ids": ready})

    def grammar_outcomes(self, completed: list[str], failed: dict[str, str]) -> None:
        """What the grammars did with the last update's tokens (a replay has no grammar
        library: it is told where each grammar completed or failed)."""
        if completed or failed:
            self._write({"event": "grammar", "step": self._last_update,
                         "completed": completed, "failed": failed})

    def close(self) -> None:
        self._f.close()


def replay(path: str, check: bool = True) -> tuple[Scheduler, list[SchedulerOutput]]:
    """Re-run a trace; raises the checker's InvariantViolation at the step that breaks."""
    scheduler: Scheduler | None = None
    observer: SchedulerObserver | None = None
    outputs: dict[int, SchedulerOutput] = {}
    ordered: list[SchedulerOutput] = []
    with open(path) as f:
        events = [json.loads(line) for line in f]
    outcomes = {e["step"]: e for e in events if e["event"] == "grammar"}
    for i, e in enumerate(events):
        kind = e["event"]
        # Readiness the recorded call found holds when the replayed one looks.
        nxt = events[i + 1] if i + 1 < len(events) else {}
        ready: dict[str, str | None] = nxt.get("ids", {}) if nxt.get("event") == "ready" else {}
        if kind == "config":
            # A speculative config comes back as its dict (an adaptive one decides from
            # step times on the engine's clock, recorded with each call: it replays exactly).
            sc = {**e["scheduler"], "speculative_config": SpeculativeConfig.from_any(
                e["scheduler"].get("speculative_config"))}
            scheduler = Scheduler(SchedulerConfig(**sc), CacheConfig(**e["cache"]))
            observer = SchedulerObserver(scheduler, InvariantChecker(scheduler) if check else None)
            continue
        assert scheduler is not None and observer is not None, "a trace starts with its config"
        for rid, failure in ready.items():
            if rid in scheduler.requests:
                grammar = _replay_grammar(scheduler, rid)
                grammar.ready, grammar.failure = True, failure
        if kind == "add":
            params = e["params"]
            if params.get("logit_bias"):  # JSON object keys are strings
                params["logit_bias"] = {int(t): v for t, v in params["logit_bias"].items()}
            if params.get("structured_outputs") is not None:
                params["structured_outputs"] = StructuredOutputsParams(
                    **params["structured_outputs"])
            sor = (StructuredOutputRequest(ReplayGrammar(
                failure=ready.get(e["id"]), ready=e["id"] in ready)) if e.get("grammar")
                else None)
            observer.add_request(Request(
                e["id"], e["prompt"], SamplingParams(**params), eos_token_id=e["eos"],
                priority=e["priority"], arrival_time=e["arrival_time"],
                resumable=e["resumable"], cache_salt=e["cache_salt"],
                structured_output_request=sor,
                lora_request=LoRARequest(*e["lora"]) if e.get("lora") else None))
        elif kind == "finish":
            observer.finish_requests(e["ids"], RequestStatus[e["status"]])
        elif kind == "reset":
            observer.reset_prefix_cache(e["reset_running_requests"])
        elif kind == "schedule":
            out = observer.schedule(now=e.get("now"))
            outputs[e["step"]] = out
            ordered.append(out)
        elif kind == "update":
            outcome = outcomes.get(e["step"])
            if outcome is not None:
                _tell_grammars(scheduler, outcome)
            ids = e["req_ids"]
            observer.update_from_output(outputs.pop(e["step"]), ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=e["sampled"], failed=e.get("failed")), now=e.get("now"))
    assert scheduler is not None, "empty trace"
    return scheduler, ordered


def _tell_grammars(scheduler: Scheduler, outcome: dict[str, Any]) -> None:
    for rid in outcome["completed"]:
        grammar = _replay_grammar(scheduler, rid)
        grammar.completes_next = True
    for rid, message in outcome["failed"].items():
        _replay_grammar(scheduler, rid).fails_next = message


def _replay_grammar(scheduler: Scheduler, request_id: str) -> ReplayGrammar:
    sor = scheduler.requests[request_id].structured_output_request
    assert sor is not None and isinstance(sor.grammar, ReplayGrammar)
    return sor.grammar


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m slotserve.check.trace TRACE.jsonl", file=sys.stderr)
        return 2
    scheduler, outs = replay(args[0])
    print(f"replayed {len(outs)} steps with the checker on: no invariant broken; "
          f"{len(scheduler.requests)} requests left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
