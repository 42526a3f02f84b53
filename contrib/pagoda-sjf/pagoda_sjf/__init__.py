"""pagoda-sjf: a shortest-job-first scheduling policy, as a third-party pagoda plugin.

Select it with ``LLM(scheduling_policy="sjf")`` or ``pagoda serve --scheduling-policy sjf``.
"""

import pagoda

# the pagoda plugin API versions this package is written for
PAGODA_PLUGIN_API = ">=0.10,<0.11"


@pagoda.hookimpl
def pagoda_schedulers():
    from pagoda_sjf.scheduler import ShortestJobFirstScheduler

    return {"sjf": ShortestJobFirstScheduler}
