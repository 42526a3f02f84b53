"""pagoda: an LLM inference and serving engine whose every policy and backend is a plugin.

Importing pagoda loads no torch and changes nothing in the process (no import finder, thread, environment
variable or setting): the engine classes below are imported on first use, and host settings (threads,
allocator, huge pages, kernels) are applied when an engine is built. To choose how OpenMP threads wait, call
``pagoda.host.settings.set_openmp_wait_policy()`` before importing torch (the ``pagoda`` command does).
"""

import importlib
from typing import Any

from pagoda.errors import BackendUnavailable, CheckpointError, ConfigError, InvalidRequestError, PagodaError
from pagoda.markers import hookimpl
from pagoda.version import PLUGIN_API_VERSION, __version__

# public name -> the module defining it, imported when the name is first used
_LAZY = {
    "LLM": "pagoda.engine.llm",
    "LLMEngine": "pagoda.engine.llm_engine",
    "EngineArgs": "pagoda.engine.engine_args",
    "SamplingParams": "pagoda.sampling_params",
    "LoRARequest": "pagoda.lora_request",
    "StructuredOutputsParams": "pagoda.sampling_params",
    "RequestOutput": "pagoda.outputs",
    "CompletionOutput": "pagoda.outputs",
    "Logprob": "pagoda.outputs",
}

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "SamplingParams",
    "LoRARequest",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "hookimpl",
    "PagodaError",
    "ConfigError",
    "InvalidRequestError",
    "CheckpointError",
    "BackendUnavailable",
    "__version__",
    "PLUGIN_API_VERSION",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
