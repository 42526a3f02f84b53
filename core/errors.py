"""Errors pagoda raises at its edges. Each message says what was wrong and how to fix it."""


class PagodaError(Exception):
    """Base class of pagoda's own errors."""


class ConfigError(PagodaError, ValueError):
    """An engine option, plugin name or model directory is not usable."""


class InvalidRequestError(PagodaError, ValueError):
    """A request's prompt or sampling parameters are not acceptable."""


class BackendUnavailable(PagodaError, RuntimeError):
    """A component cannot run on this machine (for example a CUDA kernel without a GPU)."""


class CheckpointError(PagodaError, ValueError):
    """A checkpoint is missing, corrupt, or does not match the model it is loaded into."""
