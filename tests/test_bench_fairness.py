"""``pagoda bench fairness`` in a tiny setting: a real server per policy, a flooding tenant beside a small one."""

import json
import re

from pagoda.cli import main


def test_the_fairness_bench_measures_the_small_tenant_unloaded_and_flooded_under_each_policy(tmp_path, capsys):
    result = tmp_path / "fairness.json"
    rc = main(["bench", "fairness", "--flood-requests", "2", "--flood-n", "3", "--flood-max-tokens", "2000",
               "--small-requests", "2", "--small-max-tokens", "4", "--cpu-threads", "1", "--kv-cache-memory-bytes",
               str(128 << 20), "--fair-step-seqs", "2", "--result-file", str(result)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "==== pagoda bench fairness" in out
    rows = json.loads(result.read_text())["rows"]
    assert [(r["policy"], r["phase"]) for r in rows] == [("fcfs", "unloaded"), ("fcfs", "flooded"),
                                                         ("fair", "unloaded"), ("fair", "flooded")]
    for row in rows:
        assert row["completed"] == 2 and row["failed"] == 0
        assert row["ttft_ms"]["mean"] > 0 and row["tpot_ms"]["mean"] > 0
    # the small requests started while the flood's six sequences ran
    assert all(r["num_running"] == 6 for r in rows if r["phase"] == "flooded")
    # the table gives the flooded figures as ratios to the unloaded ones
    for policy in ("fcfs", "fair"):
        assert re.search(rf"^1\s+{policy}\s+flooded\s.*\d\.\dx\s+\d+\.\dx$", out, re.M), out
