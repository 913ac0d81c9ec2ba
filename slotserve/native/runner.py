"""NativeRunner: the worker of an engine core without torch. The slot table, the step's rows
and sampling metadata are `StepRunner`'s (the very code the torch runner runs); the model is
a `NativeModel`, the sampler `NumpySampler`."""

from __future__ import annotations

import numpy as np

from slotserve.config import EngineConfig
from slotserve.memory import keep_freed_memory
from slotserve.native.model import NativeModel
from slotserve.worker.sampler_np import NumpySampler
from slotserve.worker.sampling_arrays import SampledArrays, SamplingArrays
from slotserve.worker.step_runner import StepInputs, StepRunner


class NativeRunner(StepRunner[np.ndarray]):
    def __init__(self, model: NativeModel, config: EngineConfig) -> None:
        super().__init__(config.scheduler_config, config.cache_config, model.config.vocab_size)
        self.model = model
        self.sampler = NumpySampler(config.seed)
        # After the weights and the KV cache: each step's arrays are then reused from the
        # heap instead of being page-faulted in again every step (as the torch runner).
        keep_freed_memory()

    def _forward(self, inputs: StepInputs, logits_indices: np.ndarray) -> np.ndarray:
        # Every token is a row attending as the decode of its position would: its request's
        # block-table row (only the columns the step's longest context reaches) and its
        # context through itself.
        rows = np.repeat(inputs.slots, inputs.q_lens)
        ctx = inputs.positions + 1
        width = -(-int(ctx.max()) // self.block_size)
        hidden = self.model.forward(inputs.input_ids, inputs.positions, inputs.slot_mapping,
                                    inputs.block_table[rows, :width], ctx)
        if len(logits_indices) != hidden.shape[0]:
            hidden = hidden[logits_indices]
        return self.model.compute_logits(hidden)

    def _sample(self, logits: np.ndarray, arrays: SamplingArrays) -> SampledArrays:
        return self.sampler(logits, arrays)
