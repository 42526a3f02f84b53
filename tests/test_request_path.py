"""A request's path: the pagoda files a greedy ``LLM.generate`` on the default model enters, traced. None of the
host layer is on it (docs/architecture.md, "A request's path"): host settings are applied at start-up."""

import sys
from pathlib import Path

import pagoda.host
import pagoda.plugins
from pagoda.engine.llm import LLM
from pagoda.sampling_params import SamplingParams

ROOTS = (Path(pagoda.__file__).resolve().parent, Path(pagoda.plugins.__file__).resolve().parent)
HOST = Path(pagoda.host.__file__).resolve().parent


def _pagoda_files_entered(run) -> list[str]:
    """The pagoda source files whose functions ``run()`` calls, in the order first entered (this thread)."""
    entered: dict[str, None] = {}

    def profile(frame, event, arg):
        if event == "call":
            entered.setdefault(frame.f_code.co_filename, None)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return [f for f in entered if any(Path(f).resolve().is_relative_to(root) for root in ROOTS)]


def test_a_greedy_request_enters_no_file_of_the_host_layer_with_the_default_options():
    llm = LLM(max_model_len=256, kv_cache_memory_bytes=32 << 20)  # huge pages on, threads measured: the defaults
    params = SamplingParams(temperature=0.0, max_tokens=8)
    files = _pagoda_files_entered(lambda: llm.generate(["The capital of France is"], params, use_tqdm=False))
    assert any(f.endswith("engine/llm_engine.py") for f in files) and any(f.endswith("models/decoder.py") for f in files)
    entered_host = [f for f in files if Path(f).resolve().is_relative_to(HOST)]
    assert entered_host == [], f"the request entered the host layer: {entered_host}"


def test_a_warm_request_enters_the_eighteen_files_of_the_documented_path():
    llm = LLM(dtype="bfloat16", batch_invariant=True, max_model_len=256, kv_cache_memory_bytes=32 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    llm.generate(["warm up"], SamplingParams(max_tokens=2), use_tqdm=False)
    files = _pagoda_files_entered(lambda: llm.generate(["The capital of France is"], params, use_tqdm=False))
    names = [str(Path(f).resolve().relative_to(next(r for r in ROOTS if Path(f).resolve().is_relative_to(r))))
             for f in files]
    # engine statistics are a served engine's (/metrics); the uni executor's execute is its runner's own
    assert not {"engine/metrics.py", "execution/executor.py"} & set(names), names
    assert len(names) <= 18, f"{len(names)} files on a request's path (docs/architecture.md lists 18): {names}"
