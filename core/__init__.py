"""pagoda: an LLM inference and serving engine whose every policy and backend is a plugin."""

# OpenMP's wait policy must be set before torch loads its OpenMP runtime (see pagoda.openmp);
# set OMP_WAIT_POLICY yourself if you import torch first.
from pagoda.openmp import choose_wait_policy

choose_wait_policy()

from pagoda.malloc import keep_freed_memory

keep_freed_memory()

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
