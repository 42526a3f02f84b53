"""``pagoda serve`` on an embedding checkpoint (a subprocess, as users run it) driven by the official ``openai``
client and LangChain's ``OpenAIEmbeddings``."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest
import torch

from pooling_helpers import TEXTS, write_encoder
from serve_process import start_process

MODEL = "tiny-embed"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_encoder(tmp_path_factory.mktemp("ckpt") / "bert", "bert", "mean")
    log = folder.parent / "serve.log"
    proc, url = start_process(log, "serve", str(folder), "--served-model-name", MODEL, "--uvicorn-log-level", "warning")
    yield url, folder
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none")


def test_serve_detects_an_embedding_checkpoint_and_lists_it(server):
    models = httpx.get(server[0] + "/v1/models").json()["data"]
    assert [(m["id"], m["task"], m["max_model_len"]) for m in models] == [(MODEL, "embed", 64)]


def test_openai_client_embeddings_match_sentence_transformers(server, client):
    st = pytest.importorskip("sentence_transformers")
    theirs = st.SentenceTransformer(str(server[1]), device="cpu").encode(TEXTS, convert_to_tensor=True).float()
    resp = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    ours = torch.tensor([d.embedding for d in resp.data])
    assert [d.index for d in resp.data] == list(range(len(TEXTS)))
    assert torch.nn.functional.cosine_similarity(ours, theirs).min().item() >= 0.9999
    floats = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert torch.tensor(floats.data[0].embedding).allclose(ours[0], atol=1e-6)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens > len(TEXTS) * 3


def test_token_ids_embed_like_their_text(server, client):
    ids = [2, 5, 6, 7, 3]  # [CLS] the cat sat [SEP]
    text = client.embeddings.create(model=MODEL, input="the cat sat").data[0].embedding
    one = client.embeddings.create(model=MODEL, input=ids).data[0].embedding
    many = client.embeddings.create(model=MODEL, input=[ids, ids[:3] + [3]])
    assert one == pytest.approx(text, abs=1e-6) and many.data[0].embedding == pytest.approx(text, abs=1e-6)
    assert len(many.data) == 2 and many.usage.prompt_tokens == 9


def test_concurrent_requests_share_batches_and_get_their_own_vectors(server, client):
    alone = [client.embeddings.create(model=MODEL, input=t).data[0].embedding for t in TEXTS]
    with concurrent.futures.ThreadPoolExecutor(len(TEXTS)) as pool:
        together = list(pool.map(lambda t: client.embeddings.create(model=MODEL, input=t).data[0].embedding,
                                 TEXTS))
    for a, b in zip(alone, together):
        assert a == pytest.approx(b, abs=1e-5)


def test_langchain_openai_embeddings(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    emb = langchain_openai.OpenAIEmbeddings(model=MODEL, base_url=server[0] + "/v1", api_key="none",
                                            check_embedding_ctx_length=False)  # no tiktoken ids: send text
    docs = emb.embed_documents(TEXTS[:2])
    query = emb.embed_query(TEXTS[0])
    assert len(docs) == 2 and query == pytest.approx(docs[0], abs=1e-6)


def test_llama_index_openai_like_embedding(server, client):
    openai_like = pytest.importorskip("llama_index.embeddings.openai_like")
    emb = openai_like.OpenAILikeEmbedding(model_name=MODEL, api_base=server[0] + "/v1", api_key="none",
                                          embed_batch_size=2)
    docs = emb.get_text_embedding_batch(TEXTS[:3])  # two requests: batches of 2 and 1
    query = emb.get_query_embedding(TEXTS[1])
    direct = [d.embedding for d in client.embeddings.create(model=MODEL, input=TEXTS[:3]).data]
    assert len(docs) == 3 and all(a == pytest.approx(b, abs=1e-5) for a, b in zip(docs, direct))
    assert query == pytest.approx(direct[1], abs=1e-5)


def test_bad_requests_get_openai_errors_naming_the_field_and_the_server_serves_on(server, client):
    with pytest.raises(openai.BadRequestError, match="dimensions: the model 'tiny-embed' has no Matryoshka"):
        client.embeddings.create(model=MODEL, input="x", dimensions=8)
    with pytest.raises(openai.BadRequestError, match="more than the model's 64"):
        client.embeddings.create(model=MODEL, input=[5] * 100)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.embeddings.create(model=MODEL, input=[[5, 6], [10 ** 6]])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.embeddings.create(model="other", input="x")
    with pytest.raises(openai.BadRequestError, match="served for the 'embed' task"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="does not generate text"):
        client.completions.create(model=MODEL, prompt="hi")
    assert len(client.embeddings.create(model=MODEL, input="the cat").data) == 1


def test_an_embedding_model_scores_and_reranks_by_cosine(server, client):
    url = server[0]
    vectors = torch.tensor([d.embedding for d in client.embeddings.create(model=MODEL, input=TEXTS[:3]).data])
    cosines = [float(vectors[0] @ vectors[i]) for i in (1, 2)]
    score = httpx.post(url + "/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:3]}).json()
    assert [d["score"] for d in score["data"]] == pytest.approx(cosines, abs=1e-5)
    rerank = httpx.post(url + "/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:3], "top_n": 1}).json()
    best = 1 + max(range(2), key=lambda i: cosines[i])
    assert [(r["index"] + 1, r["document"]["text"]) for r in rerank["results"]] == [(best, TEXTS[best])]


def _metrics(url: str) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    page = httpx.get(url + "/metrics")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    return {(s.name, s.labels.get("finished_reason", "")): s.value
            for f in text_string_to_metric_families(page.text) for s in f.samples}


def test_metrics_count_each_input_as_a_request_under_the_generation_servers_names(server, client):
    before = _metrics(server[0])
    usage = client.embeddings.create(model=MODEL, input=TEXTS[:3]).usage
    after = _metrics(server[0])
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta[("pagoda:prompt_tokens_total", "")] == usage.prompt_tokens
    assert delta[("pagoda:request_success_total", "stop")] == 3
    assert delta[("pagoda:request_success_total", "error")] == 0
    assert delta[("pagoda:e2e_request_latency_seconds_count", "")] == 3
    assert delta[("pagoda:request_queue_time_seconds_count", "")] == 3
    assert delta[("pagoda:engine_steps_total", "")] >= 1 and delta[("pagoda:engine_step_seconds_total", "")] > 0
    assert after[("pagoda:num_requests_running", "")] == after[("pagoda:num_requests_waiting", "")] == 0
    assert ("pagoda:kv_cache_usage_perc", "") not in after  # no KV cache: no name that would mislead
