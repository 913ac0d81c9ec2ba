"""A GGUF file's metadata checked against itself and its tensor index, before anything is
built from it.

A model file is untrusted input: a wrong `block_count` would make the loader allocate layers
for tensors that are not there (10^6 blocks: gigabytes, then a hang), a wrong
`feed_forward_length` a terabyte-sized parameter, a zero head count a ZeroDivisionError. Every
such value is a ModelLoadError naming the file and the key, raised while the index is built
(cheap: a few dict lookups), so nothing is allocated for a file that cannot load.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from gguf import GGUFReader

from slotserve.checkpoint.gguf_file import GGUFTensorInfo
from slotserve.errors import ModelLoadError

# Larger than any released model's context (10M tokens): beyond it a value is corrupt, and
# sizing anything by it (RoPE tables, max_model_len) would be absurd.
MAX_CONTEXT_LENGTH = 1 << 24
# Dimensions past this do not fit the kernels' int32 indexing, and no real model has one.
MAX_DIMENSION = 1 << 20
_BLOCK = re.compile(r"blk\.(\d+)\.")


def _key_error(source: str, key: str, value: Any, expected: str) -> ModelLoadError:
    return ModelLoadError(f"{source}: GGUF metadata key {key} is {value!r}, expected {expected}")


def check_positive(source: str, key: str, value: Any, bound: int = MAX_DIMENSION) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= bound:
        raise _key_error(source, key, value, f"an integer from 1 to {bound}")


def check_finite_positive(source: str, key: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _key_error(source, key, value, "a finite positive number")


def check_blocks(source: str, arch: str, block_count: int,
                 tensors: Mapping[str, GGUFTensorInfo]) -> None:
    """The blocks the tensors hold are exactly 0..block_count-1."""
    present = {int(m.group(1)) for name in tensors if (m := _BLOCK.match(name))}
    missing = [i for i in range(min(block_count, len(present) + 3)) if i not in present]
    extra = sorted(i for i in present if i >= block_count)
    if missing:
        more = block_count - len(present) - len(missing)
        tail = f" and {more} more" if more > 0 else ""
        names = ", ".join(f"blk.{i}.*" for i in missing)
        raise ModelLoadError(f"{source}: GGUF metadata key {arch}.block_count is {block_count} "
                             f"but the file has tensors for {len(present)} blocks; missing the "
                             f"tensors of {names}{tail}")
    if extra:
        raise ModelLoadError(f"{source}: GGUF metadata key {arch}.block_count is {block_count} "
                             f"but the file has tensors of blocks beyond it (blk.{extra[0]}.*)")


def check_rows(source: str, key: str, value: int, tensors: Mapping[str, GGUFTensorInfo],
               tensor: str, axis: int = 0) -> None:
    """`value` is the size of `tensor`'s `axis` (torch order), when the file has the tensor."""
    info = tensors.get(tensor)
    if info is None or len(info.shape) <= axis or info.shape[axis] == value:
        return
    raise ModelLoadError(f"{source}: GGUF metadata key {key} is {value} but tensor {tensor} has "
                         f"shape {info.shape} (expected {value} along dimension {axis})")


def check_config(config: Mapping[str, Any], metadata: Mapping[str, Any],
                 tensors: Mapping[str, GGUFTensorInfo], source: str) -> None:
    """The derived config's values are sane and agree with the tensor index."""
    arch = str(metadata.get("general.architecture"))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, hidden = config["head_dim"], config["hidden_size"]
    check_positive(source, f"{arch}.attention.head_count_kv", kv_heads)
    if heads % kv_heads:
        raise _key_error(source, f"{arch}.attention.head_count_kv", kv_heads,
                         f"a divisor of {arch}.attention.head_count ({heads})")
    check_positive(source, f"{arch}.attention.key_length", head_dim)
    if head_dim % 2:
        raise _key_error(source, f"{arch}.attention.key_length", head_dim,
                         "an even head size (RoPE rotates pairs)")
    check_positive(source, f"{arch}.feed_forward_length", config["intermediate_size"])
    check_positive(source, f"{arch}.context_length", config["max_position_embeddings"],
                   MAX_CONTEXT_LENGTH)
    # No bound of its own: it must equal the blocks the tensors hold.
    check_positive(source, f"{arch}.block_count", config["num_hidden_layers"], 1 << 63)
    check_finite_positive(source, f"{arch}.attention.layer_norm_rms_epsilon",
                          config["rms_norm_eps"])
    check_finite_positive(source, f"{arch}.rope.freq_base", config["rope_theta"])
    if "sliding_window" in config:
        check_positive(source, f"{arch}.attention.sliding_window", config["sliding_window"],
                       MAX_CONTEXT_LENGTH)
    check_blocks(source, arch, config["num_hidden_layers"], tensors)
    check_rows(source, f"{arch}.embedding_length", hidden, tensors, "token_embd.weight", 1)
    check_rows(source, f"{arch}.feed_forward_length", config["intermediate_size"], tensors,
               "blk.0.ffn_up.weight")
    check_rows(source, f"{arch}.attention.head_count", heads * head_dim, tensors,
               "blk.0.attn_q.weight")
    check_rows(source, f"{arch}.attention.head_count_kv", kv_heads * head_dim, tensors,
               "blk.0.attn_k.weight")


def check_vocabulary(metadata: Mapping[str, Any], reader: GGUFReader, vocab_size: int,
                     token_ids: Mapping[str, Any], source: str) -> None:
    """A file that names a tokenizer has its token list; special token ids are in range of
    both the token list and the embedding (`vocab_size` rows)."""
    if vocab_size <= 0:
        raise ModelLoadError(f"{source}: tensor token_embd.weight has no rows")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if "tokenizer.ggml.model" in metadata and (tokens is None or not len(tokens.data)):
        raise ModelLoadError(f"{source}: GGUF metadata key tokenizer.ggml.tokens is missing or "
                             "empty, but tokenizer.ggml.model names a tokenizer")
    bound = vocab_size if tokens is None else min(vocab_size, len(tokens.data))
    for key, value in token_ids.items():
        ids = value if isinstance(value, list) else [value]
        for token_id in ids:
            if token_id is None:
                continue
            if not isinstance(token_id, int) or not 0 <= token_id < bound:
                raise _key_error(source, key, token_id,
                                 f"a token id below the vocabulary size {bound}")
