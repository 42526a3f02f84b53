"""pagoda-sjf meets the scheduler contract: pagoda's conformance kit drives it through randomised request
streams (preemption, swap, prefix hits, aborts) with a model-free runner."""

from pagoda.testing import check_scheduler
from pagoda_sjf.scheduler import ShortestJobFirstScheduler


def test_shortest_job_first_meets_the_scheduler_contract():
    check_scheduler(ShortestJobFirstScheduler)
