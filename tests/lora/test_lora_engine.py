"""slotserve greedy == transformers + PEFT (adapter merged), token for token, per adapter, in
mixed batches of the base and three adapters on two adapter slots, with chunked prefill,
forced preemption and prefix caching; the checker on throughout."""

from __future__ import annotations

import random
from typing import Any

import pytest

from slotserve import LoRARequest
from slotserve.engine.args import EngineArgs
from slotserve.entrypoints.llm import LLM
from slotserve.errors import ConfigError, RequestValidationError
from slotserve.sampling_params import SamplingParams
from tests.lora.conftest import LoRASetup

N = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


def make_llm(setup: LoRASetup, **kwargs: Any) -> LLM:
    kwargs = {"max_lora_rank": 16, **kwargs}
    return LLM(setup.path, dtype="float32", device="cpu", check=True, enable_lora=True,
               max_loras=2, **kwargs)


def mixed_batch(setup: LoRASetup) -> tuple[list[list[int]], list[LoRARequest | None]]:
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(3, 30))] for _ in range(12)]
    return prompts, [([None, *setup.loras])[i % 4] for i in range(len(prompts))]


@pytest.mark.parametrize("engine_kwargs", [
    {"max_num_batched_tokens": 24, "long_prefill_token_threshold": 10},
    {"num_blocks": 12, "block_size": 8},
], ids=["chunked", "preemption"])
def test_mixed_batch_matches_merged_peft(lora_setup: LoRASetup,
                                         engine_kwargs: dict[str, Any]) -> None:
    prompts, loras = mixed_batch(lora_setup)
    refs = [lora_setup.reference(p, lora, N) for p, lora in zip(prompts, loras, strict=True)]
    # The adapters change the tokens (else the test proves nothing).
    assert all(refs[i] != lora_setup.reference(prompts[i], None, N) for i in range(1, 12)
               if i % 4)
    llm = make_llm(lora_setup, **engine_kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == refs
    if "num_blocks" in engine_kwargs:
        assert llm.get_stats().num_preemptions > 0
    core = llm.llm_engine.engine_core.engine_core
    assert not core.scheduler.requests


def test_prefix_cache_per_adapter(lora_setup: LoRASetup) -> None:
    # The same prompt under two adapters in turn, then the first again: only that one hits.
    prompt = list(range(40, 75))
    llm = make_llm(lora_setup, block_size=8)
    a, b = lora_setup.loras[0], lora_setup.loras[1]
    got = []
    for lora in (a, b, a, None):
        before = llm.get_stats().prefix_cache_hits
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                           lora_request=lora)[0]
        got.append(out.outputs[0].token_ids)
        hits = llm.get_stats().prefix_cache_hits - before
        assert hits == (32 if len(got) == 3 else 0), (len(got), hits)
    assert got == [lora_setup.reference(prompt, lora, N) for lora in (a, b, a, None)]


def test_bad_adapters_are_refused_naming_them(lora_setup: LoRASetup, tmp_path: Any) -> None:
    import json
    import shutil

    llm = make_llm(lora_setup, max_lora_rank=8)
    big = lora_setup.loras[2]  # rank 16
    with pytest.raises(RequestValidationError, match="'adapter3'.*rank 16 exceeds"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=big)
    bad = tmp_path / "bad"
    shutil.copytree(lora_setup.loras[0].lora_path, bad)
    meta = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**meta, "r": 4}))
    with pytest.raises(RequestValidationError, match="'bad'.*do not fit"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("bad", 9, str(bad)))
    with pytest.raises(RequestValidationError, match="'gone'.*cannot read"):
        llm.generate("hi", GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("gone", 10, str(tmp_path / "none")))
    out = llm.generate("hi", GREEDY, use_tqdm=False, lora_request=lora_setup.loras[0])
    assert len(out[0].outputs[0].token_ids) == N  # the engine is unharmed


def test_lora_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="max_loras"):
        EngineArgs.from_kwargs(enable_lora=True, max_loras=0)
    with pytest.raises(ConfigError, match="enable_lora"):
        EngineArgs.from_kwargs(lora_modules=["a=/x"])
    with pytest.raises(ConfigError, match="name=path"):
        EngineArgs.from_kwargs(enable_lora=True, lora_modules=["nopath"])
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        EngineArgs.from_kwargs(enable_lora=True, max_loras=4, max_cpu_loras=2)
