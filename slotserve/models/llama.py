"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened token batch.

Parameter names follow the Hugging Face checkpoints, except that q/k/v are fused into
`qkv_proj` and gate/up into `gate_up_proj` (fewer, larger matmuls). The class owns that layout:
`packed_modules_mapping` and the fused layers' `weight_loader` (models/weight_utils.py) put each
checkpoint tensor into its slice, whichever reader (safetensors, GGUF) delivered it.
The numerics follow transformers' implementation op for op (RMSNorm in float32, RoPE tables in
float32 cast to the model dtype) so that greedy outputs match it token for token.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from slotserve.models.attention import AttentionMetadata, paged_attention, write_kv
from slotserve.models.config import ModelConfig, RopeConfig
from slotserve.models.weight_utils import ShardedLinear, load_packed_weights

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def _store_transposed(weight: nn.Parameter) -> None:
    if weight.dim() == 2 and not weight.t().is_contiguous():  # idempotent
        weight.data = weight.data.t().contiguous().t()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:
            # The fused kernel is bit-identical to the formula below in float32, and one op.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int, max_positions: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64)
                                     .float() / head_dim))
    if rope.freq_factors is not None:
        return inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # them interpolated smoothly.
    orig = rope.original_max_position_embeddings or max_positions
    low_freq_wavelen = orig / rope.low_freq_factor
    high_freq_wavelen = orig / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (orig / wavelen - rope.low_freq_factor) / (rope.high_freq_factor
                                                         - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos [T, 1, D] = (c, c); sin [T, 1, D] = (-s, s).

    The rotate-half convention of HF checkpoints, x * cos + rotate_half(x) * sin, with the sign
    of rotate_half folded into the sin table: rolling x by D/2 swaps its halves, so this is
    four ops and bit-identical to the unfused formula.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = ShardedLinear(cfg.hidden_size, {"q": self.q_size, "k": self.kv_size,
                                                         "v": self.kv_size},
                                      bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        value = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = apply_rope(self.q_norm(qkv[:, :self.q_size].view(t, self.num_heads, -1)),
                           cos, sin)
            k = apply_rope(self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size]
                                       .view(t, self.num_kv_heads, -1)), cos, sin)
        else:
            # q and k rotated together: one set of elementwise kernels instead of two.
            qk = apply_rope(qkv[:, :self.q_size + self.kv_size]
                            .view(t, self.num_heads + self.num_kv_heads, -1), cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, value, meta.slot_mapping)
        out = paged_attention(q, k, value, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = ShardedLinear(cfg.hidden_size, {0: cfg.intermediate_size,
                                                            1: cfg.intermediate_size},
                                          bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up[:, :self.intermediate_size], gate_up[:, self.intermediate_size:]
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# Older exports saved the RoPE buffer; it holds nothing we need.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class LlamaForCausalLM(nn.Module):
    """One class for the whole family; `ModelConfig` switches biases, q/k norm and RoPE."""

    # checkpoint module -> (our fused module, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Filled by init_rope() once the module lives on its real device.
        self.rope_cos = torch.empty(0)
        self.rope_sin = torch.empty(0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """Fill every parameter from Hugging Face-named checkpoint tensors."""
        tied = self.config.tie_word_embeddings

        def skip(name: str) -> bool:
            # Some tied checkpoints store lm_head too; the embedding is the one we use.
            return bool(_IGNORED.match(name)) or (tied and name == "lm_head.weight")

        load_packed_weights(self, weights, source=source, skip=skip)

    def init_rope(self, max_positions: int) -> None:
        """Precompute cos/sin for every position: a step only indexes them."""
        cfg = self.config
        device = self.model.embed_tokens.weight.device
        dtype = self.model.embed_tokens.weight.dtype
        inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        # Computed in float32 and then cast, as transformers does, so bf16 matches too.
        cos, sin = freqs.cos(), freqs.sin()
        self.rope_cos = torch.cat((cos, cos), dim=-1).to(device=device, dtype=dtype)
        self.rope_sin = torch.cat((-sin, sin), dim=-1).to(device=device, dtype=dtype)

    def prepare_for_cpu(self) -> None:
        """Store every matmul weight transposed: [in, out] contiguous, seen as [out, in].

        Parameters keep their shapes and values; only the memory order changes. For the
        skinny products of decoding (a few dozen rows), MKL's sgemm is 15-30% faster with the
        weight in this order (results are bit-identical), and no extra copy is kept. A tied
        embedding is transposed too: the LM head gains more than the strided embedding
        lookup loses (its rows are only read for the step's tokens).
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                _store_transposed(module.weight)
        if self.config.tie_word_embeddings:
            _store_transposed(self.model.embed_tokens.weight)

    @property
    def output_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] (before the final norm) of the flattened batch."""
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        h = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, kv_cache, meta)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head for the selected rows only; logits in float32."""
        return F.linear(self.model.norm(hidden), self.output_weight).float()
