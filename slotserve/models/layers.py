"""Building blocks shared by the decoder models: RMSNorm, RoPE, attention, the gated MLP, and
`DecoderForCausalLM`, the skeleton every architecture fills with its own decoder layer.

Parameter names follow the Hugging Face checkpoints, except that q/k/v are fused into
`qkv_proj` and gate/up into `gate_up_proj` (fewer, larger matmuls). The model owns that layout:
`DecoderForCausalLM.packed_modules_mapping` and the fused layers' `weight_loader`
(models/weight_utils.py) put each checkpoint tensor into its slice, whichever reader
(safetensors, GGUF) delivered it.
The numerics follow transformers' implementations op for op (RMSNorm in float32, RoPE tables in
float32 cast to the model dtype) so that greedy outputs match them token for token.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from slotserve.checkpoint.dequant import CheckpointTensor
from slotserve.model_config import ModelConfig, RopeConfig
from slotserve.models.attention import (
    AttentionBackend,
    AttentionMetadataMap,
    BatchLayout,
    paged_attention,
)
from slotserve.models.fused import ACTIVATIONS, TORCH_OPS, RMSNorm, TorchOps, choose_ops
from slotserve.models.native_layers import DecodeLayers, enabled as native_layers_enabled
from slotserve.models.quantization import QuantizedEmbedding, QuantizedLinear
from slotserve.models.weight_utils import (
    NamedTensors,
    PackedMapping,
    ShardedLinear,
    load_packed_weights,
)

KVCache = tuple[torch.Tensor, torch.Tensor]
KVCaches = list[KVCache]
# Older exports saved the RoPE buffer; it holds nothing we need.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def _store_transposed(weight: torch.Tensor) -> None:
    if weight.dim() == 2 and not weight.t().is_contiguous():  # idempotent
        weight.data = weight.data.t().contiguous().t()


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


def rope_tables(rope: RopeConfig, head_dim: int, max_position_embeddings: int,
                positions: int, dtype: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, head_dim / 2]: the ops' `rope_rows` (models/fused.py) widens a
    step's rows to the layout `apply_rope` takes (half the memory: 16 MiB for Gemma 3's two
    kinds at 8192 positions)."""
    inv_freq = rope_inv_freq(rope, head_dim, max_position_embeddings)
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    # Computed in float32 and then cast, as transformers does, so bf16 matches too.
    return (freqs.cos().to(device=device, dtype=dtype),
            freqs.sin().to(device=device, dtype=dtype))


class Attention(nn.Module):
    """Fused qkv projection, optional per-head q/k norm, RoPE, paged attention, o_proj."""

    def __init__(self, cfg: ModelConfig, layer: int, norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = cfg.attention_scale
        self.window = cfg.layer_window(layer)
        self.qkv_proj = ShardedLinear(cfg.hidden_size, {"q": self.q_size, "k": self.kv_size,
                                                         "v": self.kv_size},
                                      bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.qk_norm = cfg.qk_norm
        self.ops: TorchOps = TORCH_OPS  # DecoderForCausalLM.init_attention chooses
        if cfg.qk_norm:
            self.q_norm = norm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = norm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadataMap) -> torch.Tensor:
        meta = attn_metadata[self.window]
        q, k, v = self.ops.qkv_rope_store(self, self.qkv_proj(x), cos, sin, kv_cache,
                                          meta.slot_mapping)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        result: torch.Tensor = self.o_proj(out)
        return result


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU for Llama, GeGLU (tanh) for Gemma."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {cfg.hidden_act!r}")
        self.act = cfg.hidden_act
        self.ops: TorchOps = TORCH_OPS  # DecoderForCausalLM.init_attention chooses
        self.gate_up_proj = ShardedLinear(cfg.hidden_size, {0: cfg.intermediate_size,
                                                            1: cfg.intermediate_size},
                                          bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.down_proj(self.ops.gated_act(self.gate_up_proj(x), self.act))
        return result


class DecoderModel(nn.Module):
    """The HF `model.` prefix: embedding, decoder layers, final norm."""

    def __init__(self, embed_tokens: nn.Embedding, layers: list[nn.Module], norm: RMSNorm
                 ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class DecoderForCausalLM(nn.Module):
    """A decoder-only LM over a flattened token batch; subclasses supply the decoder layer.

    A layer is called as layer(h, cos, sin, kv_cache, attn_metadata) -> h, with the RoPE
    tables of its own kind (full or sliding-window layers may differ, as in Gemma 3).
    """

    norm_cls: type[RMSNorm] = RMSNorm
    # checkpoint module -> (our fused module, shard id)
    packed_modules_mapping: PackedMapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # The weights come from the checkpoint: `_weight` skips the random init, whose first
        # normal_ on the meta device costs 0.7 s of lazy imports at every start.
        self.model = DecoderModel(
            nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)),
            [self.make_layer(cfg, i) for i in range(cfg.num_hidden_layers)],
            self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps))
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Per layer: whether it takes the local RoPE tables (cfg.rope_local) or the global ones.
        self._local_rope = [cfg.layer_rope(i) is not cfg.rope
                            for i in range(cfg.num_hidden_layers)]
        # Filled by init_rope() / init_attention() once the module lives on its real device.
        self.rope_cos = self.rope_sin = torch.empty(0)
        self.rope_local_cos = self.rope_local_sin = torch.empty(0)
        self.attn_backend: AttentionBackend | None = None
        self.ops: TorchOps = TORCH_OPS
        # The native path of a decode step's layers (init_attention sets it where the native
        # glue is chosen; it declines any step or layer it cannot run as the modules do).
        self.decode_layers: DecodeLayers | None = None

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        raise NotImplementedError

    # ------------------------------------------------------------- setup after loading
    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def to_dtype(self, dtype: torch.dtype) -> None:
        """Cast the parameters to the compute dtype (a model may keep some in float32)."""
        self.to(dtype=dtype)

    def checkpoint_tensor(self, name: str, tensor: CheckpointTensor) -> CheckpointTensor:
        """HF checkpoint tensor `name` as this model's parameter holds it (here: as is)."""
        return tensor

    def load_weights(self, weights: NamedTensors, source: str) -> None:
        """Fill every parameter from Hugging Face-named checkpoint tensors."""
        tied = self.config.tie_word_embeddings

        def skip(name: str) -> bool:
            # Some tied checkpoints store lm_head too; the embedding is the one we use.
            return bool(_IGNORED.match(name)) or (tied and name == "lm_head.weight")

        load_packed_weights(self, weights, source=source, skip=skip,
                            transform=self.checkpoint_tensor)

    def init_rope(self, max_positions: int) -> None:
        """Precompute cos/sin for every position: a step only indexes them."""
        cfg = self.config
        dev = self.model.embed_tokens.weight.device
        self.rope_cos, self.rope_sin = rope_tables(
            cfg.rope, cfg.head_dim, cfg.max_position_embeddings, max_positions, self.dtype, dev)
        if cfg.rope_local is not None and any(self._local_rope):
            self.rope_local_cos, self.rope_local_sin = rope_tables(
                cfg.rope_local, cfg.head_dim, cfg.max_position_embeddings, max_positions,
                self.dtype, dev)

    def init_attention(self, native: bool = True) -> None:
        """Choose the attention kernels for the model's dtype and device; `native=False` keeps
        the torch path even where the native decode kernel would build."""
        cfg = self.config
        device = self.model.embed_tokens.weight.device
        self.attn_backend = AttentionBackend(
            num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            windows={cfg.layer_window(i) for i in range(cfg.num_hidden_layers)},
            dtype=self.dtype, device=device, native=native)
        # The layers' elementwise glue: fused C kernels where they build, else torch.
        ops = choose_ops(self.dtype, device, native)
        for module in self.modules():
            if isinstance(getattr(module, "ops", None), TorchOps):
                setattr(module, "ops", ops)  # noqa: B010 - modules of several classes
        self.decode_layers = (DecodeLayers() if ops.native and self.attn_backend.native
                              and native_layers_enabled() else None)

    def build_attention_metadata(self, layout: BatchLayout) -> AttentionMetadataMap:
        if self.attn_backend is None:
            raise RuntimeError("init_attention() must be called before the first step")
        return self.attn_backend.build(layout)

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

    # ------------------------------------------------------------- the step
    @property
    def output_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.model.embed_tokens(input_ids)
        return h

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                attn_metadata: AttentionMetadataMap) -> torch.Tensor:
        """Hidden states [T, hidden] (before the final norm) of the flattened batch."""
        cos, sin = self.ops.rope_rows(self.rope_cos, self.rope_sin, positions)
        local_cos, local_sin = cos, sin
        if self.rope_local_cos.numel():
            local_cos, local_sin = self.ops.rope_rows(self.rope_local_cos,
                                                      self.rope_local_sin, positions)
        h = self.embed(input_ids)
        if self.decode_layers is not None and self.decode_layers.run(
                self, h, (cos, sin, local_cos, local_sin), kv_caches, attn_metadata):
            return h  # every layer in one native call (a step of decodes only)
        for layer, kv_cache, local in zip(self.model.layers, kv_caches, self._local_rope,
                                          strict=True):
            if local:
                h = layer(h, local_cos, local_sin, kv_cache, attn_metadata)
            else:
                h = layer(h, cos, sin, kv_cache, attn_metadata)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head for the selected rows only; logits in float32."""
        # Through the layers' ops (native when they are): right after the output projection
        # has streamed its weights, torch's rms_norm costs 0.15 ms for one row, mostly its own
        # code and tables coming back into the caches.
        h = self.ops.norm(self.model.norm, hidden)
        head = self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        if isinstance(head, QuantizedEmbedding | QuantizedLinear):
            # A fresh tensor per step costs no page faults: on the CPU the runner keeps freed
            # blocks in the heap (slotserve.memory.keep_freed_memory).
            logits = head.project(h)
        else:
            logits = F.linear(h, self.output_weight)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
