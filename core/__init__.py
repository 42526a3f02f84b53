"""pagoda: an LLM inference and serving engine whose every policy and backend is a plugin.

Importing pagoda loads no torch and changes nothing in the process (no import finder, thread, environment
variable or setting): the engine classes below are imported on first use, and host settings (threads,
allocator, huge pages, kernels) are applied when an engine is built. To choose how OpenMP threads wait, call
``pagoda.host.settings.set_openmp_wait_policy()`` before importing torch (the ``pagoda`` command does).
"""

import importlib
from typing import Any

import pluggy

from pagoda.errors import BackendUnavailable, CheckpointError, ConfigError, InvalidRequestError, PagodaError

__version__ = "0.1.0"

# The version of the plugin contract (the hooks in pagoda.hookspecs, the protocols in pagoda.interfaces, the
# public methods of the base classes plugins subclass). Unstable before 1.0: any 0.x minor version may rename,
# change or remove a name, with no compatibility shim (docs/plugin-api-changelog.md lists every change). A plugin
# declares the range it was tested with in its module attribute PAGODA_PLUGIN_API (for example ">=0.10,<0.11");
# one whose range excludes this version is refused at load.
PLUGIN_API_VERSION = "0.10"

# the marker plugins (and pagoda's own built-in components) implement pagoda's hooks with: @pagoda.hookimpl
hookimpl = pluggy.HookimplMarker("pagoda")

# public name -> the module defining it, imported when the name is first used
_LAZY = {
    "LLM": "pagoda.engine.llm",
    "LLMEngine": "pagoda.engine.llm_engine",
    "EngineArgs": "pagoda.engine.engine_args",
    "SamplingParams": "pagoda.sampling_params",
    "LoRARequest": "pagoda.execution.lora_request",
    "StructuredOutputsParams": "pagoda.sampling_params",
    "RequestOutput": "pagoda.outputs",
    "CompletionOutput": "pagoda.outputs",
    "Logprob": "pagoda.outputs",
    "BeamSearchParams": "pagoda.sampling_params",
    "BeamSearchOutput": "pagoda.outputs",
    "BeamSearchSequence": "pagoda.outputs",
    "PoolingRequestOutput": "pagoda.outputs",
    "EmbeddingRequestOutput": "pagoda.outputs",
    "ScoringRequestOutput": "pagoda.outputs",
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
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "PoolingRequestOutput",
    "EmbeddingRequestOutput",
    "ScoringRequestOutput",
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
