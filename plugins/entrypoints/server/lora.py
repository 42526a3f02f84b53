"""LoRA adapters on the server: ``/v1/models`` lists them, and with runtime updating allowed
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's routes) change them while it serves."""

from __future__ import annotations

from typing import Optional

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from pagoda.errors import InvalidRequestError
from pagoda.lora_request import LoRARequest
from pagoda.plugins.entrypoints.server.errors import APIError
from pagoda.plugins.entrypoints.server.serving import ServingContext


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: Optional[int] = None  # vLLM's field; the name alone says which adapter


def adapter_models(ctx: ServingContext, created: int) -> list[dict]:
    """The ``/v1/models`` entries of the served adapters: each names the base model as its ``parent``."""
    return [{"id": name, "object": "model", "created": created, "owned_by": "pagoda", "root": lora.lora_path,
             "parent": ctx.served_model_name, "max_model_len": ctx.max_model_len}
            for name, lora in sorted(ctx.engine.engine.loras.items())]


def add_lora_routes(app: FastAPI, ctx: ServingContext) -> None:
    """The load and unload routes (``pagoda serve --allow-runtime-lora-updating``)."""
    core = ctx.engine.engine

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        if core.runner.lora is None:
            raise APIError(400, "LoRA is off on this server; start it with --enable-lora", param="lora_name")
        if not body.lora_name or body.lora_name == ctx.served_model_name:
            raise APIError(400, f"lora_name {body.lora_name!r} cannot name an adapter: it is empty or the base "
                                "model's name; choose another", param="lora_name")

        def load() -> None:
            core.add_lora(LoRARequest(body.lora_name, core.next_lora_id(), body.lora_path))

        try:
            await ctx.engine.run_in_engine(load)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        if body.lora_name not in core.loras:
            served = ", ".join(repr(n) for n in sorted(core.loras)) or "none"
            raise APIError(404, f"no LoRA adapter named {body.lora_name!r} is served (served adapters: {served})",
                           param="lora_name", code="model_not_found")
        try:
            await ctx.engine.run_in_engine(lambda: core.remove_lora(body.lora_name))
        except InvalidRequestError as exc:  # unloaded by another request meanwhile
            raise APIError(404, str(exc), param="lora_name", code="model_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
