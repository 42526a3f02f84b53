"""pagoda-sjf meets the scheduler contract: pagoda's conformance kit drives it through randomised request
streams (preemption, swap, prefix hits, aborts) with a model-free runner.

``pagoda_conformance`` comes from pagoda's pytest plugin, active wherever pagoda is installed; run with
``--pagoda-seeds 20`` for a longer search."""

from pagoda_sjf.scheduler import ShortestJobFirstScheduler


def test_shortest_job_first_meets_the_scheduler_contract(pagoda_conformance):
    pagoda_conformance.check_scheduler(ShortestJobFirstScheduler)
