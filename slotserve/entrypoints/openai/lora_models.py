"""The server's adapters (issue 19): a request's `model` names the base or an adapter,
`/v1/models` lists both (an adapter with its `parent`), and the admin endpoints
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` change the set, as vLLM's do."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from slotserve.entrypoints.openai.errors import APIError, bad_request
from slotserve.entrypoints.openai.protocol import OpenAIBaseModel
from slotserve.errors import ConfigError, RequestValidationError
from slotserve.lora.request import LoRAAdapterError, LoRARequest

if TYPE_CHECKING:
    from slotserve.entrypoints.async_llm import AsyncLLM


LORA_ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_int_id: int | None = None


class LoRAModels:
    """Adapter name -> LoRARequest. Ids are never reused: the engine keys adapter slots and
    prefix-cache hashes by them, so a name loaded again under another path is another id."""

    def __init__(self, engine: AsyncLLM, base_names: Sequence[str],
                 adapters: Sequence[LoRARequest]) -> None:
        self.engine = engine
        self.base_names = list(base_names)
        self.adapters = {a.lora_name: a for a in adapters}
        self._ids = itertools.count(max((a.lora_int_id for a in adapters), default=0) + 1)
        for a in adapters:  # --lora-modules: a bad adapter stops the start
            try:
                engine.processor.check_lora(a)
            except RequestValidationError as exc:
                raise ConfigError(str(exc)) from exc

    @property
    def enabled(self) -> bool:
        return self.engine.processor.lora_checker is not None

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None: the base. Unknown: 404."""
        if model is None or model in self.base_names:
            return None
        lora = self.adapters.get(model)
        if lora is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")
        return lora

    def load(self, name: str, path: str) -> LoRARequest:
        if not self.enabled:
            raise bad_request("LoRA adapters are not enabled (start with --enable-lora)")
        if not name or name in self.adapters or name in self.base_names:
            raise bad_request(f"the model name {name!r} is already in use or empty",
                              "lora_name")
        try:
            lora = LoRARequest(name, next(self._ids), path)
            self.engine.processor.check_lora(lora)  # reads the adapter, checks it
        except (RequestValidationError, LoRAAdapterError) as exc:
            raise bad_request(str(exc), "lora_path") from exc
        self.adapters[name] = lora
        return lora

    def unload(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise APIError(404, f"The adapter `{name}` does not exist.", param="lora_name",
                           code="model_not_found")


def add_lora_routes(app: FastAPI, loras: LoRAModels, is_admin: Callable[[Request], bool],
                    ) -> None:
    def refuse() -> Response:
        return APIError(401, "administrative endpoints need the admin key (send "
                        "Authorization: Bearer ADMIN_KEY).", code="invalid_api_key").response()

    # The key is checked before the body is read.
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request) -> Response:
        if not is_admin(raw):
            return refuse()
        req = LoadLoRAAdapterRequest.model_validate_json(await raw.body())
        lora = await loras.engine.run_off_loop(loras.load, req.lora_name, req.lora_path)
        return JSONResponse({"success": True, "lora_name": lora.lora_name,
                             "lora_int_id": lora.lora_int_id})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request) -> Response:
        if not is_admin(raw):
            return refuse()
        req = UnloadLoRAAdapterRequest.model_validate_json(await raw.body())
        loras.unload(req.lora_name)
        return JSONResponse({"success": True})
