"""Built-in scheduling policies, registered through ``pagoda_schedulers``: each is a
:class:`pagoda.scheduling.SchedulingPolicy` answering the hooks of pagoda's one scheduler."""

from pagoda import hookimpl


@hookimpl
def pagoda_schedulers():
    from pagoda.plugins.schedulers.fair import FairPolicy
    from pagoda.plugins.schedulers.fcfs import FCFSPolicy
    from pagoda.plugins.schedulers.priority import PriorityPolicy

    return {"fcfs": FCFSPolicy, "priority": PriorityPolicy, "fair": FairPolicy}
