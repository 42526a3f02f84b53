"""``pagoda serve --replicas``'s flags and the pieces the replicas are built from, with no Ray cluster: bad flags
are refused before Ray starts, the autoscaling policy's arithmetic, a Serve config's roles, each replica's tenant
source. The launches themselves run in test_ray_cluster.py, on one local Ray cluster."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray.serve")


def test_bad_replica_flags_fail_before_anything_starts(capsys):
    import ray

    from pagoda.cli import main

    assert not ray.is_initialized()
    cases = ((["--router", "nearest"], "unknown request router 'nearest'"),
             (["--replicas", "0"], "--replicas 0: pass 1 or more"),
             (["--replicas", "2", "--max-replicas", "1"], "autoscaling needs"),
             (["--router-options", '{"imbalance": 1}'], "does not take the options"))
    # the command's own entry point, in this process: the flags are read before Ray would start here
    try:
        for flags, message in cases:
            assert main(["serve", "--replicas", "2", *flags]) != 0
            stderr = capsys.readouterr().err
            assert message in stderr, stderr[-2000:]
            assert not ray.is_initialized(), flags
    finally:
        ray.shutdown()


def test_the_autoscaling_policy_asks_for_replicas_by_waiting_plus_running_requests():
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    from pagoda.plugins.entrypoints.replicas.autoscaling import queue_depth_policy

    dep = DeploymentID(name="pagoda-engine", app_name="pagoda")
    r1, r2 = ReplicaID("r1", dep), ReplicaID("r2", dep)

    def context(waiting: dict, running: dict) -> AutoscalingContext:
        return AutoscalingContext(
            deployment_id=dep, deployment_name=dep.name, app_name=dep.app_name, current_num_replicas=2,
            target_num_replicas=2, running_replicas=[r1, r2], total_num_requests=0.0, total_queued_requests=0.0,
            aggregated_metrics={"num_requests_waiting": waiting, "num_requests_running": running} if waiting
            or running else {}, raw_metrics=None, capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=8, policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
            current_time=time.time(), config=AutoscalingConfig(min_replicas=1, max_replicas=8,
                                                               target_ongoing_requests=16))

    assert queue_depth_policy(context({r1: 30.0, r2: 10.0}, {r1: 16.0, r2: 16.0}))[0] == 5  # 72 / 16
    assert queue_depth_policy(context({r1: 0.0, r2: 0.0}, {r1: 3.0, r2: 0.0}))[0] == 1
    assert queue_depth_policy(context({}, {}))[0] == 2  # nothing reported yet: stay


def test_each_replica_reads_the_tenant_where_pagoda_serve_was_told_to():
    from pagoda.cli import build_parser
    from pagoda.plugins.entrypoints.replicas.command import replica_options

    for source in ("api-key", "header", "user"):
        ns = build_parser().parse_args(["serve", "--replicas", "2", "--tenant-source", source,
                                        "--scheduling-policy", "fair", "--max-waiting-per-tenant", "4"])
        assert replica_options(ns, cpus=2).tenant_source == source


def test_bad_replica_role_flags_fail_before_anything_starts(capsys):
    import ray

    from pagoda.cli import main

    cases = ((["--replicas", "2", "--replica-roles", "prefill,encode"], "unknown replica roles ['encode']"),
             (["--replicas", "3", "--replica-roles", "prefill,decode"], "names 2 roles for --replicas 3"),
             (["--replicas", "2", "--replica-roles", "decode,decode"], "at least one prefill and one decode"),
             (["--replicas", "2", "--replica-roles", "prefill,decode"], "add --kv-connector shared-disk"),
             (["--replicas", "2", "--replica-roles", "prefill,decode", "--kv-connector", "shared-disk",
               "--kv-role", "decode"], "drop --kv-role"),
             (["--replicas", "2", "--replica-roles", "prefill,decode", "--kv-connector", "shared-disk",
               "--max-replicas", "4"], "drop --max-replicas"))
    try:
        for flags, message in cases:
            try:
                assert main(["serve", *flags]) != 0
            except SystemExit as exc:  # argparse's refusal of a bad role
                assert exc.code != 0
            stderr = capsys.readouterr().err
            assert message in stderr, (flags, stderr[-2000:])
            assert not ray.is_initialized(), flags
    finally:
        ray.shutdown()


def test_a_serve_config_with_roles_needs_a_kv_connector(tmp_path):
    from tiny_models import write_tiny_checkpoint

    from pagoda.plugins.entrypoints.replicas.deployments import app_builder

    model = write_tiny_checkpoint(tmp_path / "model")
    engine = {"model": str(model), "load_format": "dummy"}
    with pytest.raises(ValueError, match="through a KV connector"):
        app_builder({"engine": engine, "replicas": {"roles": ["prefill", "decode"]}})
    # with one, the application has a prefill and a decode deployment behind the ingress
    app = app_builder({"engine": {**engine, "kv_connector": "shared-disk",
                                  "kv_connector_options": {"path": str(tmp_path)}},
                       "replicas": {"roles": ["prefill", "decode", "decode"]}})
    engines = {}
    for arg in app._bound_deployment.init_args:  # the engine deployments bound into the ingress
        deployment = getattr(arg, "_bound_deployment", None)
        if deployment is not None:
            engines[deployment.name] = (deployment.num_replicas, deployment.init_args[0].kv_role)
    assert engines == {"pagoda-decode": (2, "decode"), "pagoda-prefill": (1, "prefill")}
