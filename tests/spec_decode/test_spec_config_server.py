"""speculative_config as LLM(...) takes it and as `slotserve serve|generate
--speculative-config JSON` does: bad configs are ConfigErrors naming the field (exit code 2
on the command line), and a real server driven by the openai client reports the spec_decode
counters on /metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from slotserve.engine.args import EngineArgs
from slotserve.entrypoints.cli import build_parser, engine_flags, engine_kwargs_from_args
from slotserve.errors import ConfigError
from slotserve.spec_decode.config import SpeculativeConfig
from tests.helpers import REPO, cli_server

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
        "prompt_lookup_max": 3}


@pytest.mark.parametrize(("value", "field"), [
    ({"method": "eagle"}, "method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": "4"}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
    ({"suffix_decoding_max_spec_factor": -1}, "suffix_decoding_max_spec_factor"),
    ({"model": "draft.gguf"}, "model"),
    ("{not json", None),
    ([1, 2], None),
])
def test_bad_config_names_the_field(value: object, field: str | None) -> None:
    name = "speculative_config" + ("" if field is None else f".{field}")
    with pytest.raises(ConfigError, match=f"^{name}: "):
        EngineArgs.from_kwargs(speculative_config=value)


def test_flags_of_serve_and_generate() -> None:
    parser = build_parser()
    for command in ("serve", "generate"):
        kwargs = engine_kwargs_from_args(parser.parse_args(
            [command, "--speculative-config", json.dumps(SPEC)]))
        config = EngineArgs.from_kwargs(**kwargs).speculative_config
        assert config == SpeculativeConfig(**SPEC)  # type: ignore[arg-type]
        # engine_flags (a child process's command line) writes the config back as JSON.
        again = engine_kwargs_from_args(parser.parse_args(
            [command, *engine_flags({"speculative_config": config})]))
        assert EngineArgs.from_kwargs(**again).speculative_config == config


def test_cli_reports_a_bad_config() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "slotserve.entrypoints.cli", "generate", "--max-tokens", "2",
         "--threads", "1", "--speculative-config", '{"method": "ngram", "prompt_lookup_max": 0}'],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr
    assert "speculative_config.prompt_lookup_max" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_server_speculates_and_reports_metrics() -> None:
    from openai import OpenAI

    spec = json.dumps({**SPEC, "adaptive": False})
    with cli_server(["--threads", "1", "--speculative-config", spec, "--check"],
                    timeout_s=400) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="x")
        model = client.models.list().data[0].id
        # The bundled model's greedy continuation repeats its stage directions.
        out = client.completions.create(model=model, prompt="To be, or not to be",
                                        max_tokens=40, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
    values = {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines()
              if ln.startswith("slotserve:spec_decode") and "position=" not in ln}
    assert values["slotserve:spec_decode_num_drafts_total"] > 0
    assert 0 < values["slotserve:spec_decode_num_accepted_tokens_total"] <= values[
        "slotserve:spec_decode_num_draft_tokens_total"]
    assert 'slotserve:spec_decode_num_accepted_tokens_per_pos_total{model_name=' in metrics
