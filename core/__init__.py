"""pagoda: an LLM inference and serving engine whose every policy and backend is a plugin."""

import os

# OpenMP threads that spin while waiting for each other stall badly on a shared CPU (measured: a
# 2-thread bf16 matmul ran 95x slower spinning than sleeping while other processes were busy).
# Must be set before torch loads its OpenMP runtime; set it yourself if you import torch first.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
