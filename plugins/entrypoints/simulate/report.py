"""The report of a run: what ``pagoda bench serve`` prints, plus what only an engine-side view has
(queueing, preemptions, swaps, prefix-cache hits, KV usage over time)."""

from __future__ import annotations

import math
from typing import Optional

from pagoda.plugins.entrypoints.bench.serve import format_summary, percentiles, summary_from
from pagoda.plugins.entrypoints.simulate.simulator import RunRecord

# points of the KV usage time series in the report
NUM_USAGE_POINTS = 20


def summarize_run(record: RunRecord, rate: float, label: str, slo: Optional[tuple[float, float]] = None) -> dict:
    """The run's report; with ``slo`` (TTFT and TPOT targets in seconds), its goodput under them too."""
    import numpy as np

    arrival = np.frombuffer(record.arrival, dtype=np.float64)
    finish = np.frombuffer(record.finish, dtype=np.float64)
    first = np.frombuffer(record.first_token, dtype=np.float64)
    first_sched = np.frombuffer(record.first_scheduled, dtype=np.float64)
    num_out = np.frombuffer(record.num_output, dtype=np.int64)
    prompt_len = np.frombuffer(record.prompt_len, dtype=np.int64)
    ok = ~np.isnan(finish) & ~np.isnan(first) & (num_out > 0)
    if record.errors:
        ok[list(record.errors)] = False
    ttft = first[ok] - arrival[ok]
    e2e = finish[ok] - arrival[ok]
    many = num_out[ok] > 1
    tpot = (e2e[many] - ttft[many]) / (num_out[ok][many] - 1)
    end = float(np.nanmax(finish)) if ok.any() else 0.0
    duration = max(end - float(arrival.min()), 1e-9)
    summary = summary_from(rate, duration, int(ok.sum()), int((~ok).sum()), int(prompt_len[ok].sum()),
                           int(num_out[ok].sum()), ttft, tpot, np.frombuffer(record.itl, dtype=np.float64), e2e,
                           list(record.errors.values()))
    summary["label"] = label
    if slo is not None:
        from pagoda.plugins.entrypoints.simulate.disaggregated import slo_goodput

        per_token = np.full(len(ttft), np.nan)
        per_token[many] = tpot
        summary["goodput"] = slo_goodput(ttft, per_token, len(arrival), duration, *slo)
    summary["queue_ms"] = percentiles((first_sched - arrival)[ok])
    summary["preemptions"] = record.num_preemptions
    summary["swapped_out_requests"] = record.num_swapped_out
    summary["blocks_swapped"] = record.num_blocks_swapped
    summary["prefix_cache_hit_rate"] = (record.prefix_hits / record.prefix_queries if record.prefix_queries
                                        else math.nan)  # nan: no prefix cache (or an allocator without stats)
    summary["num_steps"] = len(record.step_end)
    step_total = float(sum(record.step_seconds))
    summary["pipeline_handoff_share"] = record.handoff_seconds / step_total if step_total else 0.0
    summary["kv_usage"] = _usage(record)
    # per priority level (when the trace has more than one): TTFT, the measure priorities exist for
    levels = np.frombuffer(record.priority, dtype=np.int64)
    if len(np.unique(levels)) > 1:
        summary["ttft_ms_by_priority"] = {int(p): percentiles(first[ok & (levels == p)] - arrival[ok & (levels == p)])
                                          for p in np.unique(levels)}
    # per tenant (when the trace has more than one): what the fair policy shares between them
    tenants = record.tenant
    if len(set(tenants)) > 1:
        summary["by_tenant"] = {}
        for tenant in sorted(set(tenants), key=str):
            mine = ok & np.array([t == tenant for t in tenants])
            several = mine & (num_out > 1)
            summary["by_tenant"][str(tenant)] = {
                "completed": int(mine.sum()),
                "ttft_ms": percentiles(first[mine] - arrival[mine]),
                "tpot_ms": percentiles((finish[several] - first[several]) / (num_out[several] - 1))}
    # LoRA (when the trace names adapters): their loads, and TTFT with an adapter against the base model's
    if any(name is not None for name in record.lora_name):
        with_lora = np.array([name is not None for name in record.lora_name])
        summary["lora"] = {
            "adapters": len({name for name in record.lora_name if name is not None}),
            "loads_from_disk": record.num_lora_loads, "slot_loads": record.num_lora_slot_loads,
            "load_seconds": round(record.lora_load_seconds, 4),
            "ttft_ms_adapters": percentiles(first[ok & with_lora] - arrival[ok & with_lora]),
            "ttft_ms_base": percentiles(first[ok & ~with_lora] - arrival[ok & ~with_lora])}
    return summary


def _usage(record: RunRecord) -> dict:
    """Time-weighted mean, quantiles and max of KV usage over the steps, and a short time series."""
    import numpy as np

    usage = np.frombuffer(record.kv_usage, dtype=np.float64)
    if usage.size == 0:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "max": math.nan, "series": []}
    weights = np.frombuffer(record.step_seconds, dtype=np.float64)
    ends = np.frombuffer(record.step_end, dtype=np.float64)
    order = np.argsort(usage)
    cum = np.cumsum(weights[order]) / max(weights.sum(), 1e-12)

    def quantile(q: float) -> float:
        return float(usage[order][min(np.searchsorted(cum, q), usage.size - 1)])

    # the series: usage at NUM_USAGE_POINTS evenly spaced times (the step running then)
    times = np.linspace(ends[0], ends[-1], NUM_USAGE_POINTS)
    at = np.minimum(np.searchsorted(ends, times), usage.size - 1)
    return {"mean": float(np.average(usage, weights=weights)) if weights.sum() > 0 else float(usage.mean()),
            "p50": quantile(0.5), "p90": quantile(0.9), "max": float(usage.max()),
            "series": [[round(float(t), 3), round(float(u), 4)] for t, u in zip(times, usage[at])]}


def format_run(s: dict) -> str:
    lines = [format_summary(s).replace("pagoda bench serve (W4)", s["label"], 1)]
    q = s["queue_ms"]
    g = s.get("goodput")
    if g:
        lines.append(f"{'Goodput (req/s)':<30}{g['goodput_rps']:.3f}: {g['met']} requests ({g['attainment']:.1%}) "
                     f"met TTFT <= {g['ttft_slo_ms']:g} ms and TPOT <= {g['tpot_slo_ms']:g} ms")
    lines.append(f"{'Queue':<10}" + "".join(f"{q[c]:>10.1f}" for c in ("mean", "p50", "p90", "p99")))
    for level, row in s.get("ttft_ms_by_priority", {}).items():
        lines.append(f"{'TTFT p=' + str(level):<10}" + "".join(f"{row[c]:>10.1f}" for c in ("mean", "p50", "p90",
                                                                                          "p99")))
    for tenant, row in s.get("by_tenant", {}).items():
        for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
            lines.append(f"{label + ' ' + tenant:<10}" + "".join(f"{row[key][c]:>10.1f}"
                                                                 for c in ("mean", "p50", "p90", "p99")))
    lora = s.get("lora")
    if lora:
        for key, label in (("ttft_ms_adapters", "TTFT LoRA"), ("ttft_ms_base", "TTFT base")):
            lines.append(f"{label:<10}" + "".join(f"{lora[key][c]:>10.1f}" for c in ("mean", "p50", "p90", "p99")))
        lines.append(f"{'LoRA adapters':<30}{lora['adapters']}: {lora['loads_from_disk']} loads from disk, "
                     f"{lora['slot_loads']} into a slot, {lora['load_seconds']:.3f} s of steps")
    u = s["kv_usage"]
    lines += [
        f"{'steps':<30}{s['num_steps']}",
        f"{'preemptions':<30}{s['preemptions']} ({s['swapped_out_requests']} swapped out, "
        f"{s['blocks_swapped']} blocks moved)",
        f"{'KV usage mean/p50/p90/max':<30}{u['mean']:.1%} / {u['p50']:.1%} / {u['p90']:.1%} / {u['max']:.1%}",
    ]
    pd = s.get("prefill_decode")
    if pd:
        lines.append(f"{'prefill / decode busy':<30}{pd['prefill_busy_share']:.1%} / {pd['decode_busy_share']:.1%} of "
                     f"each instance's time; {pd['blocks_loaded']} blocks loaded by the decode instances")
    if s.get("pipeline_handoff_share"):
        lines.append(f"{'pipeline hand-offs':<30}{s['pipeline_handoff_share']:.1%} of the step time")
    if u["series"]:
        lines.append(f"{'KV usage over time':<30}" + " ".join(f"{v:.0%}" for _, v in u["series"]))
    return "\n".join(lines)


def relative_errors(sim: dict, real: dict) -> dict[str, Optional[float]]:
    """(simulated - real) / real for the headline measures."""
    pairs = {
        "request_throughput": (sim["request_throughput"], real["request_throughput"]),
        "output_token_throughput": (sim["output_token_throughput"], real["output_token_throughput"]),
        "ttft_p50": (sim["ttft_ms"]["p50"], real["ttft_ms"]["p50"]),
        "ttft_p99": (sim["ttft_ms"]["p99"], real["ttft_ms"]["p99"]),
        "tpot_p50": (sim["tpot_ms"]["p50"], real["tpot_ms"]["p50"]),
        "e2e_p50": (sim["e2e_ms"]["p50"], real["e2e_ms"]["p50"]),
    }
    return {k: (s - r) / r if r and math.isfinite(r) and math.isfinite(s) else None for k, (s, r) in pairs.items()}


def format_errors(errors: dict[str, Optional[float]]) -> str:
    lines = ["==== simulated vs real: (simulated - real) / real ===="]
    for name, err in errors.items():
        lines.append(f"{name:<30}{'n/a' if err is None else f'{err:+.1%}'}")
    return "\n".join(lines)
