"""Errors pagoda raises at its edges. Each message says what was wrong and how to fix it."""

from typing import Optional


class PagodaError(Exception):
    """Base class of pagoda's own errors."""


class ConfigError(PagodaError, ValueError):
    """An engine option, plugin name or model directory is not usable."""


class InvalidRequestError(PagodaError, ValueError):
    """A request's prompt or sampling parameters are not acceptable. ``param`` names the request field at
    fault (``"prompt"``, ``"max_tokens"``, ...) when there is one; the OpenAI server answers with it."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


class BackendUnavailable(PagodaError, RuntimeError):
    """A component cannot run on this machine (for example a CUDA kernel without a GPU)."""


class CheckpointError(PagodaError, ValueError):
    """A checkpoint is missing, corrupt, or does not match the model it is loaded into."""


class StepFailedError(PagodaError, RuntimeError):
    """A step's execution failed for every request in it, even run alone: the fault is not one request's.

    The step was rolled back: no request's progress moved (their KV is recomputed), so stepping
    again goes on from where they were. ``request_ids`` are the user request ids of the step's
    sequences, the ones the fault touched.
    """

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class SchedulingPolicyError(PagodaError, RuntimeError):
    """A scheduling policy broke a rule of the scheduler that calls it (it preempted a request in a step still
    in flight, returned a victim or an order the scheduler cannot use). The message names the policy, the hook
    and the rule."""
