"""Scaling the engine replicas on queue depth.

Each replica reports the requests its scheduler has waiting and running
(``EngineReplica.record_autoscaling_stats``); the policy asks for as many replicas as the total
needs at ``target_requests_per_replica`` each. Serve applies the bounds and the up/down delays.
"""

from __future__ import annotations

import math
from typing import Any


def queue_depth_policy(ctx: Any) -> tuple[float, dict]:
    """A Serve autoscaling policy: replicas for the waiting plus running requests the replicas report.

    ``ctx`` is Serve's ``AutoscalingContext``; until replicas report, the current count stands.
    """
    metrics = ctx.aggregated_metrics or {}
    waiting = metrics.get("num_requests_waiting") or {}
    running = metrics.get("num_requests_running") or {}
    if not waiting and not running:
        return ctx.current_num_replicas, {}
    demand = sum(waiting.values()) + sum(running.values())
    target = ctx.config.get_target_ongoing_requests()
    return max(1, math.ceil(demand / target)), {}


def autoscaling_config(options: Any) -> dict[str, Any]:
    """Serve's ``autoscaling_config`` for ``options`` (a ``ReplicaSetOptions``)."""
    return {"min_replicas": options.min_replicas, "initial_replicas": options.num_replicas,
            "max_replicas": options.max_replicas, "target_ongoing_requests": options.target_requests_per_replica,
            "look_back_period_s": 30.0, "upscale_delay_s": 5.0,
            "downscale_delay_s": 60.0,
            "policy": {"policy_function": "pagoda.plugins.entrypoints.replicas.autoscaling:queue_depth_policy"}}
