"""Hook specifications: the contracts every pagoda plugin implements.

Component hooks return a mapping ``{public_name: factory}``. The engine asks
each hook once at start-up, merges the mappings of every registered plugin and
picks the component named in its config. Nothing on the per-token path goes
through pluggy. Observation hooks are called as events happen and return
nothing.

Factories receive the engine's frozen configs (see :mod:`pagoda.config`); their
signatures (``SchedulerFactory`` and the like) and the interfaces they must
return are typed in :mod:`pagoda.interfaces`.

A component hook may take the argument ``plugin_manager`` (pluggy passes a
hook only the arguments it names): the
:class:`~pagoda.registry.plugin_manager.PluginManager` collecting the
components. A factory that wraps or decorates another component gets that
component's factory with ``plugin_manager.factory(hook_name, name)``, called
inside the factory, when the engine builds its components.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import pluggy

if TYPE_CHECKING:
    from pagoda.interfaces import (AllReduceFactory, AttentionBackendFactory, CLICommand, ExecutorFactory,
                                   KVAllocatorFactory, KVConnectorFactory, LoRABackendFactory, ModelArchitectureFactory,
                                   ModelLoaderFactory, ProposerFactory, QuantMethodFactory, ReasoningParserFactory,
                                   RouterFactory, SamplerFactory, SchedulerFactory, StructuredOutputBackendFactory,
                                   ToolParserFactory)
    from pagoda.registry.plugin_manager import PluginManager
    from pagoda.sequence import Sequence

hookspec = pluggy.HookspecMarker("pagoda")


# --------------------------------------------------------------------------
# Model loading
# --------------------------------------------------------------------------


@hookspec
def pagoda_model_loaders(plugin_manager: "PluginManager") -> Mapping[str, "ModelLoaderFactory"]:
    """Return ``{name: factory}`` of weight loaders.

    ``factory(model_config)`` returns a :class:`pagoda.interfaces.ModelLoader`
    whose ``load_weights(model)`` fills an already built model. Selected by
    ``load_format`` (built-ins: ``safetensors``, ``dummy``). Called once at
    engine start-up.
    """


@hookspec
def pagoda_model_architectures(plugin_manager: "PluginManager") -> Mapping[str, "ModelArchitectureFactory"]:
    """Return ``{architecture_name: model_class}``.

    The name is matched against ``architectures`` in the checkpoint's
    ``config.json`` (for example ``LlamaForCausalLM``). The class is built as
    ``model_class(model_config, attention_backend, quant_method)`` and must
    implement :class:`pagoda.interfaces.CausalLM`. Called once at start-up.
    """


# --------------------------------------------------------------------------
# KV cache allocation
# --------------------------------------------------------------------------


@hookspec
def pagoda_kv_allocators(plugin_manager: "PluginManager") -> Mapping[str, "KVAllocatorFactory"]:
    """Return ``{name: factory}`` of KV block allocators.

    ``factory(cache_config, num_blocks)`` returns a
    :class:`pagoda.interfaces.KVCacheManager` that owns block ids, ref counts
    and the prefix cache (never tensors). Selected by ``kv_allocator``
    (built-in: ``paged``). Called once at start-up.
    """


@hookspec
def pagoda_kv_connectors(plugin_manager: "PluginManager") -> Mapping[str, "KVConnectorFactory"]:
    """Return ``{name: factory}`` of KV connectors: stores outside the engine that keep full prompt blocks'
    K/V, so another engine (a decode instance, a replica, the same one restarted) loads them instead of
    recomputing them.

    ``factory(engine_config, **options)`` returns a :class:`pagoda.interfaces.KVConnector`, a store of
    opaque byte strings by key; ``options`` come from ``kv_connector_options`` (``--kv-connector-options``
    JSON). pagoda frames, checksums and verifies every block itself and calls ``load`` and ``save`` on its
    own threads. Selected by ``kv_connector`` / ``--kv-connector`` (built-ins: ``shared-disk``, ``tcp``;
    none by default). Called once at start-up.
    """


# --------------------------------------------------------------------------
# Scheduling
# --------------------------------------------------------------------------


@hookspec
def pagoda_schedulers(plugin_manager: "PluginManager") -> Mapping[str, "SchedulerFactory"]:
    """Return ``{name: factory}`` of scheduling policies.

    ``factory(scheduler, **options)`` returns a
    :class:`pagoda.scheduling.SchedulingPolicy`, whose hooks pagoda's one
    scheduler (``scheduler``) calls; ``options`` come from ``scheduler_options``
    (``--scheduler-options`` JSON). Selected by ``scheduling_policy``
    (built-ins: ``fcfs``, ``priority``, ``fair``). Called once at start-up.
    """


# --------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------


@hookspec
def pagoda_attention_backends(plugin_manager: "PluginManager") -> Mapping[str, "AttentionBackendFactory"]:
    """Return ``{name: factory}`` of attention backends.

    ``factory(model_config, cache_config)`` returns a
    :class:`pagoda.interfaces.AttentionBackend`, or raises
    :class:`pagoda.errors.BackendUnavailable` when it cannot run on this
    machine (``auto`` then tries the next one). Selected by
    ``attention_backend`` (built-ins: ``torch``, ``cpu``, ``triton``, ``cuda``). ``auto`` tries the
    backends that declare a rank for the device in a class attribute ``auto_priority``
    (``{"cpu": 20, "cuda": 0}``: higher first), so a plugin's backend can outrank the built-ins.
    Called once at start-up.
    """


# --------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------


@hookspec
def pagoda_samplers(plugin_manager: "PluginManager") -> Mapping[str, "SamplerFactory"]:
    """Return ``{name: factory}`` of samplers.

    ``factory(model_config)`` returns a :class:`pagoda.interfaces.Sampler`
    that turns a step's logits into token ids (and logprobs). Selected by
    ``sampler`` (built-in: ``default``). Called once at start-up.
    """


@hookspec
def pagoda_structured_output_backends(
        plugin_manager: "PluginManager") -> Mapping[str, "StructuredOutputBackendFactory"]:
    """Return ``{name: factory}`` of structured-output backends (added in plugin API 1.5).

    ``factory(model_config, tokenizer, eos_token_ids)`` returns a
    :class:`pagoda.interfaces.StructuredOutputBackend`: it compiles a request's
    :class:`pagoda.sampling_params.StructuredOutputsParams` (JSON schema, any JSON object, regex,
    choice, grammar) for the model's tokenizer and gives each sequence a matcher that fills the
    token bitmask the sampler applies. Raises :class:`pagoda.errors.BackendUnavailable` when its
    library is missing. Selected by ``structured_outputs_backend`` or a request's
    ``structured_outputs.backend`` (built-ins: ``xgrammar``, ``guidance``; ``auto`` picks, per
    request, the first built-in whose ``supports`` accepts it). Called once at start-up; a backend
    is built when the first request that uses it arrives.
    """


# --------------------------------------------------------------------------
# LoRA adapters
# --------------------------------------------------------------------------


@hookspec
def pagoda_lora_backends(plugin_manager: "PluginManager") -> Mapping[str, "LoRABackendFactory"]:
    """Return ``{name: factory}`` of LoRA backends (added in plugin API 1.6).

    ``factory(lora_config, model_config)`` returns a :class:`pagoda.interfaces.LoRABackend`: every linear layer
    an adapter may target calls its ``apply`` once per forward pass to add the LoRA terms of all the adapters
    of the step, segmented by a per-token slot index. Selected by ``lora_backend`` / ``--lora-backend``
    (built-in: ``torch``). Called once at start-up, when LoRA is enabled.
    """


# --------------------------------------------------------------------------
# Quantization
# --------------------------------------------------------------------------


@hookspec
def pagoda_quant_methods(plugin_manager: "PluginManager") -> Mapping[str, "QuantMethodFactory"]:
    """Return ``{name: factory}`` of weight quantization methods.

    ``factory(model_config, quant_config_dict)`` returns a
    :class:`pagoda.interfaces.QuantMethod` consulted whenever a linear layer
    is built, before weights load. Selected by ``quantization`` or by the
    checkpoint's ``quantization_config.quant_method``. Called once at
    start-up.
    """


# --------------------------------------------------------------------------
# Speculative decoding
# --------------------------------------------------------------------------


@hookspec
def pagoda_proposers(plugin_manager: "PluginManager") -> Mapping[str, "ProposerFactory"]:
    """Return ``{name: factory}`` of speculative-decoding proposers.

    ``factory(speculative_config, engine_config, model_runner, plugin_manager)``
    returns a :class:`pagoda.interfaces.Proposer` that proposes up to
    ``num_speculative_tokens`` draft tokens per decoding request each step
    (the runner gives a draft model the target's model, KV caches and
    attention backend; the plugin manager resolves a draft checkpoint's
    architecture and loader). Selected by ``speculative_config["method"]``
    (built-ins: ``draft_model``, ``ngram``). Called once at start-up.
    """


# --------------------------------------------------------------------------
# Executors
# --------------------------------------------------------------------------


@hookspec
def pagoda_executors(plugin_manager: "PluginManager") -> Mapping[str, "ExecutorFactory"]:
    """Return ``{name: factory}`` of executors: the processes a model runs in.

    ``factory(engine_config, plugin_manager)`` returns a
    :class:`pagoda.interfaces.Executor`: it starts the ranks, has each build its
    shard of the model (:func:`pagoda.execution.build.build_runner` under
    :mod:`pagoda.execution.distributed`), and runs every step on all of them. Selected by
    ``distributed_executor_backend`` (built-ins: ``uni``, ``mp``; ``auto`` is
    ``uni`` for one rank, ``mp`` for more). Called once at start-up.
    """


@hookspec
def pagoda_all_reduce_backends(plugin_manager: "PluginManager") -> Mapping[str, "AllReduceFactory"]:
    """Return ``{name: factory}`` of all-reduce backends: how tensor-parallel ranks sum their parts.

    ``factory(engine_config, rank, size, group, timeout_seconds)`` returns a
    :class:`pagoda.interfaces.AllReduce` for this rank; ``group`` is the ranks'
    torch.distributed group, already joined. Selected by ``all_reduce_backend``
    (built-ins: ``gloo``, ``shm``; ``auto`` is ``shm`` for ranks on this host
    with the model on CPU, else ``gloo``). Called once at start-up, on every
    rank of a model with more than one.
    """


# --------------------------------------------------------------------------
# Routers
# --------------------------------------------------------------------------


@hookspec
def pagoda_routers(plugin_manager: "PluginManager") -> Mapping[str, "RouterFactory"]:
    """Return ``{name: factory}`` of request routers: which engine replica serves a request.

    ``factory(**options)`` returns a :class:`pagoda.interfaces.Router`. Selected by
    ``pagoda serve --replicas N --router NAME`` (options from ``--router-options``; built-ins:
    ``prefix-aware``, ``power-of-two``, ``least-loaded``). Called once when a replica set starts,
    in the process that routes.
    """


# --------------------------------------------------------------------------
# Tool calls
# --------------------------------------------------------------------------


@hookspec
def pagoda_tool_parsers(plugin_manager: "PluginManager") -> Mapping[str, "ToolParserFactory"]:
    """Return ``{name: factory}`` of tool-call parsers: how a model writes the function calls it makes.

    ``factory(tools)`` returns a :class:`pagoda.interfaces.ToolParser` for one answer of a chat request
    whose ``tools`` (OpenAI's function tools, as the request gave them) it may check names against; it
    splits the answer's text, whole or as it streams, into content and
    :class:`pagoda.tool_calls.ToolCall` s. Selected by ``pagoda serve --tool-call-parser NAME`` (built-ins:
    ``hermes``, ``llama3_json``). The server resolves the factory once when it starts and calls it for each
    answer of a request with tools and ``tool_choice`` ``auto``.
    """


@hookspec
def pagoda_reasoning_parsers(plugin_manager: "PluginManager") -> Mapping[str, "ReasoningParserFactory"]:
    """Return ``{name: factory}`` of reasoning parsers: how a reasoning model sets its thinking apart from its
    answer.

    ``factory(prompt)`` returns a :class:`pagoda.interfaces.ReasoningParser` for one answer of a chat request
    (``prompt``: the rendered prompt's text); it splits the answer, whole or as it streams, into
    :class:`pagoda.reasoning.ReasoningDelta` s. Selected by ``pagoda serve --reasoning-parser NAME``
    (built-ins: ``deepseek_r1``, ``qwen3``, ``openai_gptoss``) or by the model's family. The server resolves
    the factory once when it starts.
    """


# --------------------------------------------------------------------------
# Entrypoints
# --------------------------------------------------------------------------


@hookspec
def pagoda_cli_commands(plugin_manager: "PluginManager") -> Mapping[str, "CLICommand"]:
    """Return ``{command_name: register}`` for the ``pagoda`` command line.

    ``register(subparsers)`` adds an ``argparse`` sub-parser for the command
    and sets its ``func`` default to a callable taking the parsed
    ``argparse.Namespace`` and returning an exit code. Called once when the
    ``pagoda`` command starts.
    """


@hookspec
def pagoda_add_routes(app: Any, engine: Any) -> None:
    """Add HTTP routes to the server's ``app`` (a FastAPI application).

    ``engine`` is the running async engine. Called once when the server
    starts, for every plugin; returns nothing.
    """


# --------------------------------------------------------------------------
# Observation
# --------------------------------------------------------------------------


@hookspec
def pagoda_request_finished(request: "Sequence") -> None:
    """Called once for each request as it finishes (stopped, length or
    aborted), after its KV blocks are freed. Observers only: must not block.
    """
