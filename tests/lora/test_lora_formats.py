"""Adapter formats: PEFT's per-module rank_pattern / alpha_pattern (greedy tokens equal PEFT
merged), the fields still refused (typed errors naming them), and the front's check reading
only the config and the safetensors header (no torch import)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slotserve import LoRARequest
from slotserve.lora.peft_format import AdapterChecker, read_adapter_spec
from slotserve.lora.request import LoRAAdapterError
from slotserve.model_config import ModelConfig
from tests.lora.conftest import LoRASetup
from tests.lora.test_lora_engine import GREEDY, N, make_llm
from tests.tiny_models import hf_greedy

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANKS = {"q_proj": 4, "layers.1.mlp.down_proj": 2, "model.layers.0.self_attn.o_proj": 12}
ALPHAS = {"v_proj": 3, "layers.0.mlp.up_proj": 40}


def write_patterned(setup: LoRASetup, folder: Path, rslora: bool) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(11 + rslora)
    peft_model = get_peft_model(copy.deepcopy(setup.models[0]), LoraConfig(
        r=8, lora_alpha=16, use_rslora=rslora, target_modules=TARGETS,
        rank_pattern=RANKS, alpha_pattern=ALPHAS, init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(5.0)
    peft_model.save_pretrained(folder)
    return peft_model.merge_and_unload().eval()


def test_rank_and_alpha_patterns_equal_peft(lora_setup: LoRASetup, tmp_path: Path) -> None:
    merged = [write_patterned(lora_setup, tmp_path / f"p{i}", bool(i)) for i in range(2)]
    loras = [LoRARequest(f"patterned{i}", 20 + i, str(tmp_path / f"p{i}")) for i in range(2)]
    meta = json.loads((tmp_path / "p0" / "adapter_config.json").read_text())
    assert meta["rank_pattern"] == RANKS and meta["alpha_pattern"] == ALPHAS
    spec = read_adapter_spec(loras[0], ModelConfig.from_pretrained(lora_setup.path), 16)
    ranks = {(m.layer, m.module): (m.rank, m.scaling) for m in spec.modules}
    assert ranks[(0, "q_proj")] == (4, 4.0) and ranks[(1, "down_proj")] == (2, 8.0)
    assert ranks[(0, "o_proj")] == (12, 16 / 12) and ranks[(1, "o_proj")] == (8, 2.0)
    assert ranks[(0, "v_proj")] == (8, 3 / 8) and ranks[(0, "up_proj")] == (8, 5.0)
    assert spec.rank == 12
    prompts = [[5 + i, 17, 99, 3 * i + 40, 8, 250, 61][: 4 + i] for i in range(6)]
    per_prompt = [loras[i % 2] if i % 3 else lora_setup.loras[0] for i in range(6)]
    refs = []
    for p, lora in zip(prompts, per_prompt, strict=True):
        model = (merged[lora.lora_int_id - 20] if lora.lora_int_id >= 20
                 else lora_setup.models[lora.lora_int_id])
        refs.append(hf_greedy(model, p, N)[0])
    assert refs[1] != lora_setup.reference(prompts[1], None, N)
    llm = make_llm(lora_setup)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=per_prompt)
    assert [o.outputs[0].token_ids for o in outs] == refs


@pytest.mark.parametrize(("field", "value"), [
    ("modules_to_save", ["lm_head"]), ("bias", "lora_only"), ("fan_in_fan_out", True),
    ("rank_pattern", {"q_proj": 3}), ("alpha_pattern", {"q_proj": "big"}),
    ("rank_pattern", ["q_proj"]), ("r", 0)])
def test_unsupported_fields_are_refused_naming_them(lora_setup: LoRASetup, tmp_path: Path,
                                                    field: str, value: Any) -> None:
    folder = tmp_path / "a"
    shutil.copytree(lora_setup.loras[0].lora_path, folder)
    meta = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**meta, field: value}))
    check = AdapterChecker(ModelConfig.from_pretrained(lora_setup.path), 16)
    with pytest.raises(LoRAAdapterError, match=rf"'x'.*{field}"):
        check(LoRARequest("x", 1, str(folder)))
    check(lora_setup.loras[0])  # the unchanged folder passes


def test_front_check_imports_no_torch(lora_setup: LoRASetup, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(Path(lora_setup.loras[0].lora_path) / "adapter_config.json", bad)
    (bad / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    code = f"""
import sys
from slotserve.lora.peft_format import AdapterChecker
from slotserve.lora.request import LoRAAdapterError, LoRARequest
from slotserve.model_config import ModelConfig
check = AdapterChecker(ModelConfig.from_pretrained({lora_setup.path!r}), 16)
check(LoRARequest("good", 1, {lora_setup.loras[0].lora_path!r}))
try:
    check(LoRARequest("bad", 2, {str(bad)!r}))
except LoRAAdapterError as exc:
    print("refused:", exc)
print("torch imported:", "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "refused: LoRA adapter 'bad'" in out and out.strip().endswith("torch imported: False"), out


GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
              "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
              "down_proj": "ffn_down"}


def write_gguf_lora(setup: LoRASetup, lora: LoRARequest, out: Path, arch: str,
                    cfg: ModelConfig) -> None:
    """The PEFT adapter as llama.cpp's convert_lora_to_gguf.py lays it out, written by gguf's
    own writer: `blk.N.<name>.weight.lora_a/b`, alpha in adapter.lora.alpha, and for llama
    the rows of q and k (B's rows) permuted for llama.cpp's pairwise rotation."""
    import gguf
    from safetensors.numpy import load_file

    meta = json.loads((Path(lora.lora_path) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(lora.lora_path) / "adapter_model.safetensors"))
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(meta["lora_alpha"]))
    for key, data in sorted(tensors.items()):
        parts = key.split(".")
        layer, module, half = parts[parts.index("layers") + 1], parts[-3], parts[-2]
        if half == "lora_B" and arch == "llama" and module in ("q_proj", "k_proj"):
            heads = cfg.num_attention_heads if module == "q_proj" else cfg.num_key_value_heads
            rows = data.shape[0]
            data = data.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(rows, -1)
        name = f"blk.{layer}.{GGUF_NAMES[module]}.weight.{half.lower()}"
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_lora_equals_its_peft_adapter(lora_setup: LoRASetup, tmp_path: Path) -> None:
    cfg = ModelConfig.from_pretrained(lora_setup.path)
    arch = {"llama": "llama", "qwen3": "qwen3"}[cfg.model_type]
    peft_lora = lora_setup.loras[0]  # rank 8 on all seven projections
    write_gguf_lora(lora_setup, peft_lora, tmp_path / "a.gguf", arch, cfg)
    gguf_lora = LoRARequest("from-gguf", 40, str(tmp_path / "a.gguf"))
    spec = read_adapter_spec(gguf_lora, cfg, 16)
    assert spec.format == "gguf" and spec.rank == 8 and len(spec.modules) == 7 * 2
    prompts = [[7, 19, 88, 140, 3], [250, 4, 61], [33, 34, 35, 36, 37, 38]]
    llm = make_llm(lora_setup)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], GREEDY, use_tqdm=False,
                        lora_request=[gguf_lora] * 3 + [peft_lora] * 3)
    got = [o.outputs[0].token_ids for o in outs]
    assert got[:3] == got[3:] == [lora_setup.reference(p, peft_lora, N) for p in prompts]
    # A file for another architecture, or not an adapter, is refused naming it.
    write_gguf_lora(lora_setup, peft_lora, tmp_path / "b.gguf",
                    "gemma3" if arch != "gemma3" else "llama", cfg)
    with pytest.raises(LoRAAdapterError, match="'b'.*general.architecture"):
        read_adapter_spec(LoRARequest("b", 41, str(tmp_path / "b.gguf")), cfg, 16)
    with pytest.raises(LoRAAdapterError, match="'c'.*max_lora_rank=4"):
        read_adapter_spec(LoRARequest("c", 42, str(tmp_path / "a.gguf")), cfg, 4)
