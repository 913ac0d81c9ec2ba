"""The native CPU decode kernel against the torch gather + SDPA path.

Kernel-level: random paged caches, shuffled block tables, GQA, contexts that end mid-block or
hold one token, strided query rows and the thread pool must give the torch path's output.
End to end: greedy decoding through the real Scheduler and ModelRunner gives the same tokens
with SLOTSERVE_NATIVE_ATTENTION=0 and by default. The build's own contract (concurrent builds
share one library, a failed build warns once and falls back) is checked with a private cache.
Only the parts that need a working kernel are skipped when no C compiler is present.
"""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path

import pytest
import torch

from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.core.request import Request
from slotserve.core.scheduler import Scheduler
from slotserve.models import native_attention
from slotserve.models.attention import AttentionMetadata, paged_attention
from slotserve.models.native_attention import (
    ENV_SWITCH,
    compile_library,
    find_compiler,
    native_decode_supported,
)
from slotserve.sampling_params import SamplingParams
from slotserve.worker.model_runner import ModelRunner
from tests.helpers import VOCAB, TinyModel

CPU = torch.device("cpu")


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch) -> None:
    """A working kernel, or a skip when this machine has no C compiler."""
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    if find_compiler() is None:
        pytest.skip("no C compiler: the native decode kernel cannot be built")
    # With a compiler present a failed build is a bug, not a reason to skip.
    assert native_decode_supported(torch.float32, CPU, 16), "native decode kernel did not build"


def _decode_metadata(tables: list[list[int]], ctx_lens: list[int], block_size: int,
                     native: bool) -> AttentionMetadata:
    """What ModelRunner builds for a pure decode step, in the native or the torch form."""
    nd, max_blocks = len(tables), max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int64)
    meta = AttentionMetadata(slot_mapping=torch.zeros(nd, dtype=torch.int64), num_decodes=nd,
                             decode_block_ids=padded.reshape(-1), decode_max_blocks=max_blocks)
    lens = torch.tensor(ctx_lens, dtype=torch.int64)
    if native:
        meta.decode_ctx_lens = lens
    else:
        allowed = torch.arange(max_blocks * block_size)[None, :] < lens[:, None]
        mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
        meta.decode_mask = mask.view(nd, 1, 1, -1)
    return meta


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("block_size,head_dim,heads,kv_heads", [
    (16, 64, 9, 3),  # SmolLM-shaped GQA
    (4, 16, 9, 3),
    (4, 64, 4, 4),  # MHA
    (16, 16, 8, 1),  # MQA
])
def test_kernel_matches_torch_path(native: None, block_size: int, head_dim: int, heads: int,
                                   kv_heads: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(block_size * 1000 + head_dim + heads + kv_heads)
    # Whole blocks, a block and one token, mid-block ends, a single token.
    ctx_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 37, 2, 70, 5 * block_size]
    nd = len(ctx_lens)
    num_blocks = 1 + sum(math.ceil(n / block_size) for n in ctx_lens) + 7  # spare blocks
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    # Every sequence owns distinct blocks at random places (never the null block 0).
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    for n in ctx_lens:
        nb = math.ceil(n / block_size)
        tables.append(ids[:nb])
        ids = ids[nb:]
    # Query rows strided, as when they are a view into the fused qkv projection.
    qkv = torch.randn(nd, (heads + 2 * kv_heads) * head_dim, generator=gen)
    query = qkv[:, :heads * head_dim].view(nd, heads, head_dim)
    step_kv = torch.zeros(nd, kv_heads, head_dim)  # already written; decodes do not read it
    scale = head_dim ** -0.5

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = paged_attention(query, step_kv, step_kv, k_cache, v_cache,
                               _decode_metadata(tables, ctx_lens, block_size, False), scale)
        got = paged_attention(query, step_kv, step_kv, k_cache, v_cache,
                              _decode_metadata(tables, ctx_lens, block_size, True), scale)
    finally:
        torch.set_num_threads(saved)
    assert got.shape == want.shape == (nd, heads * head_dim)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _greedy_tokens(model: TinyModel, block_size: int) -> tuple[dict[str, list[int]], bool]:
    """Greedy outputs of a few requests through the real Scheduler and ModelRunner; a small
    token budget mixes chunked prefills with decodes in one step."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (1, 5, 17, 30)]
    sched_cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=80)
    cache_cfg = CacheConfig(block_size=block_size, num_blocks=96)
    scheduler = Scheduler(sched_cfg, cache_cfg)
    runner = ModelRunner(model.path, sched_cfg, cache_cfg, device="cpu")
    for i, p in enumerate(prompts):
        scheduler.add_request(Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=20,
                                                                 ignore_eos=True)))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(500):
        if not scheduler.has_requests():
            break
        so = scheduler.schedule()
        for out in scheduler.update_from_output(so, runner.execute_model(so)):
            outputs[out.request_id].extend(out.new_token_ids)
    assert all(len(toks) == 20 for toks in outputs.values())
    return outputs, runner.native_decode


@pytest.mark.parametrize("name", ["llama", "qwen3"])  # head_dim 16 and 32, both GQA
@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_tokens_same_with_and_without_native(
        native: None, monkeypatch: pytest.MonkeyPatch, tiny_models: dict[str, TinyModel],
        name: str, block_size: int) -> None:
    monkeypatch.setenv(ENV_SWITCH, "0")
    torch_tokens, used_native = _greedy_tokens(tiny_models[name], block_size)
    assert not used_native
    monkeypatch.delenv(ENV_SWITCH)
    native_tokens, used_native = _greedy_tokens(tiny_models[name], block_size)
    assert used_native
    assert native_tokens == torch_tokens


def test_concurrent_builds_share_one_library(tmp_path: Path) -> None:
    cc = find_compiler()
    if cc is None:
        pytest.skip("no C compiler: nothing to build")
    # Separate open() calls get separate flock locks even in one process, so threads race
    # here as processes would (pytest-xdist workers, a server started next to the tests).
    results: list[Path | BaseException] = []
    barrier = threading.Barrier(3)

    def build() -> None:
        barrier.wait()
        try:
            results.append(compile_library(cc, tmp_path))
        except BaseException as exc:  # reported by the assertion below
            results.append(exc)

    workers = [threading.Thread(target=build) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(set(results)) == 1 and isinstance(results[0], Path), results
    assert results[0].is_file()
    # Only the library and the lock file are left: no temp build dirs, no partial files.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".build.lock",
                                                                 results[0].name])
    assert native_attention._load(results[0]) is not None


def test_failed_build_warns_once_and_falls_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    fake_cc = tmp_path / "broken-cc"
    fake_cc.write_text("#!/bin/sh\necho 'error: broken compiler' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    monkeypatch.setenv("CC", str(fake_cc))
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    monkeypatch.setattr(native_attention, "_native_fn", None)  # as in a fresh process
    with caplog.at_level(logging.WARNING, logger=native_attention.__name__):
        assert not native_decode_supported(torch.float32, CPU, 64)
        assert not native_decode_supported(torch.float32, CPU, 64)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "broken compiler" in warnings[0].getMessage()


def test_switch_and_unsupported_shapes_use_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # None of these may try a build: they are decided before the compiler is looked at.
    monkeypatch.setattr(native_attention, "_build_native", lambda: pytest.fail("built"))
    monkeypatch.setattr(native_attention, "_native_fn", None)
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert not native_decode_supported(torch.float32, CPU, 64)
    monkeypatch.delenv(ENV_SWITCH)
    assert not native_decode_supported(torch.bfloat16, CPU, 64)
    assert not native_decode_supported(torch.float32, CPU, 40)
    assert not native_decode_supported(torch.float32, torch.device("meta"), 64)
