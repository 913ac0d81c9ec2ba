"""The bundled model, the `slotserve generate` CLI, and engine construction errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest

from slotserve.engine.args import DEFAULT_MODEL, EngineArgs
from slotserve.entrypoints.cli import build_parser, engine_flags, engine_kwargs_from_args
from slotserve.entrypoints.llm import LLM
from slotserve.errors import ConfigError, ModelLoadError
from slotserve.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
needs_bundled = pytest.mark.skipif(not (Path(DEFAULT_MODEL) / "model.safetensors").is_file(),
                                   reason="bundled model not present")


@needs_bundled
def test_bundled_model_loads_and_generates() -> None:
    llm = LLM(check=True, max_num_seqs=4, max_model_len=256)
    assert llm.llm_engine.max_model_len == 256
    outs = llm.generate(["To be, or not", "ROMEO:"],
                        SamplingParams(temperature=0.8, seed=0, max_tokens=20),
                        use_tqdm=False)
    for o in outs:
        assert o.outputs[0].token_ids and o.outputs[0].text
        assert o.outputs[0].finish_reason in ("stop", "length")
    (chat,) = llm.chat([{"role": "user", "content": "Speak."}],
                       SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert chat.outputs[0].token_ids


@needs_bundled
def test_cli_generate_streams_end_to_end() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "slotserve.entrypoints.cli", "generate", "--max-tokens", "12",
         "--seed", "3", "--threads", "1", "--check"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("To be, or not")
    assert len(proc.stdout) > len("To be, or not") + 1
    assert "[12 tokens in" in proc.stderr and "1 threads" in proc.stderr


def test_cli_parser_defaults() -> None:
    args = build_parser().parse_args(["generate"])
    assert (args.prompt, args.max_tokens, args.temperature) == ("To be, or not", 150, 0.8)
    assert args.model is None and args.threads is None


def test_every_engine_argument_is_a_flag_of_every_engine_subcommand() -> None:
    """The flags are generated from EngineArgs: each field reaches serve and generate, its
    aliases and --no- forms too, and engine_flags writes back what was parsed."""
    parser = build_parser()
    given = ["--max-num-seqs", "3", "--no-prefix-caching", "--kv-cache-memory", "0.5",
             "--streaming-session-timeout", "9", "--quantization", "none",
             "--no-native-attention", "--num-blocks", "64", "--policy", "priority"]
    expected = {"max_num_seqs": 3, "enable_prefix_caching": False, "kv_cache_memory": 0.5,
                "streaming_session_timeout_s": 9.0, "quantization": "none",
                "native_attention": False, "num_blocks": 64, "policy": "priority"}
    for command in ("serve", "generate"):
        assert {f.name for f in fields(EngineArgs)} <= set(vars(parser.parse_args([command])))
        kwargs = engine_kwargs_from_args(parser.parse_args([command, *given]))
        assert kwargs == expected
        again = parser.parse_args([command, *engine_flags(kwargs)])
        assert engine_kwargs_from_args(again) == expected
        assert EngineArgs.from_kwargs(**kwargs).kv_cache_memory == 0.5
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantization", "fast"])


def test_cli_reports_a_missing_model(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "slotserve.entrypoints.cli", "generate", "--model",
         str(tmp_path / "nope"), "--max-tokens", "2", "--threads", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_model_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "missing"))


def test_unsupported_architecture(tmp_path: Path, tiny_llama: SimpleNamespace) -> None:
    bad = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama.path, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        LLM(str(bad))


def test_bad_engine_arguments(tiny_llama: SimpleNamespace) -> None:
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(tiny_llama.path, max_num_sequences=4)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        LLM(tiny_llama.path, max_model_len=100_000)
    with pytest.raises(ConfigError, match="KV cache"):
        LLM(tiny_llama.path, num_blocks=4, max_model_len=200)


def test_check_from_environment(monkeypatch: pytest.MonkeyPatch,
                                tiny_llama: SimpleNamespace) -> None:
    monkeypatch.setenv("SLOTSERVE_CHECK", "1")
    llm = LLM(tiny_llama.path, num_blocks=64)
    assert llm.llm_engine.engine_core.engine_core.checker is not None
    llm.generate("To be", SamplingParams(max_tokens=3), use_tqdm=False)
