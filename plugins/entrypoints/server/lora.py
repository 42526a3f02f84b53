"""LoRA adapters on the server: ``/v1/models`` lists them, and with runtime updating allowed
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's routes) change them while it serves.

The two routes are operator routes: they read directories of the server's machine, so they load only from the
allowed roots (by default the directories of the adapters given at start), keep at most ``max_adapters``
adapters, and can need a key of their own (``--admin-api-key``). A path outside the roots is refused without
saying whether it exists; ``/v1/models`` names no path."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, Optional

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from pagoda.errors import InvalidRequestError
from pagoda.execution.lora_request import LoRARequest
from pagoda.plugins.entrypoints.server.errors import APIError
from pagoda.plugins.entrypoints.server.request_body import MAX_NAME_CHARS
from pagoda.plugins.entrypoints.server.serving import ServingContext

DEFAULT_MAX_ADAPTERS = 64  # adapters served at once (given at start and loaded since)
MAX_PATH_CHARS = 4096  # PATH_MAX of Linux

AdapterName = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


@dataclass(frozen=True)
class LoRAAdminOptions:
    """What the operator allows the adapter routes: ``allowed_roots`` (None: the directories of the adapters
    given at start), ``max_adapters`` served at once, and ``admin_api_key`` (checked by the guard middleware)."""

    allowed_roots: Optional[tuple[str, ...]] = None
    max_adapters: int = DEFAULT_MAX_ADAPTERS
    admin_api_key: Optional[str] = None

    def roots(self, ctx: ServingContext) -> list[str]:
        """The allowed roots, resolved (symbolic links followed)."""
        roots = self.allowed_roots
        if roots is None:
            lora = ctx.engine.engine.config.lora
            roots = tuple(os.path.dirname(os.path.realpath(path)) for _, path in (lora.lora_modules if lora else ()))
        return [os.path.realpath(root) for root in roots]


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: AdapterName
    lora_path: Annotated[str, Field(max_length=MAX_PATH_CHARS)]


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: AdapterName
    lora_int_id: Optional[int] = None  # vLLM's field; the name alone says which adapter


def adapter_models(ctx: ServingContext, created: int) -> list[dict]:
    """The ``/v1/models`` entries of the served adapters: each names the base model as its ``parent``."""
    return [{"id": name, "object": "model", "created": created, "owned_by": "pagoda", "root": name,
             "parent": ctx.served_model_name, "max_model_len": ctx.max_model_len}
            for name, lora in sorted(ctx.engine.engine.loras.items())]


def add_lora_routes(app: FastAPI, ctx: ServingContext) -> None:
    """The load and unload routes (``pagoda serve --allow-runtime-lora-updating``), bounded by
    ``app.state.lora_admin`` (a :class:`LoRAAdminOptions`)."""
    core = ctx.engine.engine
    options: LoRAAdminOptions = getattr(app.state, "lora_admin", None) or LoRAAdminOptions()
    roots = options.roots(ctx)

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        if core.runner.lora is None:
            raise APIError(400, "LoRA is off on this server; start it with --enable-lora", param="lora_name")
        if not body.lora_name or body.lora_name == ctx.served_model_name:
            raise APIError(400, f"lora_name {body.lora_name!r} cannot name an adapter: it is empty or the base "
                                "model's name; choose another", param="lora_name")
        if len(core.loras) >= options.max_adapters:
            raise APIError(400, f"this server serves at most {options.max_adapters} LoRA adapters and serves "
                                f"{len(core.loras)}; unload one first, or start the server with a larger "
                                "--max-lora-adapters", param="lora_name")
        path = os.path.realpath(body.lora_path)
        if not any(os.path.commonpath([root, path]) == root for root in roots):
            raise APIError(400, "lora_path is not under a directory this server loads adapters from; put the "
                                "adapter there, or start the server with --lora-allowed-roots naming its directory",
                           param="lora_path")

        def load() -> None:
            core.add_lora(LoRARequest(body.lora_name, core.next_lora_id(), path))

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
