"""pagoda-prefix-aware: a cache-aware scheduling policy, as a third-party pagoda plugin.

Select it with ``LLM(scheduling_policy="prefix-aware")`` or ``pagoda serve --scheduling-policy prefix-aware``.
"""

import pagoda

# the pagoda plugin API versions this package is written for (scheduling policies on pagoda.scheduling's hooks)
PAGODA_PLUGIN_API = ">=0.10,<0.11"


@pagoda.hookimpl
def pagoda_schedulers():
    from pagoda_prefix_aware.scheduler import PrefixAwareScheduler

    return {"prefix-aware": PrefixAwareScheduler}
