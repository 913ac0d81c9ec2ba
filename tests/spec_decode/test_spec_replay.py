"""An adaptive speculative run replays exactly from its trace: the policy times steps on the
engine's clock, which the trace records with every schedule and update call, so the replay
proposes the same drafts in every step and ends with the same cost model. A model that
copies its prompt imperfectly (so acceptance varies) and step times that grow steeply with
the step's tokens (so the policy turns speculation on and off) drive the scheduler."""

from __future__ import annotations

import json
import random
from pathlib import Path

from slotserve.check.checker import InvariantChecker
from slotserve.check.observer import SchedulerObserver
from slotserve.check.trace import TraceRecorder, replay
from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.core.outputs import ModelRunnerOutput
from slotserve.core.request import Request
from slotserve.core.scheduler import Scheduler
from slotserve.sampling_params import SamplingParams
from slotserve.spec_decode.config import SpeculativeConfig


def _model(prompt: list[int], pos: int) -> int:
    """The token at `pos`: the prompt again, except where a seeded coin says otherwise."""
    if random.Random(pos * 7919 + prompt[0]).random() < 0.25:
        return 1000 + pos
    return prompt[pos % len(prompt)]


def test_adaptive_trace_replays_exactly(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    sc = SchedulerConfig(max_num_seqs=4, max_model_len=256, speculative_config=SpeculativeConfig(
        method="suffix", num_speculative_tokens=4))
    cc = CacheConfig(num_blocks=96, block_size=8)
    sched = Scheduler(sc, cc)
    observer = SchedulerObserver(sched, InvariantChecker(sched), TraceRecorder(str(path), sc, cc))
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(3, 900) for _ in range(rng.randrange(8, 20))]
               for i in range(6)}
    for rid, p in prompts.items():
        observer.add_request(Request(rid, p, SamplingParams(max_tokens=40, ignore_eos=True)))
    now = 1.0
    while sched.has_requests():
        so = observer.schedule(now=now)
        ids, sampled = [], []
        for rid in so.num_scheduled_tokens:
            r, drafts = sched.requests[rid], so.scheduled_spec_decode_tokens.get(rid, [])
            ids.append(rid)
            if r.num_computed_tokens < r.num_tokens + len(drafts):
                sampled.append([])  # a partial prefill
                continue
            out = []
            for d in [*drafts, None]:
                out.append(_model(prompts[rid], r.num_tokens + len(out)))
                if d != out[-1]:
                    break
            sampled.append(out)
        now += 0.01 + 0.008 * so.total_num_scheduled_tokens + rng.random() * 0.002
        observer.update_from_output(so, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled), now=now)
        now += 0.001
    live = sched.spec
    events = [json.loads(line) for line in path.open()]
    recorded = [e.get("drafts", {}) for e in events if e["event"] == "schedule"]
    stats = sched.make_stats()
    # It speculated, with as many drafts as the policy chose step by step.
    assert len({len(d) for step in recorded for d in step.values()}) > 1
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    replayed, outs = replay(str(path))
    assert [o.scheduled_spec_decode_tokens for o in outs] == recorded
    assert replayed.spec is not None and live is not None and live.cost.seconds
    assert replayed.spec.cost.seconds == live.cost.seconds
