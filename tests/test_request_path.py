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
    assert any(f.endswith("engine/llm_engine.py") for f in files) and any(f.endswith("models/llama.py") for f in files)
    entered_host = [f for f in files if Path(f).resolve().is_relative_to(HOST)]
    assert entered_host == [], f"the request entered the host layer: {entered_host}"
