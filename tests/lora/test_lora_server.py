"""`slotserve serve --enable-lora --lora-modules name=path` driven by the official openai
client: `model` names the base or an adapter, /v1/models lists both, unknown names are 404s,
and the admin key guards loading and unloading adapters."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.helpers import cli_server
from tests.lora.conftest import LoRASetup

KEY, ADMIN = "user-key", "admin-key"
N = 8
PROMPT = [5, 17, 42, 99, 123, 7, 250]


@pytest.mark.parametrize("lora_setup", ["llama"], indirect=True)
def test_server_routes_models_to_adapters(lora_setup: LoRASetup, tokenizer: Any) -> None:
    a1, a2, a3 = lora_setup.loras
    args = ["--model", lora_setup.path, "--served-model-name", "base", "--dtype", "float32",
            "--device", "cpu", "--num-blocks", "64", "--check", "--enable-lora",
            "--max-loras", "2", "--max-lora-rank", "16",
            "--lora-modules", f"{a1.lora_name}={a1.lora_path}", f"{a2.lora_name}={a2.lora_path}",
            "--api-key", KEY, "--enable-admin-endpoints", "--admin-api-key", ADMIN,
            "--no-webui"]
    with cli_server(args) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"base", "adapter1", "adapter2"}
        assert cards["adapter1"].model_extra["parent"] == "base"
        assert cards["base"].model_extra.get("parent") is None

        def complete(model: str) -> str:
            out = client.completions.create(model=model, prompt=PROMPT, max_tokens=N,
                                            temperature=0, extra_body={"ignore_eos": True})
            return out.choices[0].text

        def want(lora: Any) -> str:
            return tokenizer.decode(lora_setup.reference(PROMPT, lora, N),
                                    skip_special_tokens=True)

        texts = {name: complete(name) for name in ("base", "adapter1", "adapter2")}
        assert texts == {"base": want(None), "adapter1": want(a1), "adapter2": want(a2)}
        assert len(set(texts.values())) == 3
        with pytest.raises(openai.NotFoundError) as err:
            complete("adapter3")
        assert err.value.body["code"] == "model_not_found"  # type: ignore[index]

        # Loading needs the admin key; then the name serves, until it is unloaded.
        body = {"lora_name": "adapter3", "lora_path": a3.lora_path}
        user = httpx.post(f"{base}/v1/load_lora_adapter", json=body,
                          headers={"Authorization": f"Bearer {KEY}"})
        assert user.status_code == 401
        admin = {"Authorization": f"Bearer {ADMIN}"}
        bad = httpx.post(f"{base}/v1/load_lora_adapter", headers=admin,
                         json={"lora_name": "x", "lora_path": "/no/such/adapter"})
        assert bad.status_code == 400 and "cannot read" in bad.json()["error"]["message"]
        malformed = httpx.post(f"{base}/v1/load_lora_adapter", headers=admin,
                               json={"lora_name": "x"})
        assert malformed.status_code == 400 and "error" in malformed.json()
        ok = httpx.post(f"{base}/v1/load_lora_adapter", json=body, headers=admin)
        assert ok.status_code == 200, ok.text
        chat = client.chat.completions.create(
            model="adapter3", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.model == "adapter3"
        assert complete("adapter3") == want(a3)
        assert "adapter3" in {m.id for m in client.models.list().data}
        gone = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "adapter3"},
                          headers=admin)
        assert gone.status_code == 200
        with pytest.raises(openai.NotFoundError):
            complete("adapter3")
