"""``pagoda bench WORKLOAD``: the fixed workloads of docs/benchmarks.md, each in its own module."""

from __future__ import annotations

import importlib

# sub-command -> module providing ``add_parser(subparsers)``; imported only when listed
WORKLOADS = {
    "throughput": "pagoda.plugins.entrypoints.bench.throughput",
    "latency": "pagoda.plugins.entrypoints.bench.throughput",
    "prefix": "pagoda.plugins.entrypoints.bench.prefix",
    "kernels": "pagoda.plugins.entrypoints.bench.kernels",
    "serve": "pagoda.plugins.entrypoints.bench.serve",
    "all-reduce": "pagoda.plugins.entrypoints.bench.all_reduce",
    "fairness": "pagoda.plugins.entrypoints.bench.fairness",
    "soak": "pagoda.plugins.entrypoints.bench.soak",
    "steps": "pagoda.plugins.entrypoints.bench.step_log",
    "timeline": "pagoda.plugins.entrypoints.bench.timeline",
}


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark a fixed workload (see docs/benchmarks.md)")
    workloads = p.add_subparsers(dest="workload", metavar="WORKLOAD")
    for name, module_name in WORKLOADS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.add_parser(workloads, name)
    p.set_defaults(func=lambda ns: p.print_help() or 2)
