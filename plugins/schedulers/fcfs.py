"""First come, first served: arrival order; the newest running request is preempted first."""

from pagoda.plugins.schedulers.base import TokenBudgetScheduler


class FCFSScheduler(TokenBudgetScheduler):
    """The base scheduler's defaults are already first come, first served."""
