"""``pagoda bench soak`` in a tiny setting: a real `pagoda serve` child process, warmed up, then a disconnect storm."""

import json
import shlex

from tiny_models import write_tiny_llama

from pagoda.cli import main


def test_a_tiny_soak_leaves_nothing_running_and_the_memory_near_the_warm_up(tmp_path, capsys):
    result = tmp_path / "soak.json"
    # what is checked is the server's memory and its freeing of cut requests, not the model's words: a tiny random
    # Llama in a real checkpoint (the default model's tokenizer and chat template) decodes the storm's streams in
    # milliseconds a step
    (tmp_path / "model").mkdir()
    model = shlex.quote(str(write_tiny_llama(tmp_path / "model", chat_template=True)))
    rc = main(["bench", "soak", "--malloc-tuning", "on", "--warmup-requests", "5", "--fuzz-max-examples", "0",
               "--storms", "1", "--storm-requests", "40", "--storm-concurrency", "10", "--max-growth", "0.5",
               "--hostile-rounds", "1",
               "--serve-args", f"--model {model} --cpu-threads 1 --dtype float32 --max-model-len 256 "
               "--kv-cache-memory-bytes 33554432",
               "--result-file", str(result)])
    out = capsys.readouterr().out
    assert rc == 0, out
    (run,) = json.loads(result.read_text())["runs"]
    assert run["malloc_tuning"] == "on" and run["alive"]
    assert [p["phase"] for p in run["phases"]] == ["started", "warm-up", "storm 1", "hostile 1"]
    storm = run["phases"][2]
    # every storm request was answered, and cut by the client after its first chunks
    assert storm["cut"] == 40 and storm["refused"] == storm["failed"] == 0
    # the server freed every cut request: nothing running or waiting, no KV block in use
    assert all(value == 0 for p in run["phases"] for value in p["load"].values())
    # a generous bound: forty cut requests leave the server's memory within half of its warm-up size
    assert 0 < storm["rss"] and storm["growth"] < 0.5
    # the hostile round: no 5xx, another key's stored response kept, the tiny schema not held up by the abandoned
    # expensive ones (which took minutes before compiles could be stopped)
    hostile = run["phases"][3]
    assert hostile["server_errors"] == 0 and hostile["responses_lost"] == 0 and hostile["tiny_schema_s"] < 10
    assert "==== pagoda bench soak" in out


def test_the_soak_refuses_a_growth_bound_of_zero_saying_what_to_pass(capsys):
    assert main(["bench", "soak", "--max-growth", "0"]) == 2
    assert "--max-growth 0.0: pass a fraction above 0" in capsys.readouterr().err
