"""``fcfs``: first come, first served."""

from pagoda.scheduling import SchedulingPolicy


class FCFSPolicy(SchedulingPolicy):
    """The hooks' defaults already are first come, first served: arrival order, the newest running request
    preempted first, and no arrival ever preempts running work."""
