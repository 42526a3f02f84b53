"""``pagoda bench fairness`` in a tiny setting: a real server per policy, a flooding tenant beside a small one."""

import json
import re

from pagoda.cli import main


def test_the_fairness_bench_measures_the_small_tenant_unloaded_and_flooded_under_each_policy(tmp_path, capsys):
    result = tmp_path / "fairness.json"
    rc = main(["bench", "fairness", "--flood-requests", "2", "--flood-n", "3", "--flood-max-tokens", "2000",
               "--small-requests", "2", "--small-max-tokens", "4", "--cpu-threads", "1", "--kv-cache-memory-bytes",
               str(128 << 20), "--fair-step-seqs", "2", "--flood-alone-seconds", "0.2", "--result-file", str(result),
               "--scheduling-policies", "fcfs", "fair:fair-step-ms=50"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "==== pagoda bench fairness" in out
    rows = json.loads(result.read_text())["rows"]
    fair = "fair:fair-step-ms=50"
    assert [(r["policy"], r["phase"]) for r in rows] == [("fcfs", "unloaded"), ("fcfs", "flooded"),
                                                         (fair, "unloaded"), (fair, "flooded")]
    for row in rows:
        assert row["completed"] == 2 and row["failed"] == 0
        assert row["ttft_ms"]["mean"] > 0 and row["tpot_ms"]["mean"] > 0
    # the small requests started while the flood's six sequences ran; the flood streamed tokens beside them (every
    # step of theirs ran flood sequences too; alone, a window as short as this one may fall inside one long step)
    flooded = [r for r in rows if r["phase"] == "flooded"]
    assert all(r["num_running"] == 6 for r in flooded)
    assert all(r["flood_tokens_per_s"]["alone"] >= 0 and r["flood_tokens_per_s"]["beside_small"] > 0 for r in flooded)
    # the table gives the flooded figures as ratios to the unloaded ones, then the flood's tokens per second
    for policy in ("fcfs", fair):
        assert re.search(rf"^1\s+{re.escape(policy)}\s+flooded\s.*\d\.\dx\s+\d+\.\dx\s+[\d.]+\s+[\d.]+$", out,
                         re.M), out


def test_a_policy_entry_with_an_option_that_is_not_an_engine_option_is_refused():
    import pytest

    from pagoda.errors import ConfigError
    from pagoda.plugins.entrypoints.bench.fairness import parse_policy

    assert parse_policy("fair:fair-step-ms=0:--fair-step-seqs=4") == ("fair", {"fair_step_ms": "0",
                                                                             "fair_step_seqs": "4"})
    with pytest.raises(ConfigError, match="not OPTION=VALUE with an engine option"):
        parse_policy("fair:fair-step-millis=0")
