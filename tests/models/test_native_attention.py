"""The native CPU decode kernel: its build, its argument checks, and end to end.

The kernel's numbers against dense attention (windows, GQA, mid-block context ends, the
thread pool) are in test_paged_attention.py. Here: wrong arguments raise NativeKernelError
before anything is read out of bounds (the checks are `if`s, not asserts `python -O` drops);
greedy decoding through the real Scheduler and ModelRunner gives the same tokens with the
kernel and with `native_attention=False` (Gemma 3's windows included); the switch is read
from the environment once, into EngineArgs; the build's own contract (concurrent builds share
one library, a failed build warns once and falls back) is checked with a private cache. Only
the parts that need a working kernel are skipped when no C compiler is present.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.core.request import Request
from slotserve.core.scheduler import Scheduler
from slotserve.engine.args import NATIVE_ATTENTION_ENV, EngineArgs
from slotserve.models import native_attention, paged_decode_lib
from slotserve.models.attention import AttentionBackend
from slotserve.models.native_attention import (
    NativeKernelError,
    compile_library,
    find_compiler,
    native_decode_supported,
    paged_decode,
)
from slotserve.sampling_params import SamplingParams
from slotserve.worker.model_runner import ModelRunner
from tests.helpers import VOCAB, TinyModel
from tests.models.test_paged_attention import run_step

CPU = torch.device("cpu")


@pytest.fixture
def native() -> None:
    """A working kernel, or a skip when this machine has no C compiler."""
    if find_compiler() is None:
        pytest.skip("no C compiler: the native decode kernel cannot be built")
    # With a compiler present a failed build is a bug, not a reason to skip.
    assert native_decode_supported(torch.float32, CPU, 16), "native decode kernel did not build"


@pytest.mark.parametrize("threads", [1, 3])
def test_thread_pool_splits_the_decodes(native: None, threads: int) -> None:
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, refs = run_step(True, 6, 4, 4, 1, 32, seed=3)
    finally:
        torch.set_num_threads(saved)
    for g, ref in zip(got, refs, strict=True):
        torch.testing.assert_close(g, ref, atol=2e-5, rtol=1e-5)


def _args(nd: int = 3, block_size: int = 4, heads: int = 4, kv_heads: int = 2,
          head_dim: int = 16, num_blocks: int = 10) -> dict[str, object]:
    gen = torch.Generator().manual_seed(0)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return dict(query=torch.randn(nd, heads, head_dim, generator=gen),
                k_cache=torch.randn(shape, generator=gen), v_cache=torch.randn(shape, generator=gen),
                block_table=torch.arange(1, 1 + 2 * nd).view(nd, 2),
                ctx_lens=torch.tensor([1, 5, 8][:nd]), window=None, scale=0.25,
                out=torch.zeros(nd, heads * head_dim), scratch=torch.zeros(1, heads * 8))


def test_kernel_runs_on_good_arguments(native: None) -> None:
    args = _args()
    paged_decode(**args)  # type: ignore[arg-type]
    assert args["out"].abs().sum() > 0  # type: ignore[union-attr]


@pytest.mark.parametrize("change,message", [
    (dict(query=torch.zeros(3, 4, 16, dtype=torch.float64)), "float32"),
    (dict(block_table=torch.arange(1, 7, dtype=torch.int32).view(3, 2)), "int64"),
    (dict(k_cache=torch.zeros(10, 2, 4, 16).transpose(1, 2)), "contiguous"),
    (dict(v_cache=torch.zeros(9, 4, 2, 16)), "alike"),
    (dict(query=torch.zeros(3, 4, 32)), "does not fit"),
    (dict(query=torch.zeros(3, 16, 4).transpose(1, 2)), "heads not contiguous"),
    (dict(block_table=torch.arange(1, 9).view(4, 2)), "block_table"),
    (dict(out=torch.zeros(3, 32)), "out must be"),
    (dict(window=-1), "window"),
    # Found by the kernel itself, from the data, before it reads a block:
    (dict(block_table=torch.tensor([[1, 2], [3, 10], [5, 6]])), "block id"),
    (dict(block_table=torch.tensor([[1, 2], [3, -1], [5, 6]])), "block id"),
    (dict(ctx_lens=torch.tensor([1, 9, 8])), "context length"),
    (dict(ctx_lens=torch.tensor([1, 0, 8])), "context length"),
    (dict(scratch=torch.zeros(1, 4 * 8 - 1)), "scratch"),
])
def test_bad_arguments_raise(native: None, change: dict[str, object], message: str) -> None:
    args = {**_args(), **change}
    with pytest.raises(NativeKernelError, match=message):
        paged_decode(**args)  # type: ignore[arg-type]


def _greedy_tokens(model: TinyModel, block_size: int, native: bool
                   ) -> tuple[dict[str, list[int]], bool]:
    """Greedy outputs of a few requests through the real Scheduler and ModelRunner; a small
    token budget mixes chunked prefills with decodes in one step."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (1, 5, 17, 30)]
    sched_cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=80)
    cache_cfg = CacheConfig(block_size=block_size, num_blocks=96)
    scheduler = Scheduler(sched_cfg, cache_cfg)
    runner = ModelRunner(model.path, sched_cfg, cache_cfg, device="cpu",
                         native_attention=native)
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


# head_dim 16 and 32, GQA; Gemma 3 with its 6-token window on local layers.
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_tokens_same_with_and_without_native(
        native: None, tiny_models: dict[str, TinyModel], name: str, block_size: int) -> None:
    torch_tokens, used_native = _greedy_tokens(tiny_models[name], block_size, native=False)
    assert not used_native
    native_tokens, used_native = _greedy_tokens(tiny_models[name], block_size, native=True)
    assert used_native
    assert native_tokens == torch_tokens


def test_switch_is_read_once_into_engine_args(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NATIVE_ATTENTION_ENV, "0")
    args = EngineArgs.from_kwargs()
    monkeypatch.delenv(NATIVE_ATTENTION_ENV)
    assert args.native_attention is False  # later changes of the environment do not matter
    assert EngineArgs.from_kwargs().native_attention is True
    assert EngineArgs.from_kwargs(native_attention=False).native_attention is False


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
    monkeypatch.setattr(native_attention, "_native_fn", None)  # as in a fresh process
    monkeypatch.setattr(paged_decode_lib, "_fn", None)
    with caplog.at_level(logging.WARNING, logger=native_attention.__name__):
        assert not native_decode_supported(torch.float32, CPU, 64)
        assert not native_decode_supported(torch.float32, CPU, 64)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "broken compiler" in warnings[0].getMessage()


def test_switch_and_unsupported_shapes_use_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # None of these may try a build: they are decided before the compiler is looked at.
    monkeypatch.setattr(native_attention, "_build_native", lambda: pytest.fail("built"))
    monkeypatch.setattr(native_attention, "_native_fn", None)
    backend = AttentionBackend(num_heads=4, num_kv_heads=2, head_dim=64, windows=[None],
                               dtype=torch.float32, device=CPU, native=False)
    assert not backend.native
    assert not native_decode_supported(torch.bfloat16, CPU, 64)
    assert not native_decode_supported(torch.float32, CPU, 40)
    assert not native_decode_supported(torch.float32, torch.device("meta"), 64)


def test_checks_survive_python_optimize(native: None) -> None:
    """`python -O` drops asserts; the kernel's argument checks must still refuse bad input."""
    code = ("import torch\n"
            "from slotserve.models.native_attention import native_decode_supported, "
            "paged_decode, NativeKernelError\n"
            "assert False, 'this assert is gone under -O'\n"
            "native_decode_supported(torch.float32, torch.device('cpu'), 16)\n"
            "q = torch.zeros(1, 2, 16); c = torch.zeros(4, 4, 1, 16)\n"
            "try:\n"
            "    paged_decode(q, c, c, torch.tensor([[9]]), torch.tensor([3]), None, 1.0,\n"
            "                 torch.zeros(1, 32), torch.zeros(1, 64))\n"
            "except NativeKernelError as e:\n"
            "    print('refused:', e)\n")
    res = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "refused: native paged decode: a block id is outside the KV cache" in res.stdout
