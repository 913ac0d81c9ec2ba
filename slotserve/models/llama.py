"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened token batch.

One class for the whole family; `ModelConfig` switches biases, q/k norm, RoPE and (Mistral,
Qwen with `use_sliding_window`) which layers attend through a sliding window. The shared
pieces (attention, MLP, RoPE, the model skeleton) live in `models/layers.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from slotserve.model_config import ModelConfig
from slotserve.models.attention import AttentionMetadataMap
from slotserve.models.fused import TORCH_OPS, RMSNorm, TorchOps
from slotserve.models.layers import MLP, Attention, DecoderForCausalLM, KVCache


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.ops: TorchOps = TORCH_OPS  # DecoderForCausalLM.init_attention chooses

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadataMap) -> torch.Tensor:
        """h is updated in place (the residual stream is the step's own tensor)."""
        ops = self.ops
        a = self.self_attn(ops.norm(self.input_layernorm, h), cos, sin, kv_cache, attn_metadata)
        return h.add_(self.mlp(ops.add_norm(h, a, self.post_attention_layernorm)))


class LlamaForCausalLM(DecoderForCausalLM):
    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return DecoderLayer(cfg, layer)
