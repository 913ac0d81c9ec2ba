"""Gemma 3 text (`Gemma3ForCausalLM`, model_type `gemma3_text`) over a flattened token batch.

What differs from Llama, each as transformers computes it:
- RMSNorm scales by (1 + w), in float32, and casts afterwards (Llama casts, then scales);
- four norms per layer: around attention (input, post-attention) and around the MLP
  (pre- and post-feed-forward), each output normed before it joins the residual;
- per-head q/k RMSNorm before RoPE; scores scaled by query_pre_attn_scalar ** -0.5;
- sliding-window local layers and global layers in the checkpoint's pattern, each kind with
  its own RoPE base (`ModelConfig.layer_types`, `rope_local`);
- GeGLU with the tanh GELU; the embedding multiplied by sqrt(hidden_size) rounded to the
  model dtype; tied embeddings.

The norm parameters hold the scale itself, 1 + w, in float32 whatever the model dtype:
`checkpoint_tensor` adds the 1 to a checkpoint's w after rounding w to the model dtype, so the
product is bit for bit transformers' `norm(x.float()) * (1.0 + w.float())` in bfloat16 too.
(GGUF files store 1 + w; their reader delivers w, as transformers' GGUF loader does.)
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from slotserve.checkpoint.dequant import CheckpointTensor
from slotserve.model_config import ModelConfig
from slotserve.models.attention import AttentionMetadataMap
from slotserve.models.fused import TORCH_OPS, RMSNorm, TorchOps
from slotserve.models.layers import MLP, Attention, DecoderForCausalLM, KVCache


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * weight computed in float32, then cast; weight holds 1 + w (float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight).to(x.dtype)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.self_attn = Attention(cfg, layer, norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.ops: TorchOps = TORCH_OPS  # DecoderForCausalLM.init_attention chooses

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadataMap) -> torch.Tensor:
        """h is updated in place (the residual stream is the step's own tensor)."""
        ops = self.ops
        a = self.self_attn(ops.norm(self.input_layernorm, h), cos, sin, kv_cache, attn_metadata)
        x = ops.norm_add(h, a, self.post_attention_layernorm, self.pre_feedforward_layernorm)
        assert x is not None
        ops.norm_add(h, self.mlp(x), self.post_feedforward_layernorm, None)
        return h


@functools.cache
def embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) rounded to `dtype` first, as transformers multiplies (bf16: 640 ->
    25.25, not 25.298)."""
    return float(torch.tensor(hidden_size ** 0.5).to(dtype))


class Gemma3ForCausalLM(DecoderForCausalLM):
    norm_cls = GemmaRMSNorm

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return Gemma3DecoderLayer(cfg, layer)

    def to_dtype(self, dtype: torch.dtype) -> None:
        super().to_dtype(dtype)
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.weight.data = module.weight.data.float()

    def checkpoint_tensor(self, name: str, tensor: CheckpointTensor) -> CheckpointTensor:
        if name.endswith("norm.weight") and isinstance(tensor, torch.Tensor):  # every norm: input, post/pre/q/k, the final one
            return 1.0 + tensor.to(self.dtype).float()
        return tensor

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = super().embed(input_ids)  # the lookup's own new tensor: scaled in place
        return h.mul_(embed_scale(self.config.hidden_size, h.dtype))
