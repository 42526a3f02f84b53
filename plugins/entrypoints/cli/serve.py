"""``pagoda serve``: the OpenAI-compatible server under uvicorn."""

from __future__ import annotations

import argparse
import gc
import logging
import os

from pagoda.cli import add_config_file_arg, add_engine_args, engine_args_from
from pagoda.plugins.entrypoints.cli import vllm_flags
from pagoda.plugins.entrypoints.replicas.command import add_replica_args, run_replicas

logger = logging.getLogger("pagoda")


def register(sub) -> None:
    from pagoda.plugins.entrypoints.server import (DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT,
                                                   DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_TOKENS)
    from pagoda.plugins.entrypoints.server.response_store import DEFAULT_MAX_RESPONSES, DEFAULT_TTL_SECONDS

    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="Serve the model over an OpenAI-compatible HTTP API (/v1/completions, "
                                   "/v1/chat/completions, /v1/responses, /v1/models, /health, /metrics, /tokenize, "
                                   "/detokenize, /version). SIGTERM stops accepting requests and lets open ones "
                                   "finish.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the checkpoint folder to serve, as vLLM takes it (the same as --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and /version "
                        "(default: $PAGODA_API_KEY, else no key)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies get 413")
    p.add_argument("--request-header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT,
                   help="seconds a new connection may take to send its request line and headers; slower ones "
                        "are closed with 408")
    p.add_argument("--request-body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT,
                   help="seconds a request body may take to arrive in full; slower ones get 408")
    p.add_argument("--limit-concurrency", type=int, default=1024,
                   help="open connections and running requests at most: at the limit a new connection first closes "
                        "those without a running request (idle or still sending headers); beyond it, 503")
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="tokens a request that gives no max_tokens (or max_completion_tokens) may generate, at most "
                        "what the context leaves; 0: all the context leaves")
    p.add_argument("--max-request-chars", type=int, default=None, metavar="N",
                   help="characters a request may have in all its prompts or messages; more is refused with 400 "
                        "before any tokenizing (default: 4 x --max-model-len x the longest token's characters, "
                        "four prompts as long as the context can hold)")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host header names to answer (default: the loopback names when serving "
                        "on a loopback address without --api-key, else any)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds open requests may take to finish after SIGTERM before they are failed")
    p.add_argument("--request-log", default=None, metavar="PATH",
                   help="append one JSON line per finished request (arrival, prompt token ids, output tokens, "
                        "priority, tenant, timings) to PATH; `pagoda simulate --from-request-log PATH` replays it")
    p.add_argument("--step-log", default=None, metavar="PATH",
                   help="append one JSON line per engine step (prefill and decode rows, phase times, attention, "
                        "sampling, the gap before it) to PATH; `pagoda bench steps PATH` summarises it")
    p.add_argument("--timeline-log", default=None, metavar="PATH",
                   help="append one JSON line per completion and chat completion to PATH: when it arrived, was "
                        "parsed, tokenized, queued by the engine, first scheduled, got its first token and had its "
                        "first bytes written; `pagoda bench timeline PATH --step-log STEPS` summarises it")
    p.add_argument("--max-stored-responses", type=_count, default=DEFAULT_MAX_RESPONSES,
                   help="responses of /v1/responses kept in memory for previous_response_id and GET "
                        "/v1/responses/{id}, the least recently used dropped first (default %(default)s; 0: keep none)")
    p.add_argument("--stored-response-ttl", type=_seconds, default=DEFAULT_TTL_SECONDS, metavar="SECONDS",
                   help="how long a stored response is kept after it was last used (default %(default)s)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=None,
                   help="read the model's tool calls when tool_choice is \"auto\" (the default when tools are "
                        "given). Default: on with the model family's parser and, where the checkpoint's chat template "
                        "cannot show tools, pagoda's tool-aware template for the family (the start-up log says which); "
                        "when no parser fits, \"auto\" is answered as text with a warning. "
                        "--enable-auto-tool-choice: require a parser (fail at start-up without one); "
                        "--no-enable-auto-tool-choice: off, \"auto\" with tools is a 400")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the format the model writes tool calls in, instead of its family's: a pagoda_tool_parsers "
                        "component (built-in: hermes, llama3_json, pythonic, openai; `pagoda plugins` lists all)")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="the format a reasoning model sets its thinking apart in, read into reasoning_content: a "
                        "pagoda_reasoning_parsers component (built-in: deepseek_r1, qwen3, openai_gptoss; `pagoda "
                        "plugins` lists all), or none. Default: the model family's where it is known (the start-up "
                        "log says which)")
    p.add_argument("--strict-request-fields", action="store_true",
                   help="answer a request field of no OpenAI or vLLM schema with a 400, as OpenAI does (by default "
                        "such a field is ignored, logged once and named in the x-pagoda-ignored-fields header)")
    p.add_argument("--tenant-source", default="api-key", choices=["api-key", "header", "user"],
                   help="who a request counts for under --scheduling-policy fair: its API key (a digest of the "
                        "bearer token), its x-pagoda-tenant header, or the body's user field (default %(default)s)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which add and remove LoRA "
                        "adapters while the server runs (needs --enable-lora; anyone who can reach the server can "
                        "then make it read a directory of its machine)")
    p.add_argument("--admin-api-key", default=None,
                   help="the key the operator routes (load and unload LoRA adapters) need, instead of --api-key")
    p.add_argument("--lora-allowed-roots", default=None,
                   help="comma-separated directories the load route may read adapters from (default: the "
                        "directories of the --lora-modules adapters; none without them)")
    p.add_argument("--max-lora-adapters", type=int, default=64,
                   help="LoRA adapters served at once, those of --lora-modules included (default 64)")
    p.add_argument("--task", default="auto", choices=["auto", "generate", "embed", "score"],
                   help="what the model serves: generate (text: completions, chat, responses), embed "
                        "(/v1/embeddings, /v1/score by cosine, /v1/rerank) or score (a cross-encoder: /v1/score, "
                        "/v1/rerank). auto: score for a *ForSequenceClassification encoder, embed for other "
                        "encoders (BertModel, XLMRobertaModel) and for checkpoints with sentence-transformers "
                        "files (modules.json), generate otherwise")
    p.add_argument("--runner", default=None, choices=["generate", "pooling"],
                   help="vLLM's name for the same choice: pooling is --task embed (or score for a cross-encoder)")
    add_config_file_arg(p)
    vllm_flags.add_vllm_serve_args(p)
    add_engine_args(p)
    add_replica_args(p)
    p.set_defaults(func=run_serve)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def apply_server_defaults(ns: argparse.Namespace, environ) -> None:
    """Engine options whose default differs for a server: the KV cache mapped at start (``kv_cache_prefault``),
    since a server starts once and serves for long and its first requests should not wait for fresh KV memory to
    be mapped, unless the flag or its variable says otherwise."""
    if ns.kv_cache_prefault is None and "PAGODA_KV_CACHE_PREFAULT" not in environ:
        ns.kv_cache_prefault = True


def run_serve(ns: argparse.Namespace) -> int:
    from pagoda.errors import ConfigError

    if ns.model_tag is not None:
        if getattr(ns, "model", None) not in (None, ns.model_tag):
            raise ConfigError(f"pagoda serve {ns.model_tag} --model {ns.model}: name the model once")
        ns.model = ns.model_tag

    apply_server_defaults(ns, os.environ)
    vllm_flags.check(ns)
    if ns.replicas != 1 or ns.max_replicas is not None or ns.replica_roles is not None:
        if ns.step_log:
            raise ConfigError("--step-log records one engine's steps; it is not available with --replicas or "
                              "--max-replicas yet")
        if ns.timeline_log:
            raise ConfigError("--timeline-log records one engine's requests; it is not available with --replicas or "
                              "--max-replicas yet")
        if ns.request_log:
            raise ConfigError("--request-log records one engine's requests; it is not available with --replicas "
                              "or --max-replicas yet (serve one replica to record a trace)")
        if ns.allow_runtime_lora_updating:
            raise ConfigError("--allow-runtime-lora-updating changes one engine's adapters; it is not available with "
                              "--replicas or --max-replicas yet")
        if ns.reasoning_parser:
            raise ConfigError("--reasoning-parser is not available with --replicas or --max-replicas yet; serve one "
                              "replica to read reasoning outputs")
        if ns.enable_auto_tool_choice or ns.tool_call_parser:
            raise ConfigError("--enable-auto-tool-choice and --tool-call-parser are not available with --replicas or "
                              "--max-replicas yet; serve one replica to read tool calls")
        given = vllm_flags.given_frontend_flags(ns)
        if given:
            raise ConfigError(f"{', '.join(given)}: not available with --replicas or --max-replicas yet; serve one "
                              "replica to use them")
        _log_notes(ns)
        return run_replicas(ns)
    args = engine_args_from(ns)
    task = serving_task(args.model, ns.task, ns.runner)
    if task != "generate":
        return run_pooling_serve(ns, args, task)
    from pagoda.engine.async_engine import AsyncLLMEngine
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.plugins.entrypoints.server import (build_app, default_allowed_hosts, default_max_tokens_option,
                                                   max_request_chars_option)
    from pagoda.plugins.entrypoints.server.lora import LoRAAdminOptions
    from pagoda.plugins.entrypoints.server.reasoning import ReasoningOptions
    from pagoda.plugins.entrypoints.server.tools import ToolCallingOptions

    # a wrong tool-call or request-size option fails before the model loads
    # (whether a parser fits the model is known once it is loaded)
    ToolCallingOptions.resolve(ns.plugin_manager, False if ns.enable_auto_tool_choice is False else None,
                               ns.tool_call_parser)
    ReasoningOptions.resolve(ns.plugin_manager, ns.reasoning_parser)
    max_request_chars_option(ns.max_request_chars)
    if ns.max_lora_adapters < 1:
        raise ConfigError(f"--max-lora-adapters {ns.max_lora_adapters}: give a number of adapters >= 1")
    if ns.allow_runtime_lora_updating and not ns.enable_lora:
        raise ConfigError("--allow-runtime-lora-updating needs --enable-lora: add it, or drop the flag")

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _log_notes(ns)
    if ns.request_log:
        from pagoda.plugins.entrypoints.simulate.request_log import RequestLogWriter

        ns.plugin_manager.register(RequestLogWriter(ns.request_log), "request-log")
    engine = LLMEngine(args.create_engine_config(), ns.plugin_manager)
    if ns.step_log:
        from pagoda.plugins.entrypoints.bench.step_log import StepLog

        engine.observers.append(StepLog(engine, ns.step_log))
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, api_key=ns.api_key, max_request_bytes=ns.max_request_bytes,
                    shutdown_timeout=ns.shutdown_timeout, body_timeout=ns.request_body_timeout,
                    allowed_hosts=default_allowed_hosts(ns.host, ns.api_key, ns.allowed_hosts),
                    default_max_tokens=default_max_tokens_option(ns.default_max_tokens),
                    max_stored_responses=ns.max_stored_responses, stored_response_ttl=ns.stored_response_ttl,
                    enable_auto_tool_choice=ns.enable_auto_tool_choice, tool_call_parser=ns.tool_call_parser,
                    tenant_source=ns.tenant_source, max_request_chars=ns.max_request_chars,
                    strict_request_fields=ns.strict_request_fields, timeline_log=ns.timeline_log,
                    allow_runtime_lora_updating=ns.allow_runtime_lora_updating, reasoning_parser=ns.reasoning_parser,
                    lora_admin=LoRAAdminOptions(
                        tuple(r.strip() for r in ns.lora_allowed_roots.split(",") if r.strip())
                        if ns.lora_allowed_roots else None, ns.max_lora_adapters, ns.admin_api_key),
                    frontend=vllm_flags.frontend_options(ns))
    logger.info("serving %r on %s://%s:%d (%d CPU threads, max_model_len %d)",
                engine.config.model.served_model_name, _scheme(ns), ns.host, ns.port, engine.num_threads,
                engine.config.model.max_model_len)
    _run_uvicorn(app, ns)
    return 0


def _scheme(ns: argparse.Namespace) -> str:
    return "https" if ns.ssl_certfile else "http"


def _log_notes(ns: argparse.Namespace) -> None:
    """A warning for each flag given that means nothing on pagoda (it was asked for, and is not done)."""
    for line in vllm_flags.notes(ns):
        logger.warning("%s", line)


def _run_uvicorn(app, ns: argparse.Namespace) -> None:
    from pagoda.plugins.entrypoints.server import make_uvicorn_server

    # what start-up built (the model's modules, the tokenizers, the imported modules: some 250,000 objects for the
    # default model) moves out of the garbage collector's reach: a full collection over it took 140 ms on a Zen 5,
    # a pause every request in flight would wait for; now a collection visits only what serving made since
    gc.collect()
    gc.freeze()
    # this thread built the engine and runs the event loop from now on; the engine steps in a thread of its own
    from pagoda.host.openmp import release_thread_pool

    if not release_thread_pool():
        logger.info("could not release the start-up thread's OpenMP workers (torch's OpenMP is not libgomp); the "
                    "engine thread's parallel regions may wake their workers through the kernel")
    make_uvicorn_server(app, ns.host, ns.port, ns.shutdown_timeout, ns.request_header_timeout,
                        log_level=ns.uvicorn_log_level, limit_concurrency=ns.limit_concurrency,
                        **vllm_flags.uvicorn_options(ns)).run()


def serving_task(model: str, task: str, runner: str | None) -> str:
    """The task ``pagoda serve`` runs the model for, from ``--task`` and ``--runner``."""
    from pagoda.engine.pooling import resolve_serving_task

    return resolve_serving_task(model, task, runner)


def run_pooling_serve(ns: argparse.Namespace, args, task: str) -> int:
    """``pagoda serve`` of a pooling model: embeddings, scores and reranking."""
    from pagoda.engine.pooling import AsyncPoolingEngine, PoolingEngine
    from pagoda.plugins.entrypoints.server import default_allowed_hosts
    from pagoda.plugins.entrypoints.server.pooling import build_pooling_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _log_notes(ns)
    for line in vllm_flags.pooling_notes(ns):
        logger.warning("%s", line)
    engine = PoolingEngine(args, task, ns.plugin_manager)
    app = build_pooling_app(AsyncPoolingEngine(engine), api_key=ns.api_key, max_request_bytes=ns.max_request_bytes,
                            shutdown_timeout=ns.shutdown_timeout, body_timeout=ns.request_body_timeout,
                            allowed_hosts=default_allowed_hosts(ns.host, ns.api_key, ns.allowed_hosts),
                            frontend=vllm_flags.frontend_options(ns))
    logger.info("serving %r for the %r task on %s://%s:%d (%s pooling, normalized: %s, max_model_len %d)",
                engine.served_model_name, task, _scheme(ns), ns.host, ns.port, engine.pooling.method,
                engine.pooling.normalize, engine.max_model_len)
    _run_uvicorn(app, ns)
    return 0
