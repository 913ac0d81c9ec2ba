"""End to end at the worker boundary: the real Scheduler drives the real ModelRunner.

Shared prompt prefixes (prefix-cache hits: a prefill starts after cached blocks), a small
token budget (chunked prefills mixed with decodes) and a tight KV pool (preemption and
recompute) must still give exactly HF's greedy tokens, with the invariant checker on. Gemma 3's
prompts (21-50 tokens) and outputs run far past its 6-token window, with either decode path.
"""

from __future__ import annotations

import pytest
import torch

from slotserve.check import InvariantChecker
from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.core.request import Request
from slotserve.core.scheduler import Scheduler
from slotserve.sampling_params import SamplingParams
from slotserve.worker.model_runner import ModelRunner
from tests.helpers import VOCAB, TinyModel, hf_greedy

NEW = 24


@pytest.mark.parametrize("name,native", [("llama", True), ("gemma3", True),
                                         ("gemma3", False)])
def test_scheduler_and_runner_match_hf(tiny_models: dict[str, TinyModel], name: str,
                                       native: bool) -> None:
    model = tiny_models[name]
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(3, VOCAB, (20,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, VOCAB, (n,), generator=gen).tolist()
               for n in (1, 4, 9, 15, 2, 30)]
    refs = [hf_greedy(model.hf, p, NEW)[0] for p in prompts]

    sched_cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, max_model_len=96)
    # 30 usable blocks of 4 tokens cannot hold four ~50-token requests: preemption happens.
    cache_cfg = CacheConfig(block_size=4, num_blocks=31, enable_prefix_caching=True)
    scheduler = Scheduler(sched_cfg, cache_cfg)
    runner = ModelRunner(model.path, sched_cfg, cache_cfg, device="cpu",
                         native_attention=native)
    checker = InvariantChecker(scheduler)
    for i, p in enumerate(prompts):
        scheduler.add_request(Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=NEW,
                                                                 ignore_eos=True)))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    mixed_steps = 0
    for _ in range(1000):
        if not scheduler.has_requests():
            break
        so = scheduler.schedule()
        checker.on_schedule(so)
        counts = so.num_scheduled_tokens.values()
        mixed_steps += any(n == 1 for n in counts) and any(n > 1 for n in counts)
        ro = runner.execute_model(so)
        checker.check_worker_slots(runner.slots)
        for out in scheduler.update_from_output(so, ro):
            outputs[out.request_id].extend(out.new_token_ids)
    last = scheduler.schedule()  # deliver the last releases
    checker.on_schedule(last)
    runner.execute_model(last)
    checker.check_worker_slots(runner.slots)
    checker.assert_drained()
    stats = scheduler.make_stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0 and mixed_steps > 0
    assert len(runner.slots) == 0
    for i, ref in enumerate(refs):
        assert outputs[f"r{i}"] == ref, f"r{i} diverged"
