"""``pagoda serve --replicas N``: start the replica set on Ray Serve and serve until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from typing import Any, Optional

from pagoda.cli import engine_args_from
from pagoda.errors import ConfigError
from pagoda.execution.routing import make_router
from pagoda.plugins.entrypoints.replicas.deployments import ROLES, ReplicaSetOptions

logger = logging.getLogger("pagoda")


def add_replica_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas (Ray Serve; pip install 'pagoda[ray]')")
    g.add_argument("--replicas", type=int, default=1,
                   help="engine replicas behind this endpoint; more than 1 runs them on Ray Serve")
    g.add_argument("--router", default="prefix-aware",
                   help="which replica serves a request (a pagoda_routers component: prefix-aware, power-of-two, "
                        "least-loaded)")
    g.add_argument("--router-options", type=_json_object, default=None,
                   help='JSON options of the router, e.g. \'{"imbalance_threshold": 4}\'')
    g.add_argument("--max-replicas", type=int, default=None,
                   help="autoscale between --min-replicas and this many replicas on queue depth (waiting plus "
                        "running requests per replica, target --target-requests-per-replica)")
    g.add_argument("--min-replicas", type=int, default=1)
    g.add_argument("--target-requests-per-replica", type=float, default=16.0)
    g.add_argument("--replica-roles", type=_roles, default=None, metavar="ROLE,ROLE,...",
                   help="disaggregated prefill and decode: one role per replica, prefill or decode (e.g. "
                        "prefill,decode); each request's prompt is computed on a prefill replica, which saves its "
                        "blocks through --kv-connector, and its answer generated on a decode replica, which loads "
                        "them (docs/kv_connectors.md)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. ray://head:10001 or auto); default: start one on this machine")


def _json_object(text: str) -> dict:
    import json

    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _roles(text: str) -> tuple[str, ...]:
    roles = tuple(r.strip() for r in text.split(","))
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown replica roles {unknown}: each is prefill or decode, e.g. "
                                         "prefill,decode")
    return roles


def check_roles(ns: argparse.Namespace) -> None:
    """--replica-roles against the other flags: one role per replica, both roles, a connector to share KV."""
    roles = ns.replica_roles
    if len(roles) != ns.replicas:
        raise ConfigError(f"--replica-roles names {len(roles)} roles for --replicas {ns.replicas}: give one role "
                          "per replica")
    if "prefill" not in roles or "decode" not in roles:
        raise ConfigError(f"--replica-roles {','.join(roles)}: name at least one prefill and one decode replica")
    if ns.max_replicas is not None:
        raise ConfigError("--replica-roles fixes each replica's role; it does not autoscale yet: drop "
                          "--max-replicas")
    if getattr(ns, "kv_connector", None) is None:
        raise ConfigError("--replica-roles hands each prompt's KV blocks from a prefill to a decode replica through "
                          "a KV connector: add --kv-connector shared-disk --kv-connector-options "
                          "'{\"path\": DIR}' (or tcp with a pagoda kv-server)")
    if getattr(ns, "kv_role", None) not in (None, "both"):
        raise ConfigError("--replica-roles sets each replica's --kv-role; drop --kv-role")


def replica_options(ns: argparse.Namespace, cpus: int) -> ReplicaSetOptions:
    """The replica set's options from the flags, checked before anything starts."""
    from pagoda.plugins.entrypoints.server import (default_allowed_hosts, default_max_tokens_option,
                                                   max_request_chars_option)

    if ns.replicas < 1:
        raise ConfigError(f"--replicas {ns.replicas}: pass 1 or more")
    if ns.max_replicas is not None and not 1 <= ns.min_replicas <= ns.replicas <= ns.max_replicas:
        raise ConfigError(f"autoscaling needs 1 <= --min-replicas ({ns.min_replicas}) <= --replicas ({ns.replicas}) "
                          f"<= --max-replicas ({ns.max_replicas})")
    if ns.target_requests_per_replica <= 0:
        raise ConfigError("--target-requests-per-replica must be > 0")
    roles = getattr(ns, "replica_roles", None)
    if roles is not None:
        check_roles(ns)
    try:
        make_router(ns.router, ns.router_options, ns.plugin_manager)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return ReplicaSetOptions(num_replicas=ns.replicas, router=ns.router, router_options=ns.router_options,
                             cpus_per_replica=max(1, cpus // (ns.max_replicas or ns.replicas)),
                             max_replicas=ns.max_replicas, min_replicas=ns.min_replicas,
                             target_requests_per_replica=ns.target_requests_per_replica, api_key=ns.api_key,
                             allowed_hosts=default_allowed_hosts(ns.host, ns.api_key, ns.allowed_hosts),
                             max_request_bytes=ns.max_request_bytes,
                             default_max_tokens=default_max_tokens_option(ns.default_max_tokens),
                             max_request_chars=max_request_chars_option(ns.max_request_chars),
                             tenant_source=getattr(ns, "tenant_source", "api-key"), roles=roles)


# Ray Serve marks its HTTP proxy unhealthy after three readiness checks of 5 s each and kills it; on a small,
# busy host that is also starting the replicas the proxy can take longer than that to import, and ``serve.start``
# then failed with the proxy "killed by ray.kill". Checks of 30 s each (still polled: a proxy that is up is used
# at once) ride on Serve's controller, which runs them, so they hold on a joined cluster too.
_PATIENT_PROXY_CHECKS = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}


def controller_env() -> dict[str, str]:
    """What the Serve controller ``pagoda serve --replicas`` starts needs in its environment: patient proxy
    checks, where the operator's own values of these variables win."""
    return {name: os.environ.get(name, value) for name, value in _PATIENT_PROXY_CHECKS.items()}


def running_serve_address() -> Optional[tuple[str, int]]:
    """(host, port) of the HTTP proxy of the Ray Serve already running on the connected cluster, or None."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return None if client is None else (client.http_config.host, client.http_config.port)


def check_serve_address(running: Optional[tuple[str, int]], host: str, port: int) -> None:
    """A Serve already running on the cluster listens where it does: the flags must name that address."""
    if running is not None and running != (host, port):
        raise ConfigError(f"Ray Serve already runs on this cluster, its HTTP proxy on {running[0]}:{running[1]}; "
                          f"pass --host {running[0]} --port {running[1]} to serve the replicas there")


def run_replicas(ns: argparse.Namespace) -> int:
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ConfigError("--replicas needs Ray Serve: pip install 'pagoda[ray]'") from None
    from pagoda.plugins.entrypoints.replicas.deployments import build_application

    cpus = os.cpu_count() or 1
    options = replica_options(ns, cpus)
    overrides: dict[str, Any] = {}
    if getattr(ns, "cpu_threads", None) is None:
        overrides["cpu_threads"] = int(options.cpus_per_replica)
    engine_args = engine_args_from(ns, **overrides)
    engine_args.create_engine_config()  # a bad engine flag fails here, before any replica starts
    if not ns.ray_address:  # the cluster started here, and so its Serve controller, inherits them
        os.environ.update(controller_env())
    ray.init(address=ns.ray_address, num_cpus=None if ns.ray_address else cpus, include_dashboard=False)
    running = running_serve_address()
    try:
        check_serve_address(running, ns.host, ns.port)
    except ConfigError:
        ray.shutdown()
        raise
    try:
        # a joined cluster's own environment is not ours: the controller gets the checks as its runtime env
        serve.start(http_options={"host": ns.host, "port": ns.port},
                    controller_options={"runtime_env": {"env_vars": controller_env()}} if ns.ray_address else None)
        serve.run(build_application(engine_args, options), name="pagoda", route_prefix="/")
        logger.info("serving on http://%s:%d with %d replicas (router %s%s)", ns.host, ns.port, ns.replicas,
                    ns.router, f", roles {','.join(options.roles)}" if options.roles else "")
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        if running is None:
            serve.shutdown()
        else:  # Serve was there before: it keeps running, with its other applications
            serve.delete("pagoda")
        ray.shutdown()
    return 0
