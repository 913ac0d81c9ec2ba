"""StepRunner, the worker's bookkeeping without the model, stays torch-free: a runner whose model
and sampler are numpy (or native code) keeps the torch runner's slot table and step logic."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A numpy "model" whose logits at each position favour the position's input token + 1, run
# for a prefill and two decode steps in a fresh interpreter.
CODE = """
import sys

import numpy as np

from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from slotserve.sampling_params import SamplingParams
from slotserve.worker.sampling_arrays import SampledArrays, SamplingArrays
from slotserve.worker.step_runner import StepInputs, StepRunner

VOCAB = 32


class NextTokenRunner(StepRunner[np.ndarray]):
    def _forward(self, inputs: StepInputs, logits_indices: np.ndarray) -> np.ndarray:
        logits = np.zeros((len(logits_indices), VOCAB), dtype=np.float32)
        logits[np.arange(len(logits_indices)),
               (inputs.input_ids[logits_indices] + 1) % VOCAB] = 1.0
        return logits

    def _sample(self, logits: np.ndarray, arrays: SamplingArrays) -> SampledArrays:
        assert arrays.all_greedy
        return SampledArrays(sampled=logits.argmax(axis=1).astype(np.int64))


runner = NextTokenRunner(SchedulerConfig(max_num_seqs=2, max_model_len=16),
                         CacheConfig(block_size=4, num_blocks=8), VOCAB)
new = NewRequestData(req_id="a", prompt_token_ids=[3, 4, 5], prefill_token_ids=[3, 4, 5],
                     block_ids=[1, 2], num_computed_tokens=0,
                     sampling_params=SamplingParams(temperature=0.0))
out = runner.execute_model(SchedulerOutput(
    scheduled_new_reqs=[new], scheduled_cached_reqs=CachedRequestData(),
    num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3, finished_req_ids=set(),
    preempted_req_ids=set()))
tokens = list(out.sampled_token_ids[0])
for computed in (3, 4):
    out = runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(
            req_ids=["a"], new_block_ids=[None], num_computed_tokens=[computed]),
        num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1, finished_req_ids=set(),
        preempted_req_ids=set()))
    tokens += out.sampled_token_ids[0]
print("sampled:", tokens)
print("torch imported:", "torch" in sys.modules)
"""


def test_step_runner_runs_a_numpy_model_without_torch() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout
    assert "sampled: [6, 7, 8]" in out, out
    assert out.strip().endswith("torch imported: False"), out
