"""contrib/ Grafana dashboard, Prometheus alert rules and Kubernetes manifests reference only real metrics and flags."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.engine.metrics import EngineStats, PrometheusExporter
from pagoda.kv.blocks import PagedKVCacheManager
from pagoda.scheduling import Scheduler

CONTRIB = Path(__file__).resolve().parent.parent / "contrib"
METRIC = re.compile(r"pagoda:[A-Za-z0-9_:]+")


def exported_names() -> set[str]:
    """Every sample name a real exporter (over a real scheduler and KV manager) writes at /metrics."""
    cache = CacheConfig(16, 1 << 20, "auto", True, None, 0, "recompute", "paged")
    sched_cfg = SchedulerConfig("fcfs", 4, 256, 128, True, 0, None)
    kv = PagedKVCacheManager(8, 16)
    exporter = PrometheusExporter(EngineStats(), Scheduler(sched_cfg, cache, kv), kv, "m")
    return {s.name for fam in text_string_to_metric_families(exporter.render().decode()) for s in fam.samples}


def expressions(node) -> list[str]:
    """Every ``expr`` string anywhere in a JSON/YAML tree."""
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for v in node.values() for e in expressions(v)]
    if isinstance(node, list):
        return [e for v in node for e in expressions(v)]
    return []


def test_every_metric_in_the_grafana_dashboard_is_exported():
    dashboard = json.loads((CONTRIB / "grafana" / "pagoda-dashboard.json").read_text())
    exprs = expressions(dashboard["panels"])
    assert len(exprs) >= 10
    referenced = {m for e in exprs for m in METRIC.findall(e)}
    assert referenced - exported_names() == set()
    # the essentials each have a panel
    for needed in ("num_requests_waiting", "kv_cache_usage_perc", "time_to_first_token_seconds_bucket",
                   "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                   "request_queue_time_seconds_bucket", "prefix_cache_hits_total", "num_preemptions_total"):
        assert f"pagoda:{needed}" in referenced, needed
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_every_metric_in_the_alert_rules_is_exported_and_the_key_alerts_exist():
    rules = yaml.safe_load((CONTRIB / "prometheus" / "pagoda-alerts.yml").read_text())
    alerts = [r for group in rules["groups"] for r in group["rules"]]
    for rule in alerts:
        assert {"alert", "expr", "labels", "annotations"} <= set(rule), rule
        assert rule["labels"]["severity"] in ("info", "warning", "critical")
    referenced = {m for r in alerts for m in METRIC.findall(r["expr"])}
    assert referenced - exported_names() == set()
    by_metric = " ".join(r["expr"] for r in alerts)
    assert "pagoda:num_requests_waiting" in by_metric  # queue depth
    assert re.search(r"histogram_quantile\(0\.95,\s*sum by \(le[^)]*\) \(rate\(pagoda:e2e_request_latency", by_metric)
    assert "pagoda:kv_cache_usage_perc" in by_metric  # cache usage


def test_the_hpa_scales_on_the_waiting_queue_through_the_adapter_rule():
    hpa = yaml.safe_load((CONTRIB / "k8s" / "hpa.yaml").read_text())
    adapter = yaml.safe_load((CONTRIB / "k8s" / "prometheus-adapter.yaml").read_text())
    rule = yaml.safe_load(adapter["data"]["config.yaml"])["rules"][0]
    (metric,) = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    assert metric == rule["name"]["as"]
    assert set(METRIC.findall(rule["seriesQuery"])) == {"pagoda:num_requests_waiting"} <= exported_names()
    assert hpa["spec"]["scaleTargetRef"]["name"] == "pagoda"


def test_the_deployment_runs_pagoda_serve_with_valid_flags_and_probes_health():
    from pagoda.plugins.entrypoints.cli import serve

    deployment = yaml.safe_load((CONTRIB / "k8s" / "deployment.yaml").read_text())
    service = yaml.safe_load((CONTRIB / "k8s" / "service.yaml").read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(container["args"])  # a bad flag exits here
    assert ns.command == "serve" and ns.host == "0.0.0.0"
    assert container["ports"][0]["containerPort"] == ns.port
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > ns.shutdown_timeout
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]


def test_the_deployment_listening_on_every_interface_requires_its_api_key_secret():
    deployment = yaml.safe_load((Path(__file__).resolve().parents[1] / "contrib/k8s/deployment.yaml").read_text())
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert "0.0.0.0" in container["args"]
    [key] = [e for e in container["env"] if e["name"] == "PAGODA_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"]["optional"] is False
