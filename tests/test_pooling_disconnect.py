"""A client that disconnects while its pooling request waits: the request is cancelled (an abort in /metrics),
its inputs never run, and the server serves the others (a real uvicorn server on 127.0.0.1)."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from pagoda.engine.engine_args import EngineArgs
from pagoda.engine.pooling import AsyncPoolingEngine, PoolingEngine
from pagoda.plugins.entrypoints.server import ServerThread
from pagoda.plugins.entrypoints.server.pooling import build_pooling_app
from pooling_helpers import TEXTS, write_encoder


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_encoder(tmp_path_factory.mktemp("ckpt") / "bert", "bert", "mean")
    engine = PoolingEngine(EngineArgs(model=str(folder), served_model_name="tiny-embed"), "embed")
    served = AsyncPoolingEngine(engine)
    thread = ServerThread(build_pooling_app(served)).start()
    yield thread.url, served
    thread.stop()


def _finished(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    page = httpx.get(url + "/metrics").text
    return {s.labels["finished_reason"]: s.value for f in text_string_to_metric_families(page) for s in f.samples
            if s.name == "pagoda:request_success_total"}


@pytest.mark.parametrize("path, body, inputs", [
    ("/v1/embeddings", {"input": TEXTS[1:3]}, 2),
    ("/v1/score", {"text_1": TEXTS[1], "text_2": TEXTS[2]}, 2),
    ("/v1/rerank", {"query": TEXTS[1], "documents": [TEXTS[2], TEXTS[3]]}, 3),
])
def test_a_client_that_disconnects_while_waiting_is_aborted_and_the_server_serves_on(server, path, body, inputs):
    url, served = server
    before = _finished(url)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with served.engine.lock:  # the engine's thread blocks on the first request's batch: the next one waits
            first = pool.submit(httpx.post, url + "/v1/embeddings", json={"input": TEXTS[0]}, timeout=60)
            time.sleep(0.3)
            with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
                httpx.post(url + path, json=body, timeout=httpx.Timeout(60, read=0.5))
            deadline = time.monotonic() + 10  # until the server has seen the disconnect and cancelled the inputs
            while time.monotonic() < deadline and not (
                    served.num_waiting == inputs and all(f.cancelled() for _, f, _ in list(served._pending))):
                time.sleep(0.05)
        assert first.result().status_code == 200
    after = httpx.post(url + path, json=body, timeout=60)  # the same request from a client that stays
    assert after.status_code == 200
    delta = {k: v - before.get(k, 0.0) for k, v in _finished(url).items()}
    assert delta["abort"] == inputs and delta["stop"] == 1 + inputs and delta["error"] == 0
