"""The torch worker: the model, its KV cache, LoRA and the torch sampler, over the
model-independent bookkeeping of `StepRunner` (slot table, step inputs, failure isolation,
outputs).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from slotserve.config import CacheConfig, EngineConfig, SchedulerConfig
from slotserve.core.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from slotserve.lora.layers import LoRASlots
from slotserve.lora.request import LoRAConfig
from slotserve.memory import keep_freed_memory, resident_bytes
from slotserve.model_config import ModelConfig
from slotserve.models.attention import AttentionMetadataMap, BatchLayout
from slotserve.models.kv_storage import resolve_kv_cache_dtype
from slotserve.models.layers import DecoderForCausalLM
from slotserve.models.loader import load_model, parse_dtype
from slotserve.worker.kv_cache import allocate_kv_cache
from slotserve.worker.memory_usage import MemoryUsage
from slotserve.worker.sampler import Sampler, SamplingMetadata
from slotserve.worker.sampling_arrays import SampledArrays, SamplingArrays
from slotserve.worker.step_runner import StepInputs, StepRunner

logger = logging.getLogger(__name__)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ModelRunner(StepRunner[torch.Tensor]):
    def __init__(
        self,
        model: str | Path | tuple[DecoderForCausalLM, ModelConfig],
        config: EngineConfig | SchedulerConfig,
        cache_config: CacheConfig | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        seed: int | None = None,
        native_attention: bool = True,
        quantization: str = "auto",
        lora_config: LoRAConfig | None = None,
    ) -> None:
        """Built from the engine's EngineConfig (`ModelRunner(model, config)`), or from its
        parts. `native_attention=False` keeps decode attention on the torch path even where
        the native CPU kernel would build; `quantization` is load_model's, for a runner that
        loads its model from a path."""
        if isinstance(config, EngineConfig):
            cache_config, dtype, device = config.cache_config, config.dtype, config.device
            seed, native_attention = config.seed, config.native_attention
            lora_config = config.lora_config
            config = config.scheduler_config
        assert cache_config is not None, "a SchedulerConfig comes with its CacheConfig"
        scheduler_config = config
        self.device = torch.device(device) if device not in (None, "auto") else default_device()
        self.dtype = parse_dtype(dtype)
        max_model_len = scheduler_config.max_model_len
        if isinstance(model, tuple):
            self.model, self.model_config = model
        else:
            self.model, self.model_config = load_model(model, self.dtype, self.device,
                                                       max_positions=max_model_len + 1,
                                                       quantization=quantization)
        if self.model.rope_cos.shape[0] <= max_model_len:
            self.model.init_rope(max_model_len + 1)
        if self.device.type == "cpu":
            self.model.prepare_for_cpu()
        # The attention layer picks its kernels (native decode or torch) for this dtype/device.
        self.model.init_attention(native_attention)
        cfg = self.model_config
        # The adapter slot table (slotserve/lora); None: LoRA off, the layers are not wrapped.
        lora = (LoRASlots(self.model, cfg, lora_config, self.dtype, self.device)
                if lora_config is not None else None)

        # Decided before the runner is built (EngineCore.from_engine_args), as for the
        # scheduler: both are built from the same CacheConfig.
        self.num_blocks = cache_config.num_blocks
        self.kv_cache_dtype = resolve_kv_cache_dtype(cache_config.cache_dtype, self.dtype)
        self.kv_caches = allocate_kv_cache(cfg, self.num_blocks, cache_config.block_size,
                                           self.kv_cache_dtype, self.device)

        # The slot table and the per-slot buffers.
        super().__init__(scheduler_config, cache_config, cfg.vocab_size, lora)
        self.sampler = Sampler(self.device, seed)
        # The run under way's sampling arrays and their tensors (_prepare_sampling).
        self._sampling: tuple[SamplingArrays, SamplingMetadata] | None = None
        self.memory = MemoryUsage.of(self.model, self.kv_caches)
        logger.info("memory: weights %.1f MiB (%.1f MiB of them quantized blocks), KV cache "
                    "%.1f MiB allocated for %d blocks (pages become resident as blocks are first "
                    "used), process resident %.1f MiB", self.memory.weights_bytes / 2**20,
                    self.memory.quantized_weights_bytes / 2**20,
                    self.memory.kv_cache_bytes / 2**20, self.num_blocks,
                    resident_bytes() / 2**20)
        if self.device.type == "cpu":
            # After the weights and the KV cache: each step's activations are then reused
            # from the heap instead of being page-faulted in again every step.
            keep_freed_memory()

    @property
    def native_decode(self) -> bool:
        """Whether decode attention runs in the native kernel (chosen by the model)."""
        return self.model.attn_backend is not None and self.model.attn_backend.native

    # ---------------------------------------------------------------- the step
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        # The whole step (adapter loads included) under one inference_mode.
        return super().execute_model(scheduler_output, grammar_output)

    def _forward(self, inputs: StepInputs, logits_indices: np.ndarray) -> torch.Tensor:
        input_ids, positions, meta = self._model_inputs(inputs)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        # Every row sampled (a step of decodes; logits_indices rises, so it is then 0..T-1):
        # no copy of the rows.
        rows = hidden if len(logits_indices) == hidden.shape[0] else hidden.index_select(
            0, torch.from_numpy(logits_indices).to(self.device))
        return self.model.compute_logits(rows)

    def _model_inputs(self, inputs: StepInputs
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadataMap]:
        """The step's input ids, positions and attention metadata, on the model's device."""
        dev = self.device
        layout = BatchLayout(
            block_table=inputs.block_table, slots=inputs.slots, q_lens=inputs.q_lens,
            num_computed=inputs.num_computed, num_decodes=inputs.num_decodes,
            block_size=self.block_size,
            slot_mapping=torch.from_numpy(inputs.slot_mapping).to(dev))
        meta = self.model.build_attention_metadata(layout)
        return (torch.from_numpy(inputs.input_ids).to(dev),
                torch.from_numpy(inputs.positions).to(dev), meta)

    def _prepare_sampling(self, arrays: SamplingArrays) -> None:
        # The tensors before the forward pass, as before the split: after it, the LM head's
        # pass over its weights has evicted what making them touches (and on an accelerator
        # the copies would queue behind the forward pass).
        self._sampling = (arrays, SamplingMetadata.from_arrays(arrays, self.device,
                                                               self.vocab_size))

    def _sample(self, logits: torch.Tensor, arrays: SamplingArrays) -> SampledArrays:
        prepared, self._sampling = self._sampling, None
        if prepared is None or prepared[0] is not arrays:
            meta = SamplingMetadata.from_arrays(arrays, self.device, self.vocab_size)
        else:
            meta = prepared[1]
            if arrays.grammar_bitmask is not None:
                meta.set_grammar(arrays, self.device, self.vocab_size)
        return self.sampler(logits, meta).to_arrays()
