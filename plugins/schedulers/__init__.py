"""Built-in scheduling policies, registered through ``pagoda_schedulers``."""

from pagoda.markers import hookimpl


@hookimpl
def pagoda_schedulers():
    from pagoda.plugins.schedulers.base import FCFSScheduler
    from pagoda.plugins.schedulers.fair import FairScheduler
    from pagoda.plugins.schedulers.priority import PriorityScheduler

    return {"fcfs": FCFSScheduler, "priority": PriorityScheduler, "fair": FairScheduler}
