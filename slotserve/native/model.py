"""A GGUF decoder run by the native kernels alone, without torch: `NativeModel`.

The torch model with `--quantization auto` on the CPU already runs a step of decodes as one
native call over a table of its layers (`models/native_layers.py`, csrc/q8layers.h). That
call takes any rows: each row is one query token with its own context length and block-table
row, and within a layer every row's K/V is written before any row attends. So a prefill
chunk is rows too, each attending as the decode of its position would; this model runs every
step that way. Around it: the embedding lookup, RoPE rows, the final norm and the output
projection, each a native call of the same libraries (qmatmul, fused ops, paged decode).

The weights are the torch path's, byte for byte: the same GGUF blocks, grouped into the same
per-product segments and repacked by the same kernel; the norms hold what the torch model's
parameters hold (Gemma's 1 + w in float32). A decode row's hidden state is therefore the
torch path's bit for bit, except where the RoPE tables differ in a last bit (numpy's cos/sin,
`native/rope.py`); a prefill row's attention sums in another order than the torch prefill
path's. Greedy continuations follow the torch model's except at near ties (tested).

Runs: Gemma 3 and the Llama family (Llama, Mistral, Qwen3) from GGUF files whose every
projection and embedding has a kernel type, without biases, on a CPU where the libraries
build. Anything else raises `NativeUnsupported` (the engine then builds the torch model).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from slotserve.checkpoint import find_gguf, resolve_checkpoint
from slotserve.checkpoint.gguf_file import GGUFTensor, drop_pages
from slotserve.config import KV_STORAGE_CODES, kv_row_elems
from slotserve.model_config import ModelConfig
from slotserve.models import fused_lib, paged_decode_lib, qmatmul_lib
from slotserve.models.decode_layers_abi import (
    KIND_GEMMA3,
    KIND_LLAMA,
    WINDOWS,
    LayerFns,
    LayerRec,
    MmRec,
    StepRec,
    layers_error,
)
from slotserve.models.fused_lib import ACT_CODES
from slotserve.models.qmatmul_lib import (
    KERNEL_TYPES,
    MAX_WEIGHTS_PER_CALL,
    PARALLEL_MIN_WORK,
    QMatmulLib,
    QmmSeg,
    kernel_error,
)
from slotserve.models.weight_arena import weight_array
from slotserve.native.rope import rope_tables

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
KINDS = {"Gemma3ForCausalLM": KIND_GEMMA3, "LlamaForCausalLM": KIND_LLAMA,
         "MistralForCausalLM": KIND_LLAMA, "Qwen3ForCausalLM": KIND_LLAMA}
# --kv-cache-dtype -> numpy storage type (bfloat16 as raw bits); codes: config.KV_STORAGE_CODES.
KV_DTYPES: dict[str, type[np.generic]] = {
    "float32": np.float32, "bfloat16": np.uint16, "float16": np.float16, "int8": np.int8}


class NativeUnsupported(Exception):
    """Why this model or machine has no native runner (the torch model serves it)."""


def _ptr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


@dataclass(slots=True)
class Product:
    """One int8 product of x with every segment of a layer's weight (QMatmulPlan's record)."""

    segs: ctypes.Array[QmmSeg]
    buffers: list[np.ndarray]  # the segments' blocks, kept alive
    k: int
    columns: int
    row_scratch: int  # q8 scratch bytes per row of x

    @property
    def rec(self) -> MmRec:
        return MmRec(ctypes.addressof(self.segs), len(self.segs), self.k, self.columns,
                     self.k * self.columns)


def _product(lib: QMatmulLib, shards: list[GGUFTensor], name: str) -> Product:
    """The shards (in output-column order) as segments of one type each, repacked where the
    kernel multiplies them faster interleaved (as quantization.QuantizedLinear holds them)."""
    k = shards[0].shape[1]
    runs: list[list[GGUFTensor]] = []
    for t in shards:
        if int(t.ggml_type) not in KERNEL_TYPES or t.shape[1] != k or len(t.shape) != 2:
            raise NativeUnsupported(f"{name}: {t.ggml_type.name} {t.shape} has no int8 kernel")
        if runs and runs[-1][0].ggml_type == t.ggml_type:
            runs[-1].append(t)
        else:
            runs.append([t])
    if len(runs) > MAX_WEIGHTS_PER_CALL:
        raise NativeUnsupported(f"{name}: more than {MAX_WEIGHTS_PER_CALL} segments")
    segs = (QmmSeg * len(runs))()
    buffers: list[np.ndarray] = []
    col = 0
    for i, run in enumerate(runs):
        qtype = int(run[0].ggml_type)
        blocks = np.ascontiguousarray(np.concatenate([t.data for t in run]) if len(run) > 1
                                      else run[0].data)
        n, row_bytes = blocks.shape
        packed = 0
        if lib.can_repack(qtype, n):
            out = weight_array(blocks.nbytes).reshape(n, row_bytes)
            rc = lib.repack(qtype, _ptr(blocks), n, k, row_bytes, _ptr(out), out.nbytes)
            if rc != 0:
                raise kernel_error(f"{name}: repack", rc)
            blocks, packed = out, 1
        elif len(run) == 1:
            blocks = blocks.copy()  # ours, not the file map's pages (dropped below)
        for t in run:  # copied: the file's pages need not stay resident in this process
            if isinstance(t.data, np.memmap):
                drop_pages(t.data)
        buffers.append(blocks)
        segs[i] = QmmSeg(_ptr(blocks), n, row_bytes, col, qtype, packed)
        col += n
    row_scratch = lib.q8_x_scratch(ctypes.addressof(segs), len(runs), k, 1)
    if row_scratch < 0:
        raise NativeUnsupported(f"{name}: a segment has no int8 kernel")
    return Product(segs, buffers, k, col, int(row_scratch))


def _layer_norms(kind: int) -> list[str]:
    """A layer's norms in the order LayerRec takes them (Gemma 3 has four)."""
    names = ["input_layernorm", "post_attention_layernorm"]
    if kind == KIND_GEMMA3:
        names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    return names


def _names(cfg: ModelConfig, kind: int) -> list[str]:
    per = _layer_norms(kind)
    attn = ["q_proj", "k_proj", "v_proj", "o_proj"] + (["q_norm", "k_norm"] if cfg.qk_norm
                                                      else [])
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [f"{p}{n}.weight" for n in per]
        names += [f"{p}self_attn.{n}.weight" for n in attn]
        names += [f"{p}mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    return names


class NativeModel:
    """The model, its KV cache (`allocate_kv_cache`, once the budget is known) and the
    buffers of a step; `forward` runs one step."""

    def __init__(self, path: str | Path, max_positions: int, threads: int = 1) -> None:
        gguf = find_gguf(path)
        if gguf is None:
            raise NativeUnsupported("not a GGUF file")
        ckpt = resolve_checkpoint(gguf)
        cfg = self.config = ckpt.config
        kind = KINDS.get(cfg.architecture)
        if kind is None:
            raise NativeUnsupported(f"architecture {cfg.architecture} has no native layers")
        if cfg.attention_bias or cfg.o_proj_bias or cfg.mlp_bias:
            raise NativeUnsupported("biases have no native layer")
        if cfg.hidden_act not in ACT_CODES:
            raise NativeUnsupported(f"activation {cfg.hidden_act} has no native kernel")
        if cfg.head_dim % 16:
            raise NativeUnsupported("the attention kernel needs head_dim % 16 == 0")
        lib = qmatmul_lib.load()
        fused = fused_lib.load()
        attend = paged_decode_lib.load()
        if lib is None or fused is None or attend is None:
            raise NativeUnsupported("a native library does not build here")
        self.kind, self.lib, self.fused, self.attend = kind, lib, fused, attend
        self.threads = max(1, threads)
        t: dict[str, GGUFTensor] = {}
        for name, tensor in ckpt.reader.weights(_names(cfg, kind)):
            if not isinstance(tensor, GGUFTensor):
                raise NativeUnsupported(f"{name} is not a GGUF tensor")
            t[name] = tensor
        self._load(cfg, t, max_positions)
        del t
        self.block_size = self.num_blocks = 0
        self.kv_caches: list[tuple[np.ndarray, np.ndarray]] = []
        self._work = np.empty(0, dtype=np.float32)
        self._q8 = np.empty(0, dtype=np.uint8)
        self._scores = np.empty((0, 0), dtype=np.float32)

    # ------------------------------------------------------------- loading
    def _norm(self, t: GGUFTensor) -> F32:
        w = np.array(t.data, dtype=np.float32).reshape(-1)  # a copy, off the file's map
        # Gemma's parameters hold 1 + w in float32 (gemma3.checkpoint_tensor), the rest w.
        return np.ascontiguousarray(np.float32(1.0) + w if self.kind == KIND_GEMMA3 else w)

    def _load(self, cfg: ModelConfig, t: dict[str, GGUFTensor], max_positions: int) -> None:
        lib = self.lib
        emb = t["model.embed_tokens.weight"]
        self.embed = _product(lib, [emb], "embed_tokens")
        self.head = (self.embed if cfg.tie_word_embeddings
                     else _product(lib, [t["lm_head.weight"]], "lm_head"))
        self.final_norm = self._norm(t["model.norm.weight"])
        self.norms: list[list[F32]] = []
        self.products: list[list[Product]] = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            norms = [self._norm(t[f"{p}{n}.weight"]) for n in _layer_norms(self.kind)]
            if cfg.qk_norm:
                norms += [self._norm(t[f"{p}self_attn.{n}.weight"]) for n in ("q_norm", "k_norm")]
            self.norms.append(norms)
            a, m = f"{p}self_attn.", f"{p}mlp."
            self.products.append([
                _product(lib, [t[f"{a}{n}_proj.weight"] for n in "qkv"], f"{a}qkv"),
                _product(lib, [t[f"{a}o_proj.weight"]], f"{a}o_proj"),
                _product(lib, [t[f"{m}gate_proj.weight"], t[f"{m}up_proj.weight"]],
                         f"{m}gate_up"),
                _product(lib, [t[f"{m}down_proj.weight"]], f"{m}down_proj")])
        self.rope = rope_tables(cfg.rope, cfg.head_dim, cfg.max_position_embeddings,
                                max_positions)
        self.local_layers = [cfg.layer_rope(i) is not cfg.rope
                             for i in range(cfg.num_hidden_layers)]
        self.rope_local = (rope_tables(cfg.rope_local, cfg.head_dim,
                                       cfg.max_position_embeddings, max_positions)
                           if cfg.rope_local is not None and any(self.local_layers)
                           else self.rope)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_dtype: str) -> None:
        """The KV cache (`--kv-cache-dtype`, resolved: float32, bfloat16, float16 or int8)
        and the table of layers that points into it."""
        if kv_dtype not in KV_DTYPES:
            raise NativeUnsupported(f"KV cache dtype {kv_dtype}")
        self.num_blocks, self.block_size = num_blocks, block_size
        cfg = self.config
        d, hd = cfg.hidden_size, cfg.head_dim
        nh, kvh, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
        storage, code = KV_DTYPES[kv_dtype], KV_STORAGE_CODES[kv_dtype]
        row = kv_row_elems(hd, kv_dtype)
        shape = (self.num_blocks, self.block_size, kvh, row)
        # np.zeros maps untouched pages: a block becomes resident when first written.
        self.kv_caches = [(np.zeros(shape, dtype=storage), np.zeros(shape, dtype=storage))
                          for _ in range(cfg.num_hidden_layers)]
        self.windows: list[int] = []
        self.layers = (LayerRec * cfg.num_hidden_layers)()
        for i, (norms, prods, (kc, vc)) in enumerate(zip(self.norms, self.products,
                                                         self.kv_caches, strict=True)):
            qkv, o, gu, down = prods
            if (qkv.columns != (nh + 2 * kvh) * hd or qkv.k != d or o.k != nh * hd
                    or o.columns != d or gu.columns != 2 * inter or down.k != inter):
                raise NativeUnsupported(f"layer {i}: the projections' shapes do not chain")
            window = cfg.layer_window(i) or 0
            if window not in self.windows:
                if len(self.windows) == WINDOWS:
                    raise NativeUnsupported(f"more than {WINDOWS} window sizes")
                self.windows.append(window)
            gemma = self.kind == KIND_GEMMA3
            qn, kn = (norms[-2], norms[-1]) if cfg.qk_norm else (None, None)
            self.layers[i] = LayerRec(
                self.kind, _ptr(norms[0]), _ptr(norms[1]), _ptr(norms[2]) if gemma else None,
                _ptr(norms[3]) if gemma else None, None if qn is None else _ptr(qn),
                None if kn is None else _ptr(kn), cfg.rms_norm_eps, cfg.rms_norm_eps,
                cfg.attention_scale, qkv.rec, o.rec, gu.rec, down.rec, nh, kvh, hd, inter,
                ACT_CODES[cfg.hidden_act], _ptr(kc), _ptr(vc), self.num_blocks,
                self.block_size, row * kc.itemsize, code, int(self.local_layers[i]),
                self.windows.index(window))
        fused, attend = self.fused, self.attend
        addr = [ctypes.cast(f, ctypes.c_void_p).value for f in (  # type: ignore[arg-type]
            fused.rms_norm, fused.add_rms_norm, fused.rms_norm_add, fused.gated_act,
            fused.qkv_rope_store, attend)]
        self.fns = LayerFns(*addr)
        self.widths = (d, qkv.columns, nh * hd, d, 2 * inter, inter)
        self.row_scratch = max(p.row_scratch for ps in self.products for p in ps)

    def weight_bytes(self) -> int:
        prods: Iterable[Product] = [p for ps in self.products for p in ps] + [self.embed]
        if self.head is not self.embed:
            prods = [*prods, self.head]
        return sum(b.nbytes for p in prods for b in p.buffers) + sum(
            n.nbytes for ns in self.norms for n in ns)

    def kv_cache_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv_caches)

    # ------------------------------------------------------------- a step
    def _grow(self, m: int, longest: int) -> None:
        need = m * sum(self.widths)
        if self._work.size < need:
            self._work = np.empty(need, dtype=np.float32)
        q8 = m * max(self.row_scratch, self.head.row_scratch)
        if self._q8.size < q8:
            self._q8 = np.empty(max(q8, 64 * 1024), dtype=np.uint8)
        bs = self.block_size
        per_thread = self.config.num_attention_heads * (-(-longest // bs) * bs)
        threads = max(1, min(self.threads, m))
        rows, have = self._scores.shape
        if rows < threads or have < per_thread:
            self._scores = np.empty((max(rows, threads), max(per_thread, 2 * have)),
                                    dtype=np.float32)

    def _rope_rows(self, tables: tuple[F32, F32], positions: I64) -> F32:
        cos, sin = tables
        m = positions.shape[0]
        max_pos, half = cos.shape
        out = np.empty((2, m, 1, 2 * half), dtype=np.float32)
        rc = self.fused.rope_rows(_ptr(cos), _ptr(sin), half, max_pos, _ptr(positions), m,
                                  _ptr(out), _ptr(out[1]))
        if rc != 0:
            raise IndexError(f"a position is outside the RoPE tables of {max_pos} positions")
        return out

    def embed_rows(self, ids: I64) -> F32:
        seg = self.embed.segs[0]
        h = np.empty((ids.shape[0], self.config.hidden_size), dtype=np.float32)
        rows = self.lib.rows_packed if seg.packed else self.lib.rows
        rc = rows(seg.type, seg.w, seg.n, self.embed.k, seg.row_bytes, _ptr(ids), ids.shape[0],
                  _ptr(h), h.shape[1])
        if rc != 0:
            raise kernel_error("embedding lookup", rc)
        if self.kind == KIND_GEMMA3:  # sqrt(hidden) rounded to float32 (gemma3.embed_scale)
            h *= np.float32(self.config.hidden_size ** 0.5)
        return h

    def forward(self, input_ids: I64, positions: I64, slot_mapping: I64, block_table: I64,
                ctx_lens: I64) -> F32:
        """Hidden states [m, hidden] (before the final norm) of m rows: row i is token
        input_ids[i] at positions[i], its K/V written at slot_mapping[i], attending to the
        first ctx_lens[i] tokens of block-table row block_table[i] (the whole batch's
        arrays, int64 contiguous)."""
        # The C side reads them as contiguous int64: anything else would be read wrong.
        input_ids, positions, slot_mapping, block_table, ctx_lens = (
            np.ascontiguousarray(a, dtype=np.int64)
            for a in (input_ids, positions, slot_mapping, block_table, ctx_lens))
        m = input_ids.shape[0]
        if not (positions.shape == slot_mapping.shape == ctx_lens.shape == (m,)
                and block_table.ndim == 2 and block_table.shape[0] == m):
            raise ValueError("one position, slot, context length and block-table row per row")
        h = self.embed_rows(input_ids)
        rope = self._rope_rows(self.rope, positions)
        local = (rope if self.rope_local is self.rope
                 else self._rope_rows(self.rope_local, positions))
        self._grow(m, int(ctx_lens.max()))
        s = StepRec()
        s.m, s.hidden, s.threads, s.min_work = m, self.widths[0], self.threads, PARALLEL_MIN_WORK
        s.h = _ptr(h)
        offs = [_ptr(self._work)]
        for w in self.widths[:-1]:
            offs.append(offs[-1] + 4 * m * w)
        s.x, s.qkv, s.attn, s.o, s.gu, s.act = offs
        s.cos[0], s.sin[0] = _ptr(rope[0]), _ptr(rope[1])
        s.cos[1], s.sin[1] = _ptr(local[0]), _ptr(local[1])
        s.slot_mapping, s.block_table, s.ctx_lens = (_ptr(slot_mapping), _ptr(block_table),
                                                     _ptr(ctx_lens))
        s.max_blocks = block_table.shape[1]
        for j, w in enumerate(self.windows):
            s.windows[j] = w
        s.scores, s.score_rows, s.score_len = (_ptr(self._scores), self._scores.shape[0],
                                               self._scores.shape[1])
        s.q8, s.q8_len = _ptr(self._q8), self._q8.size
        rc = self.lib.decode_layers(ctypes.byref(self.fns), self.layers, len(self.layers),
                                    ctypes.byref(s))
        if rc != 0:
            raise layers_error("native layers", rc)
        return h

    def compute_logits(self, hidden: F32) -> F32:
        """Final norm and output projection of the rows given: logits [rows, vocab]."""
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)  # the C reads rows of d
        m, d = hidden.shape
        if d != self.config.hidden_size:
            raise ValueError(f"hidden rows of {d} values, the model's are "
                             f"{self.config.hidden_size}")
        x = np.empty((m, d), dtype=np.float32)
        self.fused.rms_norm(_ptr(hidden), d, _ptr(self.final_norm), _ptr(x), d, m, d,
                            self.config.rms_norm_eps)
        head = self.head
        logits = np.empty((m, head.columns), dtype=np.float32)
        threads = self.threads
        if threads > 1 and m * head.k * head.columns < PARALLEL_MIN_WORK:
            threads = 1
        self._grow(m, 1)
        rc = self.lib.q8_x(ctypes.addressof(head.segs), len(head.segs), head.k, _ptr(x), d, m,
                           _ptr(logits), head.columns, _ptr(self._q8), self._q8.size, threads)
        if rc != 0:
            raise kernel_error("output projection", rc)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = (np.tanh(logits / np.float32(cap)) * np.float32(cap)).astype(np.float32)
        return logits
