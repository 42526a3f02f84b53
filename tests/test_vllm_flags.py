"""vLLM's ``serve`` flags on ``pagoda serve``: a real-world ``vllm serve`` command line parses; the flags pagoda
serves work on a real uvicorn server on 127.0.0.1 (CORS, root path, docs off, X-Request-Id, /load, the response
role, the content format, token ids in logprobs, usage in every stream, request and output logging, the logprobs
limit); a deployment's YAML ``--config`` file with HTTPS runs as ``pagoda serve`` in its own process, its flags
under the command line's; the flags that mean nothing here are accepted with a warning saying why; the ones
pagoda cannot honour are refused with a message saying why."""

from __future__ import annotations

import logging
import shutil
import ssl
import subprocess
import threading
import time

import httpx
import openai
import pytest

from pagoda.cli import build_parser, expand_config_file
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.errors import ConfigError
from pagoda.plugins.entrypoints.cli import vllm_flags
from pagoda.plugins.entrypoints.server import ServerThread, build_app, free_port
from pagoda.plugins.entrypoints.server.frontend import (FrontendOptions, resolve_content_format,
                                                       template_loops_over_content)
from serve_process import ENV, PAGODA, run_pagoda_here
from tiny_models import tiny_llm, write_tiny_checkpoint

ORIGIN = "https://chat.example.com"
CHAT = [{"role": "user", "content": "Hi there"}]
# a template that takes message content as OpenAI's list of parts
PARTS_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{% for part in m['content'] %}[{{ part.text }}]{% endfor %}"
                  "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))  # with the default model's chat template


@pytest.fixture(scope="module")
def server(checkpoint):
    llm = tiny_llm(checkpoint, max_logprobs=3, chat_template=PARTS_TEMPLATE)
    frontend = FrontendOptions(
        root_path="/llm", allowed_origins=(ORIGIN,), enable_request_id_headers=True,
        enable_server_load_tracking=True, disable_fastapi_docs=True, response_role="bot",
        chat_template_content_format="auto", return_tokens_as_token_ids=True, enable_force_include_usage=True,
        enable_log_requests=True, enable_log_outputs=True, max_log_len=4)
    srv = ServerThread(build_app(AsyncLLMEngine(llm.engine), frontend=frontend)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/llm/v1", api_key="none", max_retries=0, timeout=60)


def parse(*argv: str):
    parser = build_parser()
    return parser.parse_args(expand_config_file(parser, list(argv)))


# ---- the command line ----

def test_a_real_world_vllm_serve_command_line_parses_and_sets_every_flag(checkpoint):
    ns = parse(
        "serve", str(checkpoint), "--host", "0.0.0.0", "--port", "8080", "--gpu-memory-utilization", "0.9",
        "--trust-remote-code", "--max-logprobs", "20", "--disable-log-requests", "--root-path", "/llm",
        "--allowed-origins", '["*"]', "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["*"]',
        "--allow-credentials", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--ssl-ca-certs", "ca.pem",
        "--ssl-cert-reqs", "2", "--return-tokens-as-token-ids", "--enable-prompt-tokens-details",
        "--enable-force-include-usage", "--enable-server-load-tracking", "--disable-fastapi-docs",
        "--disable-uvicorn-access-log", "--enable-request-id-headers", "--response-role", "assistant",
        "--chat-template-content-format", "string", "--logprobs-mode", "raw_logprobs", "--tokenizer-mode", "auto",
        "--revision", "main", "--tokenizer-revision", "main", "--download-dir", "/models",
        "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}',
        "--max-log-len", "100", "--max-model-len", "256", "--max-num-seqs", "64", "--dtype", "bfloat16",
        "--served-model-name", "tiny", "--enable-prefix-caching", "--uvicorn-log-level", "warning")
    vllm_flags.check(ns)
    assert ns.model_tag == str(checkpoint) and ns.max_logprobs == 20 and ns.logprobs_mode == "raw_logprobs"
    assert ns.structured_outputs_backend == "xgrammar"  # vLLM's structured outputs config, folded in
    frontend = vllm_flags.frontend_options(ns)
    assert frontend.allowed_origins == ("*",) and frontend.allowed_methods == ("GET", "POST")
    assert frontend.allow_credentials and frontend.root_path == "/llm" and frontend.disable_fastapi_docs
    assert frontend.enable_log_requests is False and frontend.enable_force_include_usage
    assert vllm_flags.uvicorn_options(ns) == {"access_log": False, "ssl_keyfile": "k.pem", "ssl_certfile": "c.pem",
                                              "ssl_ca_certs": "ca.pem", "ssl_cert_reqs": 2}
    notes = "\n".join(vllm_flags.notes(ns))
    for flag in ("--trust-remote-code", "--gpu-memory-utilization 0.9", "--download-dir /models",
                 "--enable-prompt-tokens-details", "disable_any_whitespace"):
        assert flag in notes


def test_a_yaml_config_file_sets_flags_and_the_command_line_wins(checkpoint, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {checkpoint}\nport: 9000\nmax-logprobs: 5\ntrust-remote-code: true\n"
                      "enable-prefix-caching: false\nallowed-origins: ['https://a.example']\n"
                      "speculative_config: {method: ngram, num_speculative_tokens: 2}\n")
    ns = parse("serve", "--config", str(config), "--max-logprobs", "7")
    assert (ns.model, ns.port, ns.max_logprobs, ns.trust_remote_code) == (str(checkpoint), 9000, 7, True)
    assert ns.enable_prefix_caching is False and ns.allowed_origins == ["https://a.example"]
    assert ns.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    # a model named on the command line wins over the file's
    ns = parse("serve", "other-model", "--config", str(config))
    assert ns.model_tag == "other-model" and ns.model is None and ns.port == 9000
    config.write_text("no-such-flag: 1\n")
    with pytest.raises(Exception, match="'no-such-flag' is not a flag of this command"):
        parse("serve", "--config", str(config))


@pytest.mark.parametrize("flags, message", [
    (["--tokenizer-mode", "mistral"], "--tokenizer-mode mistral: pagoda loads the checkpoint's Hugging Face"),
    (["--revision", "v2.0"], "--revision v2.0: pagoda serves the checkpoint folder as it is on disk"),
    (["--tokenizer-revision", "abc123"], "--tokenizer-revision abc123: pagoda serves the checkpoint folder"),
    (["--enable-log-outputs"], "--enable-log-outputs logs the outputs of logged requests: add --enable-log-requests"),
    (["--ssl-certfile", "c.pem"], "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
    (["--root-path", "llm/"], "--root-path 'llm/': give a path such as /llm"),
    (["--guided-decoding-backend", "guidance", "--structured-outputs-backend", "xgrammar"], "disagree"),
])
def test_flags_pagoda_cannot_honour_are_refused_before_the_model_loads(checkpoint, capsys, flags, message):
    done = run_pagoda_here(capsys, "serve", str(checkpoint), *flags)
    assert done.returncode == 2 and message in done.stderr


def test_flags_without_effect_are_logged_before_the_engine_config_is_checked(checkpoint, capsys, caplog):
    with caplog.at_level(logging.INFO, logger="pagoda"):  # a length past the model's positions ends the start
        done = run_pagoda_here(capsys, "serve", str(checkpoint), "--load-format", "dummy", "--trust-remote-code",
                               "--gpu-memory-utilization", "0.85", "--download-dir", "/data",
                               "--logprobs-mode", "processed_logprobs", "--max-model-len", "1000000")
    assert done.returncode == 2 and "max_model_len 1000000 exceeds the model's" in done.stderr
    logged = caplog.text
    assert "--trust-remote-code has no effect: pagoda never runs a checkpoint's code" in logged
    assert "--gpu-memory-utilization 0.85 has no effect: there is no GPU; --kv-cache-space" in logged
    assert "--download-dir /data has no effect: pagoda serves local checkpoint folders" in logged


def test_the_content_format_auto_follows_what_the_template_loops_over():
    looping = "{% for m in messages %}{% for part in m['content'] %}{{ part.text }}{% endfor %}{% endfor %}"
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert template_loops_over_content(looping) and not template_loops_over_content(plain)
    assert resolve_content_format("auto", looping) == "openai" and resolve_content_format("auto", plain) == "string"
    assert resolve_content_format("string", looping) == "string" and resolve_content_format("openai", plain) == "openai"


# ---- a server with the flags on ----

def test_cors_answers_an_allowed_origin_and_not_another(server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    ok = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(server.url + "/v1/chat/completions", headers=dict(preflight, Origin="https://evil.example"))
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    simple = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN


def test_root_path_prefix_and_docs_routes_off(server):
    assert httpx.get(server.url + "/llm/v1/models").status_code == 200  # a proxy that keeps the prefix
    assert httpx.get(server.url + "/v1/models").status_code == 200  # one that strips it
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(server.url + path).status_code == 404


def test_request_id_header_is_echoed_or_made(server):
    echoed = httpx.get(server.url + "/v1/models", headers={"X-Request-Id": "trace-42"})
    assert echoed.headers["x-request-id"] == "trace-42"
    made = httpx.get(server.url + "/health").headers["x-request-id"]
    assert len(made) == 32 and int(made, 16) >= 0


def test_load_counts_a_stream_in_flight(server):
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}
    body = {"model": _model(server), "prompt": "Hello", "max_tokens": 250, "stream": True, "ignore_eos": True}
    reader = threading.Thread(target=lambda: httpx.post(server.url + "/llm/v1/completions", json=body, timeout=60))
    reader.start()
    seen = set()
    while reader.is_alive():
        seen.add(httpx.get(server.url + "/llm/load").json()["server_load"])
    reader.join()
    assert 1 in seen and httpx.get(server.url + "/load").json() == {"server_load": 0}


def _model(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def test_response_role_and_the_detected_content_format_reach_the_answer_and_the_template(client, server):
    model = _model(server)
    resp = client.chat.completions.create(model=model, messages=CHAT, max_tokens=2,
                                          extra_body={"return_prompt_text": True})
    assert resp.choices[0].message.role == "bot"
    # auto: the template loops over content, so content reaches it as OpenAI's list of parts
    assert resp.model_extra["prompt_text"] == "<user>[Hi there]<assistant>"
    first = next(iter(client.chat.completions.create(model=model, messages=CHAT, max_tokens=2, stream=True)))
    assert first.choices[0].delta.role == "bot"
    # without a new turn the answer continues the last message, and has its role
    cont = client.chat.completions.create(model=model, messages=CHAT + [{"role": "assistant", "content": "Hel"}],
                                          max_tokens=2, extra_body={"add_generation_prompt": False,
                                                                    "continue_final_message": True})
    assert cont.choices[0].message.role == "assistant"


def test_every_stream_carries_usage_and_logprobs_name_token_ids(client, server):
    chunks = list(client.chat.completions.create(model=_model(server), messages=CHAT, max_tokens=3, stream=True,
                                                 logprobs=True, top_logprobs=2))
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].choices == []
    # as on vLLM, every chunk carries the usage so far too
    so_far = [c.usage.completion_tokens for c in chunks[:-1]]
    assert so_far == sorted(so_far) and so_far[-1] == 3 and all(c.usage.prompt_tokens for c in chunks)
    tokens = [t.token for c in chunks[:-1] for t in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    assert tokens and all(t.startswith("token_id:") for t in tokens)
    plain = client.completions.create(model=_model(server), prompt="Hello", max_tokens=2, logprobs=1,
                                      extra_body={"return_tokens_as_token_ids": False})
    assert not any(t.startswith("token_id:") for t in plain.choices[0].logprobs.tokens)


def test_logprobs_beyond_max_logprobs_are_a_400_naming_the_limit(client, server):
    with pytest.raises(openai.BadRequestError, match=r"more than this server's limit of 3 \(--max-logprobs\)"):
        client.completions.create(model=_model(server), prompt="Hello", max_tokens=1, logprobs=4)
    with pytest.raises(openai.BadRequestError, match="limit of 3"):
        client.chat.completions.create(model=_model(server), messages=CHAT, max_tokens=1, logprobs=True,
                                       top_logprobs=4)
    ok = client.completions.create(model=_model(server), prompt="Hello", max_tokens=1, logprobs=3)
    assert len(ok.choices[0].logprobs.top_logprobs[0]) >= 3


def test_requests_and_outputs_are_logged_cut_to_max_log_len(client, server, caplog):
    with caplog.at_level(logging.INFO, logger="pagoda.requests"):
        resp = client.completions.create(model=_model(server), prompt="Hello world", max_tokens=3,
                                         extra_body={"request_id": "logme", "ignore_eos": True})
    lines = [r.getMessage() for r in caplog.records if r.name == "pagoda.requests"]
    received = next(line for line in lines if line.startswith("request cmpl-logme-0 received"))
    assert "prompt 'Hell'" in received and "max_tokens=3" in received
    finished = next(line for line in lines if line.startswith("request cmpl-logme-0 choice 0 finished (length)"))
    assert repr(resp.choices[0].text[:4]) in finished


# ---- HTTPS ----

def _self_signed(tmp_path):
    """A key and a self-signed certificate for 127.0.0.1, made with the cryptography package, else openssl."""
    key_path, cert_path = tmp_path / "key.pem", tmp_path / "cert.pem"
    try:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor openssl is installed to make a certificate")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(key_path), "-out", str(cert_path), "-days", "1", "-subj",
                        "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
        return key_path, cert_path
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


@pytest.mark.slow
def test_pagoda_serve_runs_a_vllm_deployment_config_over_https(checkpoint, tmp_path):
    """The whole path as a deployment runs it: `pagoda serve MODEL --config FILE` in its own process, the file's
    flags under the command line's."""
    key, cert = _self_signed(tmp_path)
    port, log = free_port(), tmp_path / "serve.log"
    config = tmp_path / "deploy.yaml"
    config.write_text(f"port: {port}\nload-format: dummy\nkv-cache-memory-bytes: 4194304\nmax-logprobs: 5\n"
                      f"ssl-keyfile: {key}\nssl-certfile: {cert}\ntrust-remote-code: true\n"
                      "gpu-memory-utilization: 0.9\nallowed-origins: ['*']\nenable-request-id-headers: true\n"
                      "disable-uvicorn-access-log: true\n")
    with open(log, "w") as out:
        proc = subprocess.Popen([PAGODA, "serve", str(checkpoint), "--config", str(config), "--max-logprobs", "2"],
                                stdout=out, stderr=subprocess.STDOUT, env=ENV)
    url = f"https://127.0.0.1:{port}"
    try:
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=60) as https:
            deadline = time.monotonic() + 120
            while not _answers(https, url + "/health"):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.3)
            model = https.get(url + "/v1/models").json()["data"][0]["id"]
            answer = https.post(url + "/v1/completions", headers={"Origin": "https://app.example"},
                                json={"model": model, "prompt": "Hi", "max_tokens": 2, "logprobs": 2})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
            assert answer.headers["access-control-allow-origin"] == "*" and len(answer.headers["x-request-id"]) == 32
            refused = https.post(url + "/v1/completions", json={"model": model, "prompt": "Hi", "logprobs": 3})
            assert refused.status_code == 400 and "limit of 2 (--max-logprobs)" in refused.text
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not answered
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        proc.terminate()
        proc.wait(30)
    logged = log.read_text()
    assert "--trust-remote-code has no effect" in logged and "--gpu-memory-utilization 0.9 has no effect" in logged
    assert f"on https://127.0.0.1:{port}" in logged
    assert "POST /v1/completions" not in logged  # no access log


def _answers(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def test_config_file_flag_is_listed_in_serve_help(capsys):
    done = run_pagoda_here(capsys, "serve", "--help")
    assert "--config FILE" in done.stdout and "--allowed-origins JSON" in done.stdout



def test_vllm_s_no_effect_engine_flags_parse_and_each_says_why(checkpoint):
    ns = parse("serve", str(checkpoint), "--enforce-eager", "--max-seq-len-to-capture", "8192", "-O3",
               "--disable-custom-all-reduce", "--cpu-offload-gb", "4", "--enable-sleep-mode")
    vllm_flags.check(ns)
    notes = "\n".join(vllm_flags.notes(ns))
    for line in ("--enforce-eager has no effect: pagoda always runs the model eagerly",
                 "--max-seq-len-to-capture 8192 has no effect: pagoda captures no CUDA graphs",
                 "--compilation-config 3 has no effect: pagoda compiles no model",
                 "--disable-custom-all-reduce has no effect: --all-reduce-backend picks",
                 "--cpu-offload-gb 4 has no effect: the weights are in CPU memory already",
                 "--enable-sleep-mode has no effect"):
        assert line in notes, notes


def test_a_vllm_script_s_llm_options_run_with_a_warning_each(checkpoint, caplog):
    from pagoda import LLM

    with caplog.at_level(logging.WARNING, logger="pagoda"):
        llm = LLM(model=str(checkpoint), load_format="dummy", dtype="float32", max_model_len=128,
                  kv_cache_memory_bytes=4 << 20, trust_remote_code=True, gpu_memory_utilization=0.9,
                  enforce_eager=True, tokenizer_mode="auto", revision="main", cpu_offload_gb=0)
    llm.engine.shutdown()
    assert "trust_remote_code=True has no effect: pagoda never runs a checkpoint's code" in caplog.text
    assert "gpu_memory_utilization=0.9 has no effect: there is no GPU" in caplog.text
    assert "enforce_eager=True has no effect" in caplog.text and "cpu_offload_gb" not in caplog.text
    with pytest.raises(ConfigError, match="^revision v2: pagoda serves the checkpoint folder as it is on disk"):
        LLM(model=str(checkpoint), load_format="dummy", revision="v2")
    with pytest.raises(ConfigError, match="^tokenizer_mode mistral: pagoda loads the checkpoint's Hugging Face"):
        LLM(model=str(checkpoint), load_format="dummy", tokenizer_mode="mistral")
    with pytest.raises(ConfigError, match="unknown option 'swap_spaces'"):  # a typo is still refused
        LLM(model=str(checkpoint), load_format="dummy", swap_spaces=4)


def test_llm_engine_and_reset_prefix_cache_are_there_under_vllm_s_names(checkpoint):
    from pagoda import LLM, SamplingParams

    llm = LLM(model=str(checkpoint), load_format="dummy", dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=4 << 20)
    try:
        assert llm.llm_engine is llm.engine
        prompt = {"prompt_token_ids": list(range(100, 150))}  # three full blocks of 16 and a part
        params = SamplingParams(max_tokens=1)
        llm.generate(prompt, params)
        assert llm.generate(prompt, params)[0].num_cached_tokens == 48
        assert llm.reset_prefix_cache() is True
        assert llm.generate(prompt, params)[0].num_cached_tokens == 0
    finally:
        llm.shutdown()
