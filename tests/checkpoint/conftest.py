"""The bundled Shakespeare model written as GGUF files (with its tokenizer and chat template in
the metadata), for engine-level tests of GGUF loading on a model with real weights; and the
real Gemma 3 file loaded once for the tests that build engines over it."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from filelock import FileLock

from slotserve.checkpoint import load_tokenizer
from slotserve.engine.args import DEFAULT_MODEL
from slotserve.models.loader import load_model
from tests.checkpoint.gemma_file import gemma_path
from tests.checkpoint.gguf_convert import Q, to_gguf

BundledGGUF = Callable[..., Path]


@pytest.fixture(scope="session")
def bundled_gguf(tmp_path_factory: pytest.TempPathFactory) -> BundledGGUF:
    """`make(qtype=F32, name=..., edit=None) -> path` of the bundled model as a GGUF file."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("bundled_gguf")
    made: dict[tuple[Q, str], Path] = {}

    def make(qtype: Q = Q.F32, name: str = "model.gguf", edit: object = None) -> Path:
        key = (qtype, name)
        if key not in made or edit is not None:
            hf = LlamaForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
            folder = root / f"{qtype.name}-{len(made)}"
            folder.mkdir()
            to_gguf(hf, folder / name, qtype, tokenizer_dir=Path(DEFAULT_MODEL),
                    edit=edit)  # type: ignore[arg-type]
            made[key] = folder / name
        return made[key]

    return make


@pytest.fixture(scope="package")
def gemma() -> Path:
    return gemma_path()


@pytest.fixture(scope="package")
def loaded(gemma: Path) -> tuple[Any, Any, Any]:
    """(model, config, tokenizer) of the Gemma file in float32 with `exact` quantization: the
    KV-dtype and proof tests build their engines over it (loading it is most of their setup
    on a loaded machine, so it is loaded once for the package)."""
    model, cfg = load_model(gemma, dtype="float32", device="cpu", max_positions=1025,
                            quantization="exact")
    return model, cfg, load_tokenizer(gemma)


@pytest.fixture(scope="package")
def float32_run(gemma: Path, request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The proof prompts in one batch on a fresh engine over `loaded` with a float32 KV cache
    (test_gemma_proof.batched_run): `.outputs` (RequestOutputs, top-5 logprobs) and
    `.prefix_cache_hits` (the engine's count after the run). test_gemma_proof.py holds it to
    transformers and test_gemma_kv_dtype.py holds the 16- and 8-bit caches to it: the same
    run, made once (a minute on the loaded machine); nothing else runs on its engine. Under
    pytest-xdist the first worker to ask makes it and the others read it from the session's
    shared temporary folder, so the run is not made once per worker."""
    from tests.checkpoint.test_gemma_proof import batched_run

    def make() -> SimpleNamespace:
        llm, outputs = batched_run(gemma, request.getfixturevalue("loaded"), "float32")
        return SimpleNamespace(outputs=outputs,
                               prefix_cache_hits=llm.get_stats().prefix_cache_hits)

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make()
    shared = tmp_path_factory.getbasetemp().parent / "gemma_float32_run.pickle"
    with FileLock(f"{shared}.lock"):
        if shared.is_file():
            run: SimpleNamespace = pickle.loads(shared.read_bytes())
            return run
        run = make()
        shared.write_bytes(pickle.dumps(run))
        return run


@pytest.fixture(scope="package")
def gguf_parsed_once() -> Iterator[Callable[[], AbstractContextManager[None]]]:
    """A block within which transformers parses each GGUF file's metadata once.

    transformers reads the file's metadata for the config, again for the weights, and twice
    for a tokenizer (its config, then the vocabulary): Gemma's 262,144-token arrays go field by
    field through Python, 16 s of CPU a parse. Within the block `gguf.GGUFReader` (read-only,
    memory-mapped) is made once per file for the package and shared: what transformers reads
    is still the file.
    """
    from gguf import GGUFReader

    readers: dict[str, GGUFReader] = {}

    def reader(path: str | Path, *args: Any, **kwargs: Any) -> GGUFReader:
        key = str(Path(path).resolve())
        if key not in readers:
            readers[key] = GGUFReader(path, *args, **kwargs)
        return readers[key]

    @contextmanager
    def parsed_once() -> Iterator[None]:
        import gguf

        with pytest.MonkeyPatch.context() as mp:
            # transformers imports the name from gguf inside the function that reads
            mp.setattr(gguf, "GGUFReader", reader)
            yield

    yield parsed_once
    readers.clear()
