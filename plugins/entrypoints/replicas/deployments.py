"""The Serve application of ``pagoda serve --replicas N``: one ingress, N engine replicas.

The ingress reads each request, turns its prompt into block hashes and forwards it through a handle
whose request router (:class:`~.ray_router.PagodaRequestRouter`) picks the replica. Each replica runs
the whole pagoda server app (:func:`pagoda.plugins.entrypoints.server.build_app`) in-process on the
requests it gets, so every route, error and stream behaves as with one ``pagoda serve``.

With replica roles (``--replica-roles prefill,decode``) there are two engine deployments: the prefill
replicas (``--kv-role prefill``) get each completion's prompt first, as one token without streaming, and
save its blocks through the KV connector; the request then goes unchanged to a decode replica
(``--kv-role decode``), which loads those blocks and streams the answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

from pagoda.engine.request_limits import DEFAULT_MAX_TOKENS

from starlette.responses import Response

from pagoda.engine.engine_args import EngineArgs
from pagoda.execution.routing import RoutingRequest, prompt_block_hashes
from pagoda.kv.handoff import prefill_body
from pagoda.plugins.entrypoints.replicas.fleet_metrics import merge_replica_metrics
from pagoda.plugins.entrypoints.replicas.forward import ForwardedRequest, ResponseStart, run_asgi

logger = logging.getLogger("pagoda")

# the paths whose body holds a prompt to route by (and, with replica roles, to prefill first)
_PROMPT_PATHS = ("/v1/completions", "/v1/chat/completions")
# how often a stopping replica looks whether its requests are done (Serve's default, 2 s, is waited even by an
# idle replica, once per deployment: the ingress stops before the engines)
_DRAIN_CHECK_S = 0.25
# a replica's role with --replica-roles: the KV role its engine is given
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class ReplicaSetOptions:
    """How many replicas, how requests reach them, and the server options every replica shares."""

    num_replicas: int = 2
    router: str = "prefix-aware"
    router_options: Optional[dict] = None
    cpus_per_replica: float = 1.0
    # autoscaling on queue depth: at most this many replicas (None: a fixed num_replicas)
    max_replicas: Optional[int] = None
    min_replicas: int = 1
    target_requests_per_replica: float = 16.0
    api_key: Optional[str] = None
    # Host header names to answer (None: any), as pagoda serve's --allowed-hosts
    allowed_hosts: Optional[frozenset[str]] = None
    max_request_bytes: int = 1 << 20
    # as pagoda serve's --default-max-tokens (None: all the context leaves)
    default_max_tokens: Optional[int] = DEFAULT_MAX_TOKENS
    # as pagoda serve's --max-request-chars (None: its default)
    max_request_chars: Optional[int] = None
    # as pagoda serve's --tenant-source: where each replica's server reads a request's tenant (the ingress forwards
    # the headers and body as they came, so each replica sees the same tenant)
    tenant_source: str = "api-key"
    # requests Serve lets a replica have at once; the engine queues and refuses (503) beyond its own limits
    max_ongoing_requests: int = 1024
    # one role per replica ("prefill" or "decode"), or None: every replica prefills and decodes its requests
    roles: Optional[tuple[str, ...]] = None

    def num_with_role(self, role: str) -> int:
        return sum(r == role for r in self.roles or ())


class EngineReplica:
    """One engine and its server app; requests arrive as :class:`ForwardedRequest`."""

    def __init__(self, engine_args: EngineArgs, options: ReplicaSetOptions) -> None:
        from ray import serve

        from pagoda.engine.async_engine import AsyncLLMEngine
        from pagoda.engine.llm_engine import LLMEngine
        from pagoda.host.openmp import release_thread_pool
        from pagoda.plugins.entrypoints.server import build_app
        from pagoda.registry.plugin_manager import get_plugin_manager

        self.engine = AsyncLLMEngine(LLMEngine.from_engine_args(engine_args, get_plugin_manager()))
        self.app = build_app(self.engine, api_key=options.api_key, max_request_bytes=options.max_request_bytes,
                             allowed_hosts=options.allowed_hosts, default_max_tokens=options.default_max_tokens,
                             max_request_chars=options.max_request_chars, tenant_source=options.tenant_source)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.started = False
        # the engine steps in a thread of its own: this thread's OpenMP workers would keep libgomp from letting that
        # thread's workers spin between regions (see pagoda.host.openmp.release_thread_pool)
        release_thread_pool()

    async def handle(self, request: ForwardedRequest):
        if not self.started:  # the engine thread delivers outputs on the replica's event loop
            self.engine.start(asyncio.get_running_loop())
            self.started = True
        async for item in run_asgi(self.app, request, self.name):
            yield item

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Read by the autoscaling policy (:func:`~.autoscaling.queue_depth_policy`)."""
        scheduler = self.engine.engine.scheduler
        return {"num_requests_waiting": float(scheduler.num_waiting),
                "num_requests_running": float(scheduler.num_running)}

    def check_health(self) -> None:
        if self.started and not self.engine.is_healthy:
            raise RuntimeError(f"the engine of replica {self.name} stopped: {self.engine.dead_reason}")


class Ingress:
    """The one HTTP entry: forwards every request to an engine replica, counts where prompts went."""

    def __init__(self, engine: Any, engine_args: EngineArgs, options: ReplicaSetOptions,
                 prefill: Any = None) -> None:
        from pagoda.engine.components import load_tokenizer

        config = engine_args.create_engine_config()
        self.engine = engine  # with replica roles, the decode replicas
        self.prefill = prefill  # the prefill replicas (None: no roles)
        self.num_prefill_failed = 0  # prompts a prefill replica failed to compute: the decode replica did
        self.tokenizer = load_tokenizer(config.model.tokenizer, config.model.chat_template)
        self.block_size = config.cache.block_size
        # the names a request's "model" gives the base model by; any other names a LoRA adapter (with LoRA on)
        self.base_model_names = {config.model.served_model_name, config.model.model} if config.lora else None
        self.max_request_bytes = options.max_request_bytes
        self.router_name = options.router
        self.num_routed: Counter[tuple[str, str]] = Counter()  # (replica, reason) -> requests
        self.num_matched_tokens = 0

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import PlainTextResponse

        if request.url.path == "/metrics" and request.method == "GET":
            return PlainTextResponse(await self.fleet_metrics(list(request.headers.raw)) + self.metrics_text(),
                                     media_type="text/plain; version=0.0.4")
        body = await request.body()
        forwarded = ForwardedRequest(request.method, request.url.path, request.url.query.encode(),
                                     list(request.headers.raw), body)
        prompt = request.method == "POST" and request.url.path in _PROMPT_PATHS
        if prompt and len(body) <= self.max_request_bytes:
            forwarded.routing = await asyncio.to_thread(self.routing_request, request.url.path, body)
        prefilled_by = None
        if prompt and self.prefill is not None:
            refused, prefilled_by = await self.prefill_first(forwarded)
            if refused is not None:
                return refused
        stream = self.engine.options(stream=True).handle.remote(forwarded)
        start = await stream.__anext__()
        self.count(forwarded, start)
        if prefilled_by is not None:
            start = ResponseStart(start.status, start.headers + [(b"x-pagoda-prefill-replica", prefilled_by)])
        return RelayedResponse(start, stream)

    async def prefill_first(self, forwarded: ForwardedRequest) -> tuple[Optional[Response], Optional[bytes]]:
        """Send ``forwarded``'s prompt to a prefill replica as one token without streaming; it answers once the
        prompt's blocks are in the store. Returns (the answer to give the client instead, when the prefill replica
        refused the request with a 4xx; the prefill replica's name when it computed the prompt). A prefill
        replica that fails otherwise costs the decode replica the prompt, not the request."""
        try:
            payload = json.loads(forwarded.body)
        except ValueError:
            return None, None  # the decode replica answers with the error
        if not isinstance(payload, dict):
            return None, None
        body = json.dumps(prefill_body(payload)).encode()
        headers = [(k, v) for k, v in forwarded.headers if k.lower() != b"content-length"]
        first = ForwardedRequest(forwarded.method, forwarded.path, forwarded.query_string,
                                 headers + [(b"content-length", str(len(body)).encode())], body,
                                 routing=forwarded.routing)
        try:
            stream = self.prefill.options(stream=True).handle.remote(first)
            start = await stream.__anext__()
            content = b"".join([chunk async for chunk in stream])
        except Exception as exc:  # a replica that died or was stopped: the decode replica computes the prompt
            logger.warning("the prefill replica failed (%s); the decode replica computes the prompt", exc)
            self.num_prefill_failed += 1
            return None, None
        self.count(first, start, matched=False)
        name = dict(start.headers).get(b"x-pagoda-replica", b"?")
        if 400 <= start.status < 500:  # the request itself is wrong: the decode replica would say so too
            return Response(content, start.status, headers={k.decode("latin-1"): v.decode("latin-1") for k, v
                                                            in start.headers if k.lower() != b"content-length"}), None
        if start.status != 200:
            logger.warning("the prefill replica %s answered %d; the decode replica computes the prompt",
                           name.decode(), start.status)
            self.num_prefill_failed += 1
            return None, None
        return None, name

    def engine_handles(self) -> list[Any]:
        return [self.engine] + ([self.prefill] if self.prefill is not None else [])

    async def fleet_metrics(self, headers: list[tuple[bytes, bytes]]) -> str:
        """Every replica's /metrics (of both roles), each sample labelled with its replica."""
        pages: dict[str, str] = {}
        for handle in self.engine_handles():
            first = ForwardedRequest("GET", "/metrics", b"", headers, b"")
            pages.update([await self.fetch(first, handle)])
            for name in first.replica_names:
                if name not in pages:
                    try:  # a replica stopping meanwhile is left out, not waited for
                        pages.update([await asyncio.wait_for(self.fetch(
                            ForwardedRequest("GET", "/metrics", b"", headers, b"", target=name), handle), 10.0)])
                    except asyncio.TimeoutError:
                        continue
        return merge_replica_metrics(pages)

    async def fetch(self, forwarded: ForwardedRequest, handle: Any = None) -> tuple[str, str]:
        """(replica name, response text) of a small request."""
        stream = (handle or self.engine).options(stream=True).handle.remote(forwarded)
        start = await stream.__anext__()
        body = b"".join([chunk async for chunk in stream])
        return dict(start.headers)[b"x-pagoda-replica"].decode(), body.decode()

    def routing_request(self, path: str, body: bytes) -> RoutingRequest:
        """The prompt's block hashes; a body that does not parse routes as no prompt (the replica
        then answers with the error)."""
        try:
            payload = json.loads(body)
            token_ids = self.prompt_token_ids(path, payload)
        except Exception:  # malformed JSON or messages: the replica's validation reports it
            return RoutingRequest("", (), 0)
        lora_name = requested_lora(payload, self.base_model_names)
        return RoutingRequest("", tuple(prompt_block_hashes(token_ids, self.block_size, lora_name)), len(token_ids),
                              lora_name)

    def prompt_token_ids(self, path: str, payload: dict) -> list[int]:
        if path == "/v1/chat/completions":
            messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                         else "".join(p.get("text", "") for p in m["content"])} for m in payload["messages"]]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        prompt = payload["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of prompts routes by its first
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)

    def count(self, forwarded: ForwardedRequest, start: ResponseStart, matched: bool = True) -> None:
        replica = dict(start.headers).get(b"x-pagoda-replica", b"?").decode()
        decision = forwarded.decision
        reason = decision.reason if decision is not None else "fallback"
        self.num_routed[(replica, reason)] += 1
        if decision is not None and matched:
            self.num_matched_tokens += decision.num_matched_blocks * self.block_size

    def metrics_text(self) -> str:
        lines = ["# HELP pagoda:router_requests_total Requests the ingress sent to each replica, by why it "
                 "was chosen (prefix, lora, least_loaded, imbalance, fallback).",
                 "# TYPE pagoda:router_requests_total counter"]
        for (replica, reason), n in sorted(self.num_routed.items()):
            lines.append(f'pagoda:router_requests_total{{replica="{replica}",reason="{reason}",'
                         f'router="{self.router_name}"}} {n}')
        lines += ["# HELP pagoda:router_matched_prompt_tokens_total Prompt tokens routed to a replica that "
                  "was sent the same prefix before.",
                  "# TYPE pagoda:router_matched_prompt_tokens_total counter",
                  f"pagoda:router_matched_prompt_tokens_total {self.num_matched_tokens}"]
        if self.prefill is not None:
            lines += ["# HELP pagoda:router_prefill_failures_total Prompts a prefill replica failed to compute "
                      "(unreachable, or a 5xx): the decode replica computed them.",
                      "# TYPE pagoda:router_prefill_failures_total counter",
                      f"pagoda:router_prefill_failures_total {self.num_prefill_failed}"]
        return "\n".join(lines) + "\n"


def requested_lora(payload: Any, base_model_names: Optional[set[str]]) -> Optional[str]:
    """The LoRA adapter a request's ``model`` names: None for the base model's names, or where LoRA is off
    (``base_model_names`` None); an unknown name routes as an adapter too, and its replica answers 404."""
    model = payload.get("model") if isinstance(payload, dict) else None
    if base_model_names is None or not isinstance(model, str) or not model or model in base_model_names:
        return None
    return model


class RelayedResponse(Response):
    """A replica's response streamed to the client as it arrives."""

    def __init__(self, start: ResponseStart, stream: Any) -> None:  # no super(): nothing is rendered here
        self.start, self.stream = start, stream
        self.background = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.start.status, "headers": self.start.headers})
        try:
            async for chunk in self.stream:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            self.stream.cancel()  # a client that went away cancels the replica's request
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def build_application(engine_args: EngineArgs, options: ReplicaSetOptions) -> Any:
    """The Serve application: ``serve.run(build_application(...))`` starts it on a Ray cluster."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from pagoda.plugins.entrypoints.replicas.autoscaling import autoscaling_config
    from pagoda.plugins.entrypoints.replicas.ray_router import PagodaRequestRouter

    if options.roles and engine_args.kv_connector is None:
        raise ValueError("replica roles hand each prompt's KV blocks from a prefill to a decode replica through a "
                         "KV connector: set the engine's kv_connector (and kv_connector_options)")
    router_options = dict(options.router_options or {})
    lora = engine_args.create_engine_config().lora
    if lora is not None and options.router == "prefix-aware":  # the adapters each replica keeps loaded
        router_options.setdefault("max_loras_per_replica", lora.max_cpu_loras)
    router_config = RequestRouterConfig(request_router_class=PagodaRequestRouter,
                                        request_router_kwargs={"router": options.router,
                                                               "router_options": router_options})

    def engines(name: str, args: EngineArgs, scaling: dict[str, Any]) -> Any:
        return serve.deployment(EngineReplica, name=name).options(
            ray_actor_options={"num_cpus": options.cpus_per_replica},
            max_ongoing_requests=options.max_ongoing_requests, request_router_config=router_config,
            health_check_period_s=5, graceful_shutdown_wait_loop_s=_DRAIN_CHECK_S, **scaling).bind(args, options)

    ingress = serve.deployment(Ingress, name="pagoda-ingress").options(
        num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=options.max_ongoing_requests,
        graceful_shutdown_wait_loop_s=_DRAIN_CHECK_S)
    if options.roles:  # the same engine flags but the KV role, in a deployment per role
        decode, prefill = (engines(f"pagoda-{role}", engine_args.model_copy(update={"kv_role": role}),
                                   {"num_replicas": options.num_with_role(role)}) for role in ("decode", "prefill"))
        return ingress.bind(decode, engine_args, options, prefill)
    scaling: dict[str, Any] = ({"autoscaling_config": autoscaling_config(options)} if options.max_replicas
                               else {"num_replicas": options.num_replicas})
    return ingress.bind(engines("pagoda-engine", engine_args, scaling), engine_args, options)


def app_builder(args: dict[str, Any]) -> Any:
    """The application for a Serve config (KubeRay's ``serveConfigV2``, ``serve run``):
    ``import_path: pagoda.plugins.entrypoints.replicas.deployments:app_builder`` with
    ``args: {engine: {<engine option>: value, ...}, replicas: {<ReplicaSetOptions field>: value, ...}}``."""
    unknown = sorted(set(args) - {"engine", "replicas"})
    if unknown:
        raise ValueError(f"unknown keys {unknown} in the application's args; expected 'engine' and 'replicas'")
    replicas = dict(args.get("replicas") or {})
    fields = set(ReplicaSetOptions.__dataclass_fields__)
    if set(replicas) - fields:
        raise ValueError(f"unknown replica options {sorted(set(replicas) - fields)}; known: {sorted(fields)}")
    if replicas.get("allowed_hosts") is not None:
        replicas["allowed_hosts"] = frozenset(replicas["allowed_hosts"])
    if replicas.get("roles") is not None:
        replicas["roles"] = tuple(replicas["roles"])
    # the key comes from the pods' environment (a Kubernetes secret), not from the config
    replicas.setdefault("api_key", os.environ.get("PAGODA_API_KEY"))
    return build_application(EngineArgs.build(**(args.get("engine") or {})), ReplicaSetOptions(**replicas))
