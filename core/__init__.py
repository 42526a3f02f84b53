"""pagoda: an LLM inference and serving engine whose every policy and backend is a plugin."""

from pagoda.markers import hookimpl
from pagoda.version import __version__
from pagoda.config import EngineArgs
from pagoda.errors import BackendUnavailable, CheckpointError, ConfigError, InvalidRequestError, PagodaError
from pagoda.sampling_params import SamplingParams
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.engine import LLMEngine
from pagoda.llm import LLM

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "SamplingParams",
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
]
