"""A GGUF file's cached tokenizer without transformers: the Rust tokenizer saved in the cache
entry and the notes beside it (special tokens, chat template).

transformers' `PreTrainedTokenizerFast` over the same file holds the same Rust tokenizer (its
`backend_tokenizer` serializes to the saved file, byte for byte; tests check it), so encoding
and decoding are the Rust tokenizer's either way. What the wrapper adds is the import: about
35 MB resident in the server's front (transformers and what it pulls in: huggingface_hub,
httpx, PIL, ...) and 11 MB of Python objects over the vocabulary, for a process whose job is
to tokenize. This class gives the front what it uses of the wrapper, with the wrapper's
results; `to_hf()` builds the wrapper for code that needs the real one.
"""

from __future__ import annotations

import functools
import gc
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer, models

from slotserve.checkpoint import cache

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


def load_backend(tokenizer_file: Path) -> Tokenizer:
    """The Rust tokenizer of a tokenizer.json, its BPE vocabulary built from parsed lists.

    `Tokenizer.from_file` parses the model into a JSON tree first and moves the vocabulary's
    strings out of it, so they stay scattered among the tree's freed nodes: for Gemma's 262k
    tokens the tokenizer keeps 97 MB resident for 68 MB of live data, even after
    `malloc_trim`. Built from lists (`bpe_from_lists`), the same tokenizer (its serialization
    is equal, byte for byte) keeps 76 MB, for ~0.2 s more."""
    doc = cache.read_json(tokenizer_file)
    tok = bpe_from_lists(doc)
    del doc
    gc.collect()  # the parsed lists, before the caller trims the heap
    return tok if tok is not None else Tokenizer.from_file(str(tokenizer_file))


def bpe_from_lists(doc: dict[str, Any]) -> Tokenizer | None:
    """A parsed tokenizer.json's tokenizer, its BPE model built from the parsed vocabulary and
    merges (consumed); None for another model type or where the result would differ. The
    rest loads through a copy of the document whose model holds only the added tokens:
    their ids come from the model's vocabulary as it loads."""
    model = doc.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return None
    added = {a["content"]: a["id"] for a in doc.get("added_tokens", ())}
    try:
        tok = Tokenizer.from_str(json.dumps({**doc, "model": {**model, "vocab": added,
                                                                "merges": []}}))
        options = {k: v for k, v in model.items()
                   if k not in ("type", "vocab", "merges") and v is not None}
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1))
                  for m in model.pop("merges")]
        tok.model = models.BPE(model.pop("vocab"), merges, **options)
    except Exception:  # noqa: BLE001 - from_file gives the file's own error, if any
        return None
    if any(tok.token_to_id(content) != i for content, i in added.items()):
        return None
    return tok


class SavedTokenizer:
    """The tokenizer of a GGUF cache entry (`tokenizer.json` and the notes' special tokens
    and chat template), with the `PreTrainedTokenizerFast` methods the engine uses."""

    def __init__(self, tokenizer_file: Path, special_tokens: Mapping[str, str],
                 chat_template: str | None) -> None:
        self.tokenizer_file = tokenizer_file
        self.backend_tokenizer = load_backend(tokenizer_file)
        self.special_tokens_map: dict[str, str] = dict(special_tokens)
        self.chat_template = chat_template
        self.name_or_path = str(tokenizer_file.parent)

    # -- special tokens, as transformers names them
    def _token(self, name: str) -> str | None:
        return self.special_tokens_map.get(name)

    def _token_id(self, name: str) -> int | None:
        token = self._token(name)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self._token("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._token("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._token_id("unk_token")

    # -- the vocabulary
    @property
    def vocab_size(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=False))

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend_tokenizer.get_vocab(with_added_tokens=True))

    def get_added_vocab(self) -> dict[str, int]:
        return {token.content: i for i, token in
                sorted(self.backend_tokenizer.get_added_tokens_decoder().items())}

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    # -- text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return str(self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def batch_decode(self, sequences: Sequence[Sequence[int]],
                     skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    # -- chat
    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], *,
                            tokenize: bool = True, **kwargs: Any) -> str | list[int]:
        """transformers' own rendering, on a tokenizer without a vocabulary (what
        `chat_render` runs in its child): the same text. Unbounded in time and memory, as
        transformers' is; the server renders through `chat_render.ChatRenderer`."""
        from slotserve.checkpoint.chat_render import _renderer

        stub, variables = _renderer(("template", kwargs.pop("chat_template", None)
                                     or self.chat_template, self.special_tokens_map))
        text = str(stub.apply_chat_template(list(conversation), tokenize=False,
                                            **{**variables, **kwargs}))
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # -- the real thing, for code that needs it
    @functools.cache  # noqa: B019 - one per tokenizer, which lives as long as its engine
    def to_hf(self) -> PreTrainedTokenizerFast:
        """transformers' fast tokenizer over the same file (built once; imports transformers
        and holds a second copy of the vocabulary)."""
        from transformers import PreTrainedTokenizerFast

        # transformers leaves this constructor untyped (*args, **kwargs).
        tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
            tokenizer_file=str(self.tokenizer_file), **self.special_tokens_map)
        tok.chat_template = self.chat_template
        return tok
