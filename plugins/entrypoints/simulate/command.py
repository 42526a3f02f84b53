"""``pagoda simulate``: replay a request trace through scheduler and KV allocator plugins with a cost
model instead of a model, and report what ``pagoda bench serve`` reports (see docs/simulator.md)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

from pagoda.cli import add_engine_args, engine_args_from
from pagoda.errors import ConfigError
from pagoda.plugins.entrypoints.simulate.disaggregated import DEFAULT_BLOCK_LOAD_MS, DEFAULT_HANDOFF_MS

# the defaults of a hand-off between pipeline stages: gloo send/recv between two processes of one machine,
# measured on a 2-core EPYC (docs/distributed.md): about 170 us for a decode step's few KiB, 3 ms for 2.3 MiB
PIPELINE_LATENCY_US = 170.0
PIPELINE_GBPS = 6.0


def register(sub) -> None:
    p = sub.add_parser("simulate", help="replay a request trace through the scheduler and KV allocator with a "
                                        "calibrated cost model instead of the model",
                       description="Replay a request trace (JSON lines) through the configured scheduling policy "
                                   "and KV allocator, timing each step with a cost model calibrated on this "
                                   "machine (--calibrate), and print the serving report. See docs/simulator.md.")
    src = p.add_argument_group("trace (exactly one)")
    src.add_argument("--trace", default=None, help="a JSON-lines trace file")
    src.add_argument("--workload", default=None, choices=["W1", "W2", "W4", "FLOOD"],
                     help="a workload of docs/benchmarks.md (W4: W1 at --rate), or FLOOD: tenant 'flood' sends "
                          "13 x n=8 requests of --output-len tokens (default 1000) at once while tenant 'small' "
                          "sends --num-requests (default 20) of 5 + 16 tokens at --rate (default 1/s); compare "
                          "--scheduling-policy fair --compare-policy fcfs (what `pagoda bench fairness` measures)")
    src.add_argument("--generate", action="store_true", help="a synthetic trace: Poisson/bursty arrivals, W1 "
                                                             "lengths, optional prefix groups and priorities")
    src.add_argument("--from-request-log", default=None, metavar="LOG",
                     help="the requests a `pagoda serve --request-log LOG` file recorded")
    gen = p.add_argument_group("trace generation")
    gen.add_argument("--num-requests", type=int, default=None, help="requests to generate (default 1000; "
                                                                     "64 for a workload)")
    gen.add_argument("--rate", type=float, default=None, help="arrivals per second (inf: all at once; default: "
                                                              "4 for --generate, inf for W1/W2)")
    gen.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson; above 1: burstier gaps")
    gen.add_argument("--num-groups", type=int, default=0, help="shared-prefix groups (0: no shared prefixes)")
    gen.add_argument("--prefix-len", type=int, default=512, help="tokens each group shares")
    gen.add_argument("--group-fraction", type=float, default=1.0, help="fraction of requests in a group")
    gen.add_argument("--prompt-len", type=int, default=None, help="every request's own prompt tokens "
                                                                   "(default: W1's log-normal draw)")
    gen.add_argument("--output-len", type=int, default=None, help="every request's output tokens (default: W1's "
                                                                   "log-normal draw)")
    gen.add_argument("--priority-levels", type=int, default=1, help="priorities drawn uniformly from 0..N-1")
    gen.add_argument("--trace-seed", type=int, default=0, help="seed of arrivals, lengths and synthetic tokens")
    gen.add_argument("--save-trace", default=None, metavar="PATH", help="write the trace to PATH and stop")
    run = p.add_argument_group("simulation")
    run.add_argument("--cost-model", default=None, metavar="PATH",
                     help="the calibrated cost model (default: one per model, dtype, CPU and thread count under "
                          "~/.cache/pagoda/cost_models)")
    run.add_argument("--calibrate", action="store_true", help="time the real engine over a grid of batch shapes "
                                                              "(about a minute), fit and save the cost model first")
    run.add_argument("--quick-calibration", action="store_true",
                     help="calibrate over a small grid (seconds; rougher, for trying things out)")
    run.add_argument("--rescale", action=argparse.BooleanOptionalAction, default=True,
                     help="build the real engine, time a few fixed steps (seconds, plus the engine's start-up) "
                          "and scale the cost model by their time over its prediction: the machine's "
                          "speed now against during calibration (default; with --compare-real, right before the "
                          "real run); --no-rescale uses the model as calibrated")
    run.add_argument("--compare-policy", nargs="+", default=[], metavar="POLICY",
                     help="also simulate these scheduling policies on the same trace")
    run.add_argument("--compare-real", action="store_true",
                     help="also replay the trace through the real engine on the wall clock and print the "
                          "simulator's error")
    run.add_argument("--replicas", type=int, default=1, help="simulated engines, each request routed by --router")
    run.add_argument("--router", default="least-loaded", help="the request router between replicas (a "
                                                              "pagoda_routers name, as for pagoda serve --replicas)")
    run.add_argument("--router-options", type=json.loads, default=None, metavar="JSON",
                     help='the router\'s options, e.g. \'{"imbalance_threshold": 4}\'')
    run.add_argument("--pipeline-link-latency-us", type=float, default=PIPELINE_LATENCY_US, metavar="US",
                     help="with --pipeline-parallel-size: microseconds one hand-off between stages costs besides its "
                          f"bytes (default {PIPELINE_LATENCY_US:g}: gloo between two processes of this machine, "
                          "measured; a network link between machines costs more)")
    run.add_argument("--pipeline-link-gbps", type=float, default=PIPELINE_GBPS, metavar="GBPS",
                     help="with --pipeline-parallel-size: the link's gigabits per second between stages (default "
                          f"{PIPELINE_GBPS:g}; 10 or 25 for a data-centre Ethernet link)")
    run.add_argument("--lora-load-ms", type=float, default=None, metavar="MS",
                     help="LoRA (a trace with lora_name, and --enable-lora): milliseconds of reading an adapter "
                          "from disk when a step needs one that is not in memory (default: "
                          "the default model's rank-16 figure, see docs/lora.md)")
    run.add_argument("--lora-slot-ms", type=float, default=None, metavar="MS",
                     help="LoRA: milliseconds of copying an adapter into a slot when a step needs one that is not "
                          "in a slot")
    run.add_argument("--lora-step-overhead", type=float, default=0.0, metavar="FRACTION",
                     help="LoRA: the extra fraction of a step's time when it has adapter tokens (the cost model "
                          "is calibrated on the base model; `pagoda bench throughput --lora-adapters N` measures "
                          "it; default 0)")
    pd = p.add_argument_group("prefill and decode apart (docs/simulator.md#prefill-and-decode-apart)")
    pd.add_argument("--prefill-decode", nargs="+", default=[], metavar="P:D",
                    help="also simulate P prefill instances and D decode instances sharing a KV store (as "
                         "`pagoda serve --replica-roles` or `pagoda kv-proxy` run them), e.g. 1:1 1:2 2:1; each "
                         "instance timed by --instance-cost-model")
    pd.add_argument("--instance-cost-model", default=None, metavar="PATH",
                    help="the cost model of one prefill or decode instance (e.g. calibrated with --cpu-threads 1 "
                         "where the engine it is compared with has 2); default: --cost-model's. Scaled by the "
                         "speed probe as --cost-model is")
    pd.add_argument("--kv-handoff-ms", type=float, default=None, metavar="MS",
                    help="milliseconds a request's hand-off from a prefill to a decode instance costs besides its "
                         "blocks (default %g)" % DEFAULT_HANDOFF_MS)
    pd.add_argument("--kv-block-load-ms", type=float, default=None, metavar="MS",
                    help="milliseconds a decode instance takes to load one prompt block from the store (default "
                         "%g)" % DEFAULT_BLOCK_LOAD_MS)
    pd.add_argument("--ttft-slo-ms", type=float, default=None, metavar="MS",
                    help="with --tpot-slo-ms: report every run's goodput, the requests per second that met both "
                         "targets")
    pd.add_argument("--tpot-slo-ms", type=float, default=None, metavar="MS",
                    help="the time-per-output-token target of the goodput")
    run.add_argument("--json", action="store_true", help="print the reports as one JSON object")
    run.add_argument("--result-file", default=None, help="also write the JSON reports to this file")
    add_engine_args(p)
    p.set_defaults(func=run_simulate)


def load_trace_from(ns: argparse.Namespace):
    from pagoda.plugins.entrypoints.simulate.request_log import trace_from_request_log
    from pagoda.plugins.entrypoints.simulate.trace import flood_trace, generate_trace, load_trace
    from pagoda.plugins.entrypoints.simulate.workloads import workload_trace

    given = [flag for flag, value in (("--trace", ns.trace), ("--workload", ns.workload),
                                      ("--generate", ns.generate), ("--from-request-log", ns.from_request_log))
             if value]
    if len(given) != 1:
        raise ConfigError(f"give exactly one trace source ({', '.join(given) or 'none given'}): --trace PATH, "
                          "--workload W1|W2|W4, --generate or --from-request-log LOG")
    if ns.trace:
        return load_trace(ns.trace), f"trace {ns.trace}"
    if ns.from_request_log:
        trace, skipped = trace_from_request_log(ns.from_request_log)
        return trace, f"request log {ns.from_request_log} ({skipped} requests without output skipped)"
    if ns.workload == "FLOOD":
        rate = 1.0 if ns.rate is None else ns.rate
        return (flood_trace(ns.num_requests or 20, rate, flood_output_len=ns.output_len or 1000),
                f"workload FLOOD: 13 x 8 flooding sequences, small requests at {rate:g} req/s")
    if ns.workload:
        rate = math.inf if ns.rate is None else ns.rate
        return (workload_trace(ns.workload, ns.model, rate, ns.num_requests or 64, ns.trace_seed),
                f"workload {ns.workload} at {rate:g} req/s")
    rate = 4.0 if ns.rate is None else ns.rate
    return (generate_trace(ns.num_requests or 1000, rate, ns.burstiness, ns.num_groups, ns.prefix_len,
                           ns.group_fraction, ns.priority_levels, ns.trace_seed, ns.prompt_len, ns.output_len),
            f"generated: {rate:g} req/s, burstiness {ns.burstiness:g}, {ns.num_groups} prefix groups")


def slo_from(ns: argparse.Namespace) -> Optional[tuple[float, float]]:
    """(TTFT, TPOT) targets in seconds, or None when neither is given."""
    given = (ns.ttft_slo_ms, ns.tpot_slo_ms)
    if given == (None, None):
        return None
    if None in given or not all(v > 0 and math.isfinite(v) for v in given):
        raise ConfigError(f"--ttft-slo-ms {ns.ttft_slo_ms} --tpot-slo-ms {ns.tpot_slo_ms}: give both targets, each a "
                          "number of milliseconds > 0")
    return ns.ttft_slo_ms / 1e3, ns.tpot_slo_ms / 1e3


def parse_split(text: str) -> tuple[int, int]:
    from pagoda.plugins.entrypoints.simulate.disaggregated import parse_split as parse

    return parse(text)


def kv_handoff_from(ns: argparse.Namespace):
    from pagoda.plugins.entrypoints.simulate.disaggregated import KVHandoff

    fixed = DEFAULT_HANDOFF_MS if ns.kv_handoff_ms is None else ns.kv_handoff_ms
    block = DEFAULT_BLOCK_LOAD_MS if ns.kv_block_load_ms is None else ns.kv_block_load_ms
    if min(fixed, block) < 0 or not math.isfinite(fixed + block):
        raise ConfigError(f"--kv-handoff-ms {fixed} and --kv-block-load-ms {block} must be finite and >= 0")
    return KVHandoff(fixed / 1e3, block / 1e3)


def run_simulate(ns: argparse.Namespace) -> int:
    from pagoda.plugins.entrypoints.simulate.cost_model import default_cost_model_path
    from pagoda.plugins.entrypoints.simulate.trace import save_trace

    if ns.replicas < 1:
        raise ConfigError(f"--replicas {ns.replicas}: pass at least 1")
    ns.slo = slo_from(ns)
    ns.splits = [parse_split(text) for text in ns.prefill_decode]
    ns.kv_handoff = kv_handoff_from(ns)
    has_source = any((ns.trace, ns.workload, ns.generate, ns.from_request_log))
    trace, source = None, ""
    if has_source or not ns.calibrate:
        trace, source = load_trace_from(ns)
        if ns.rate is None and (ns.trace or ns.from_request_log):
            span = trace[-1].arrival - trace[0].arrival  # the report's "request rate": the trace's mean
            ns.rate = round((len(trace) - 1) / span, 3) if span > 0 else math.inf
        if ns.save_trace:
            print(f"{save_trace(trace, ns.save_trace)} requests written to {ns.save_trace}")
            return 0
        if ns.compare_real and any(r.lora_name is not None for r in trace):
            raise ConfigError("--compare-real cannot replay a trace that names LoRA adapters (the simulator knows "
                              "their names, not their weights); drop --compare-real")
    args = engine_args_from(ns)
    config = args.create_engine_config()
    if config.parallel.pipeline_parallel_size > 1 and ns.calibrate:
        raise ConfigError("--calibrate times the model whole, and the simulation adds the pipeline stages' "
                          "hand-offs to it: calibrate with --pipeline-parallel-size 1, then simulate with it")
    ns.handoff = pipeline_handoff(config, ns)
    if ns.splits and (ns.handoff is not None or config.lora is not None):
        raise ConfigError("--prefill-decode simulates one-rank instances without LoRA (as a KV connector runs); "
                          "drop --pipeline-parallel-size or --enable-lora")
    dtype = str(config.model.dtype).removeprefix("torch.")
    # pipeline stages are simulated from the cost model of the model whole, calibrated with the threads given
    threads = config.parallel.cpu_threads if ns.handoff is None else config.host.cpu_threads
    cost_path = Path(ns.cost_model) if ns.cost_model else default_cost_model_path(config.model.model, dtype, threads)
    log = (lambda msg: print(msg, file=sys.stderr)) if ns.json else print
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.plugins.entrypoints.simulate.calibrate import FULL_GRID, QUICK_GRID, calibrate, rescale_refusal
    from pagoda.plugins.entrypoints.simulate.cost_model import CostModel

    engine = None
    try:
        if ns.calibrate:
            engine = LLMEngine(config, ns.plugin_manager)
            calibrate(engine, QUICK_GRID if ns.quick_calibration else FULL_GRID, log).save(cost_path)
            log(f"cost model written to {cost_path}")
            if trace is None:
                return 0
        cost_model = CostModel.load(cost_path)
        if ns.handoff is not None and ns.rescale and ns.compare_real:
            log("--compare-real with pipeline stages: the speed probe would count the real hand-offs into the "
                "machine's speed, so the cost model is used as calibrated (--no-rescale)")
            ns.rescale = False
        if engine is None and (ns.compare_real or (ns.rescale and rescale_refusal(cost_model) is None)):
            # for the speed probe (the model whole, as calibrated) and the real run (as configured)
            engine = LLMEngine(config if ns.compare_real else whole_model(config), ns.plugin_manager)
        # with --calibrate and --compare-real, the calibrated engine runs the real replay too
        return _simulate_and_report(ns, config, cost_path, cost_model, trace, source, engine)
    finally:
        if engine is not None:
            engine.shutdown()


def _simulate_and_report(ns: argparse.Namespace, config, cost_path: Path, calibrated, trace, source: str,
                         engine) -> int:
    from pagoda.plugins.entrypoints.simulate.calibrate import measure_speed
    from pagoda.plugins.entrypoints.simulate.report import relative_errors

    log = (lambda msg: print(msg, file=sys.stderr)) if ns.json else print
    if config.cache.preemption_mode == "swap" and not calibrated.has_move_costs:
        log(f"{cost_path} was calibrated before block moves were: swapping costs nothing in this simulation; "
            f"recalibrate with `pagoda simulate --calibrate --cost-model {cost_path}`")
    # the probe runs right before the real run: the machine's speed then is what the simulation should assume
    speed = measure_speed(engine, calibrated) if ns.rescale else None
    if speed is not None:
        log(speed["note"])
    cost_model = calibrated.scaled(speed["scale"], speed["note"]) if speed and speed["scale"] else calibrated
    real = samples = None
    if ns.compare_real:
        real, samples = run_real(config, ns.plugin_manager, trace, ns.trace_seed, ns.rate, engine)
        if speed and speed["scale"]:
            # not used for anything: how far the machine's speed moved while the real run ran
            speed["scale_after_real_run"] = measure_speed(engine, calibrated)["scale"]
    reports = []
    for policy in [config.scheduler.policy, *ns.compare_policy]:
        summary, seconds = simulate_once(config, ns.plugin_manager, cost_model, trace, policy, ns.replicas,
                                         ns.trace_seed, ns.rate, ns.router, ns.router_options, ns.handoff,
                                         lora_costs_from(ns), slo=ns.slo)
        summary["simulator_wall_seconds"] = round(seconds, 3)
        reports.append(summary)
    if ns.splits:
        from pagoda.plugins.entrypoints.simulate.cost_model import CostModel

        instance = CostModel.load(Path(ns.instance_cost_model)) if ns.instance_cost_model else calibrated
        if speed and speed["scale"]:
            instance = instance.scaled(speed["scale"], speed["note"])
        for num_prefill, num_decode in ns.splits:
            summary, seconds = simulate_disaggregated(config, ns.plugin_manager, instance, trace, num_prefill,
                                                      num_decode, ns.trace_seed, ns.rate, ns.router,
                                                      ns.router_options, ns.kv_handoff, ns.slo)
            summary["simulator_wall_seconds"] = round(seconds, 3)
            reports.append(summary)
    errors = unscaled_errors = check = None
    if real is not None:
        reports.append(real)
        errors = relative_errors(reports[0], real)
        if cost_model is not calibrated:
            unscaled, _ = simulate_once(config, ns.plugin_manager, calibrated, trace, config.scheduler.policy,
                                        ns.replicas, ns.trace_seed, ns.rate, ns.router, ns.router_options,
                                        ns.handoff, lora_costs_from(ns))
            unscaled_errors = relative_errors(unscaled, real)
        check = step_time_check(config, ns, calibrated, trace, samples, real)
    result = {"trace": source, "num_requests": len(trace), "cost_model": str(cost_path),
              "cost_model_coefficients": calibrated.coefficients, "speed_probe": speed,
              "cost_model_scale": cost_model.meta.get("scale", 1.0), "runs": reports, "simulated_vs_real": errors,
              "simulated_vs_real_unscaled": unscaled_errors, "step_time_check": check}
    print_result(result, ns.json)
    if ns.result_file:
        Path(ns.result_file).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def step_time_check(config, ns: argparse.Namespace, cost_model, trace, samples, real: dict) -> Optional[dict]:
    """Split the simulator's error in two: how far the real run's own steps were from the cost model's
    prediction for the same batches (the machine, or the calibration, differed), and the error left when
    the trace is simulated with a model fitted to those very steps (what the simulation itself misses)."""
    from pagoda.plugins.entrypoints.simulate.cost_model import FEATURES, fit
    from pagoda.plugins.entrypoints.simulate.report import relative_errors

    if len(samples) < 4 * len(FEATURES):
        return None
    predicted = sum(cost_model.predict(f) for f, _ in samples)
    refitted = fit(samples, {"fitted_to": "the real run's steps"})
    summary, _ = simulate_once(config, ns.plugin_manager, refitted, trace, config.scheduler.policy, ns.replicas,
                               ns.trace_seed, ns.rate, ns.router, ns.router_options, ns.handoff, lora_costs_from(ns))
    return {"real_over_predicted_step_seconds": sum(s for _, s in samples) / predicted,
            "errors_with_model_fitted_to_real_steps": relative_errors(summary, real)}


def whole_model(config):
    """``config`` on one pipeline stage, with the threads given (what the cost model was calibrated on)."""
    import dataclasses

    parallel = dataclasses.replace(config.parallel, pipeline_parallel_size=1, pipeline_layer_partition=(),
                                   pipeline_batches_in_flight=1, cpu_threads=config.host.cpu_threads)
    return dataclasses.replace(config, parallel=parallel)


def pipeline_handoff(config, ns: argparse.Namespace):
    """The stages' hand-offs the simulation adds to each step (None with one stage)."""
    from pagoda.plugins.entrypoints.simulate.cost_model import PipelineHandoff

    stages = config.parallel.pipeline_parallel_size
    if stages == 1:
        return None
    if ns.pipeline_link_latency_us < 0 or ns.pipeline_link_gbps <= 0:
        raise ConfigError(f"--pipeline-link-latency-us {ns.pipeline_link_latency_us:g} / --pipeline-link-gbps "
                          f"{ns.pipeline_link_gbps:g}: pass a latency >= 0 and a positive bandwidth")
    element = config.model.dtype.itemsize
    return PipelineHandoff(stages, ns.pipeline_link_latency_us * 1e-6, ns.pipeline_link_gbps * 1e9 / 8,
                           2 * config.model.hidden_size * element)


def lora_costs_from(ns: argparse.Namespace):
    """The LoRA costs the options give (their defaults where not given); a negative one is refused."""
    from pagoda.plugins.entrypoints.simulate.lora import DEFAULT_LOAD_MS, DEFAULT_SLOT_MS, LoRACosts

    load_ms = DEFAULT_LOAD_MS if ns.lora_load_ms is None else ns.lora_load_ms
    slot_ms = DEFAULT_SLOT_MS if ns.lora_slot_ms is None else ns.lora_slot_ms
    if min(load_ms, slot_ms, ns.lora_step_overhead) < 0 or not math.isfinite(load_ms + slot_ms + ns.lora_step_overhead):
        raise ConfigError(f"--lora-load-ms {load_ms}, --lora-slot-ms {slot_ms} and --lora-step-overhead "
                          f"{ns.lora_step_overhead} must be finite and >= 0")
    return LoRACosts(load_ms / 1e3, slot_ms / 1e3, ns.lora_step_overhead)


def simulate_once(config, pm, cost_model, trace, policy: str, replicas: int, seed: int, rate,
                  router_name: str = "least-loaded", router_options: Optional[dict] = None, handoff=None,
                  lora_costs=None, slo: Optional[tuple[float, float]] = None):
    from pagoda.execution.routing import make_router
    from pagoda.plugins.entrypoints.simulate.report import summarize_run
    from pagoda.plugins.entrypoints.simulate.simulator import build_engines, router_route, run_trace, with_policy

    started = time.perf_counter()
    engines, record = build_engines(with_policy(config, policy), pm, cost_model, trace, replicas, seed, handoff,
                                    lora_costs)
    route = None
    if replicas > 1:
        try:
            router = make_router(router_name, router_options, pm)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        route = router_route(router, config.cache.block_size)
    run_trace(trace, engines, route)
    seconds = time.perf_counter() - started
    label = f"pagoda simulate: {policy}" + (f" x{replicas} replicas, {router_name} router" if replicas > 1 else "")
    if handoff is not None:
        label += f", {handoff.num_stages} pipeline stages"
    return summarize_run(record, math.inf if rate is None else rate, label, slo), seconds


def simulate_disaggregated(config, pm, cost_model, trace, num_prefill: int, num_decode: int, seed: int, rate,
                           router_name: str, router_options: Optional[dict], kv_handoff,
                           slo: Optional[tuple[float, float]] = None):
    """``num_prefill`` prefill and ``num_decode`` decode instances of ``config``, each timed by ``cost_model``,
    the router picking the instance within each role: the decode side's report (what clients see) and the
    simulator's seconds."""
    from pagoda.execution.routing import make_router
    from pagoda.plugins.entrypoints.simulate.disaggregated import prefill_trace, run_disaggregated
    from pagoda.plugins.entrypoints.simulate.report import summarize_run
    from pagoda.plugins.entrypoints.simulate.simulator import build_engines, router_route

    started = time.perf_counter()
    block_size = config.cache.block_size
    prefill, prefill_record = build_engines(config, pm, cost_model, prefill_trace(trace), num_prefill, seed)
    decode, record = build_engines(config, pm, cost_model, trace, num_decode, seed)
    try:
        routes = [router_route(make_router(router_name, router_options, pm), block_size) for _ in range(2)]
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    run_disaggregated(trace, prefill, decode, routes[0], routes[1], kv_handoff, block_size)
    seconds = time.perf_counter() - started
    label = (f"pagoda simulate: {num_prefill} prefill + {num_decode} decode instances, {config.scheduler.policy}, "
             f"{router_name} router")
    summary = summarize_run(record, math.inf if rate is None else rate, label, slo)
    summary["prefill_decode"] = {
        "prefill_instances": num_prefill, "decode_instances": num_decode,
        "prefill_steps": len(prefill_record.step_end),
        "prefill_busy_share": sum(prefill_record.step_seconds) / max(summary["duration_s"] * num_prefill, 1e-9),
        "decode_busy_share": sum(record.step_seconds) / max(summary["duration_s"] * num_decode, 1e-9),
        "blocks_loaded": sum(e.scheduler.kv_transfers.blocks_loaded for e in decode),
        "handoff_ms": kv_handoff.fixed_s * 1e3, "block_load_ms": kv_handoff.per_block_s * 1e3}
    return summary, seconds


def run_real(config, pm, trace, seed: int, rate, engine=None) -> tuple[dict, list]:
    """The trace through ``engine`` (an idle LLMEngine; one is built for the run if None) on the wall clock:
    its report and the (cost-model features, seconds) of each of its steps."""
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.plugins.entrypoints.simulate.real import replay_real, warm_up
    from pagoda.plugins.entrypoints.simulate.report import summarize_run
    from pagoda.plugins.entrypoints.simulate.trace import PromptMaker

    own = engine is None
    engine = LLMEngine(config, pm) if own else engine
    try:
        prompts = PromptMaker(config.model.vocab_size, seed)
        warm_up(engine, prompts)
        record, samples = replay_real(engine, trace, prompts)
    finally:
        if own:
            engine.shutdown()
    summary = summarize_run(record, math.inf if rate is None else rate,
                            f"real engine: {config.scheduler.policy} (in process, wall clock)")
    return summary, samples


def print_result(result: dict, as_json: bool) -> None:
    from pagoda.plugins.entrypoints.simulate.report import format_errors, format_run

    if as_json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['num_requests']} requests ({result['trace']}); cost model {result['cost_model']}, scaled by "
          f"{result['cost_model_scale']:.2f}x")
    for run in result["runs"]:
        print(format_run(run))
        if "simulator_wall_seconds" in run:
            print(f"{'simulator wall time (s)':<30}{run['simulator_wall_seconds']:.2f}")
    scale = result["cost_model_scale"]
    if result["simulated_vs_real"] is not None:
        print(format_errors(result["simulated_vs_real"]).replace(" ====", f", cost model x{scale:.2f} ====", 1))
    if result["simulated_vs_real_unscaled"] is not None:
        print("with the cost model as calibrated (--no-rescale):")
        print(format_errors(result["simulated_vs_real_unscaled"]).split("\n", 1)[1])
    check = result.get("step_time_check")
    if check:
        print(f"the real run's steps took {check['real_over_predicted_step_seconds']:.2f}x the calibrated cost "
              f"model's prediction for the same batches (the speed probe said {scale:.2f}x); simulated with a model "
              "fitted to those steps instead:")
        print(format_errors(check["errors_with_model_fitted_to_real_steps"]).split("\n", 1)[1])
