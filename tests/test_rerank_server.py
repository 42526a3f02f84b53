"""A cross-encoder served in-process under uvicorn: vLLM's ``/v1/score`` and the Jina / Cohere rerank shape,
scores checked against sentence-transformers' ``CrossEncoder``."""

from __future__ import annotations

import httpx
import pytest

from pagoda.engine.engine_args import EngineArgs
from pagoda.engine.pooling import AsyncPoolingEngine, PoolingEngine
from pagoda.plugins.entrypoints.server import ServerThread
from pagoda.plugins.entrypoints.server.pooling import build_pooling_app
from pooling_helpers import TEXTS, write_encoder

QUERY = "what is the capital of germany"
DOCS = ["berlin is the capital of germany", "the cat sat on a mat", "paris is the capital of france",
        "rain sun cloud"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_encoder(tmp_path_factory.mktemp("ckpt") / "cross", "cross")
    engine = PoolingEngine(EngineArgs(model=str(folder), served_model_name="tiny-rerank", dtype="float32"), "score")
    thread = ServerThread(build_pooling_app(AsyncPoolingEngine(engine))).start()
    yield thread.url, folder
    thread.stop()


@pytest.fixture(scope="module")
def reference(server):
    st = pytest.importorskip("sentence_transformers")
    return [float(s) for s in st.CrossEncoder(str(server[1]), device="cpu").predict([(QUERY, d) for d in DOCS])]


def test_score_matches_the_cross_encoder(server, reference):
    body = httpx.post(server[0] + "/v1/score", json={"model": "tiny-rerank", "text_1": QUERY, "text_2": DOCS}).json()
    assert body["object"] == "list" and body["model"] == "tiny-rerank"
    assert [d["score"] for d in body["data"]] == pytest.approx(reference, abs=1e-5)
    pairs = httpx.post(server[0] + "/v1/score", json={"text_1": [QUERY, QUERY], "text_2": DOCS[:2]}).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx(reference[:2], abs=1e-5)
    assert body["usage"]["prompt_tokens"] > len(DOCS) * 4


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_the_cross_encoder_s_score(server, reference, path):
    body = httpx.post(server[0] + path, json={"query": QUERY, "documents": DOCS, "top_n": 3}).json()
    order = sorted(range(len(DOCS)), key=lambda i: -reference[i])[:3]
    assert [r["index"] for r in body["results"]] == order
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([reference[i] for i in order], abs=1e-5)
    assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in order]
    bare = httpx.post(server[0] + path, json={"query": QUERY, "documents": [{"text": d} for d in DOCS],
                                              "return_documents": False}).json()
    assert len(bare["results"]) == len(DOCS) and all("document" not in r for r in bare["results"])


def test_cohere_s_sdk_reranks_through_v2_rerank(server, reference):
    cohere = pytest.importorskip("cohere")
    co = cohere.ClientV2(api_key="none", base_url=server[0])  # the SDK posts to {base_url}/v2/rerank
    got = co.rerank(model="tiny-rerank", query=QUERY, documents=DOCS, top_n=2)
    order = sorted(range(len(DOCS)), key=lambda i: -reference[i])[:2]
    assert [r.index for r in got.results] == order
    assert [r.relevance_score for r in got.results] == pytest.approx([reference[i] for i in order], abs=1e-5)


def test_wrong_routes_and_bad_bodies_are_openai_errors(server):
    url = server[0]
    for path, fragment in (("/v1/embeddings", "served for the 'score' task"),
                           ("/v1/chat/completions", "does not generate text")):
        resp = httpx.post(url + path, json={"model": "tiny-rerank", "input": "x", "messages": []})
        assert resp.status_code == 400 and fragment in resp.json()["error"]["message"]
    resp = httpx.post(url + "/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[:3]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "text_2"
    resp = httpx.post(url + "/v1/rerank", json={"query": QUERY})
    assert resp.status_code == 400 and "documents" in resp.json()["error"]["message"]
    resp = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 0})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "top_n"
