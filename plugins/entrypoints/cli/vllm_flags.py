"""vLLM's ``serve`` flags that are not engine options, so a deployment's ``vllm serve`` command line runs as
``pagoda serve``.

Each flag is one of three kinds (docs/openai_server.md lists them):

- served: the server does what vLLM does (:func:`frontend_options`, :func:`uvicorn_options`);
- accepted, meaning nothing on pagoda: one start-up log line says why (:func:`notes`);
- refused where accepting would mislead: :func:`check` raises a ``ConfigError`` saying why.
"""

from __future__ import annotations

import argparse
import json
import logging
import ssl

from pagoda.engine.vllm_options import NO_EFFECT, asks_for_something, check_tokenizer_and_revisions, no_effect_note
from pagoda.errors import ConfigError
from pagoda.plugins.entrypoints.server.frontend import CONTENT_FORMATS, FrontendOptions

logger = logging.getLogger("pagoda")


# vLLM's on/off front-end flags, off by default
_SWITCHES = (
    ("--disable-fastapi-docs", "serve no /openapi.json, /docs or /redoc"),
    ("--disable-uvicorn-access-log", "no uvicorn access log lines"),
    ("--enable-request-id-headers", "every response carries X-Request-Id: the request's own, or a new id"),
    ("--enable-server-load-tracking", "GET /load answers {\"server_load\": N}, the completions, chat, responses, "
                                      "embeddings, score and rerank requests in flight (0 without this flag)"),
    ("--return-tokens-as-token-ids", "logprobs name tokens 'token_id:<id>' unless a request says otherwise"),
    ("--enable-force-include-usage", "every stream carries its usage, in each chunk and a chunk of its own at the "
                                     "end, as if stream_options asked for include_usage and continuous_usage_stats"),
    ("--enable-prompt-tokens-details", "accepted: pagoda's usage always has prompt_tokens_details (cached_tokens)"),
)


def add_vllm_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add vLLM's front-end and model-source flags to ``pagoda serve``."""
    front = parser.add_argument_group("vLLM's front-end flags", "served as vLLM serves them")
    front.add_argument("--root-path", default="", metavar="PATH",
                       help="the path prefix a proxy serves this server under (FastAPI's root_path: the OpenAPI "
                            "document and docs name it)")
    front.add_argument("--allowed-origins", type=_json_list("--allowed-origins"), default=[], metavar="JSON",
                       help="CORS: the origins browsers may call from, a JSON list ('[\"*\"]' for any; default: "
                            "none, no CORS headers)")
    front.add_argument("--allowed-methods", type=_json_list("--allowed-methods"), default=["*"], metavar="JSON",
                       help="CORS: the methods allowed, a JSON list (default [\"*\"])")
    front.add_argument("--allowed-headers", type=_json_list("--allowed-headers"), default=["*"], metavar="JSON",
                       help="CORS: the request headers allowed, a JSON list (default [\"*\"])")
    front.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)")
    front.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="serve HTTPS with this private key")
    front.add_argument("--ssl-certfile", default=None, metavar="PATH", help="serve HTTPS with this certificate")
    front.add_argument("--ssl-ca-certs", default=None, metavar="PATH",
                       help="the CA certificates client certificates are checked against")
    front.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), choices=[0, 1, 2],
                       help="client certificates: 0 not asked for, 1 optional, 2 required (Python's ssl.CERT_*)")
    for flag, help_text in _SWITCHES:
        front.add_argument(flag, action="store_true", help=help_text)
    front.add_argument("--response-role", default="assistant",
                       help="the role of a chat answer to a request with add_generation_prompt (default "
                            "%(default)s); without it, the last message's role")
    front.add_argument("--chat-template-content-format", default="auto", choices=CONTENT_FORMATS,
                       help="how message content reaches the chat template: string, or openai (a list of "
                            "{\"type\": \"text\", \"text\": ...} parts); auto: openai when the template loops over a "
                            "message's content, else string")
    front.add_argument("--enable-log-requests", action="store_true", default=None,
                       help="log each request's prompt, prompt token ids and sampling parameters")
    front.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false", default=None,
                       help="log no request (the default; vLLM's older spelling)")
    front.add_argument("--enable-log-outputs", action="store_true",
                       help="also log each choice's output, token ids and finish reason when it ends (needs "
                            "--enable-log-requests)")
    front.add_argument("--max-log-len", type=int, default=None, metavar="N",
                       help="characters of a prompt or output, and token ids, a log line shows (default: all)")

    source = parser.add_argument_group("vLLM's model-source flags", "pagoda serves local checkpoint folders")
    source.add_argument("--tokenizer-mode", default="auto", metavar="MODE",
                        help="auto or hf: the checkpoint's Hugging Face tokenizer (vLLM's other modes are refused)")
    source.add_argument("--revision", default=None, help="only main (a local folder has no other revision)")
    source.add_argument("--tokenizer-revision", default=None, help="only main, as --revision")
    source.add_argument("--download-dir", default=None, metavar="DIR",
                        help="accepted: pagoda reads local folders and downloads nothing")
    source.add_argument("--trust-remote-code", action="store_true",
                        help="accepted: pagoda never runs a checkpoint's code")
    source.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                        help="accepted: there is no GPU; the KV cache is sized by --kv-cache-space or "
                             "--kv-cache-memory-bytes")
    source.add_argument("--enforce-eager", action="store_true",
                        help="accepted: pagoda always runs the model eagerly (no CUDA graphs, no compile)")
    source.add_argument("--max-seq-len-to-capture", type=int, default=None, metavar="N",
                        help="accepted: pagoda captures no CUDA graphs")
    source.add_argument("--compilation-config", "-O", default=None, metavar="CONFIG",
                        help="accepted: pagoda compiles no model")
    source.add_argument("--disable-custom-all-reduce", action="store_true",
                        help="accepted: --all-reduce-backend picks the ranks' all-reduce")
    source.add_argument("--cpu-offload-gb", type=float, default=None, metavar="GB",
                        help="accepted: the weights are in CPU memory already")
    source.add_argument("--enable-sleep-mode", action="store_true",
                        help="accepted: there is no GPU memory to give back")
    source.add_argument("--guided-decoding-backend", default=None, metavar="NAME",
                        help="vLLM's older name of --structured-outputs-backend")
    source.add_argument("--structured-outputs-config", type=_json_object, default=None, metavar="JSON",
                        help="vLLM's structured outputs settings: its \"backend\" is --structured-outputs-backend; "
                             "its other keys are accepted and logged as not applying")


def _json_list(flag: str):
    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"*\"]', got {text!r}")
        return value

    parse.__name__ = flag
    return parse


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"backend\": \"xgrammar\"}}', got "
                                         f"{text!r}")
    return value


def check(ns: argparse.Namespace) -> None:
    """Refuse what pagoda cannot do as asked, before the model loads; fold vLLM's structured outputs flags into
    ``--structured-outputs-backend``."""
    check_tokenizer_and_revisions(ns.tokenizer_mode, ns.revision, ns.tokenizer_revision, flag_style=True)
    if ns.enable_log_outputs and not ns.enable_log_requests:
        raise ConfigError("--enable-log-outputs logs the outputs of logged requests: add --enable-log-requests")
    if ns.max_log_len is not None and ns.max_log_len < 0:
        raise ConfigError(f"--max-log-len {ns.max_log_len}: give a number of characters >= 0, or leave it out")
    if not ns.response_role:
        raise ConfigError("--response-role is empty; give a role name such as assistant")
    if ns.root_path and (not ns.root_path.startswith("/") or ns.root_path.endswith("/")):
        raise ConfigError(f"--root-path {ns.root_path!r}: give a path such as /llm (a leading /, no trailing /)")
    if bool(ns.ssl_keyfile) != bool(ns.ssl_certfile):
        raise ConfigError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    if (ns.ssl_ca_certs or ns.ssl_cert_reqs) and not ns.ssl_certfile:
        raise ConfigError("--ssl-ca-certs and --ssl-cert-reqs are for HTTPS: add --ssl-keyfile and --ssl-certfile")
    backend = _structured_outputs_backend(ns)
    if backend is not None:
        if ns.structured_outputs_backend not in (None, backend):
            raise ConfigError(f"--structured-outputs-backend {ns.structured_outputs_backend} and vLLM's structured "
                              f"outputs flags ({backend}) disagree; give one of them")
        ns.structured_outputs_backend = backend


def _structured_outputs_backend(ns: argparse.Namespace):
    backends = {b for b in (ns.guided_decoding_backend, (ns.structured_outputs_config or {}).get("backend"))
                if b is not None}
    if len(backends) > 1:
        raise ConfigError(f"--guided-decoding-backend and --structured-outputs-config name different backends "
                          f"({', '.join(sorted(backends))}); give one")
    return backends.pop() if backends else None


def notes(ns: argparse.Namespace) -> list[str]:
    """One line per flag given that pagoda accepts without effect, saying why."""
    lines = []
    for option in NO_EFFECT:  # each one a flag of add_vllm_serve_args
        value = getattr(ns, option)
        if not asks_for_something(value):
            continue
        flag = "--" + option.replace("_", "-")
        shown = flag if value is True else f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
        lines.append(no_effect_note(option, shown))
    if ns.enable_prompt_tokens_details:
        lines.append("--enable-prompt-tokens-details has no effect: pagoda's usage always carries "
                     "prompt_tokens_details.cached_tokens")
    others = sorted(set(ns.structured_outputs_config or {}) - {"backend"})
    if others:
        lines.append(f"--structured-outputs-config: {', '.join(others)} have no effect on pagoda (only backend "
                     "applies, as --structured-outputs-backend)")
    return lines


def frontend_options(ns: argparse.Namespace) -> FrontendOptions:
    """The server switches the flags set."""
    return FrontendOptions(
        root_path=ns.root_path, allowed_origins=tuple(ns.allowed_origins), allowed_methods=tuple(ns.allowed_methods),
        allowed_headers=tuple(ns.allowed_headers), allow_credentials=ns.allow_credentials,
        enable_request_id_headers=ns.enable_request_id_headers,
        enable_server_load_tracking=ns.enable_server_load_tracking, disable_fastapi_docs=ns.disable_fastapi_docs,
        response_role=ns.response_role, chat_template_content_format=ns.chat_template_content_format,
        return_tokens_as_token_ids=ns.return_tokens_as_token_ids,
        enable_force_include_usage=ns.enable_force_include_usage, enable_log_requests=bool(ns.enable_log_requests),
        enable_log_outputs=ns.enable_log_outputs, max_log_len=ns.max_log_len)


def uvicorn_options(ns: argparse.Namespace) -> dict:
    """uvicorn's settings the flags set: TLS and the access log."""
    options: dict = {"access_log": not ns.disable_uvicorn_access_log}
    if ns.ssl_certfile:
        options.update(ssl_keyfile=ns.ssl_keyfile, ssl_certfile=ns.ssl_certfile, ssl_ca_certs=ns.ssl_ca_certs,
                       ssl_cert_reqs=ns.ssl_cert_reqs)
    return options


# the front-end switches of text generation's answers, which a pooling model's server has none of
GENERATION_ONLY = ("--response-role", "--chat-template-content-format", "--return-tokens-as-token-ids",
                   "--enable-force-include-usage", "--enable-log-requests", "--enable-log-outputs", "--max-log-len")


def pooling_notes(ns: argparse.Namespace) -> list[str]:
    """A line naming the flags given that only text generation's answers read, for a pooling model's server."""
    given = [flag for flag in given_frontend_flags(ns) if flag in GENERATION_ONLY]
    if not given:
        return []
    return [f"{', '.join(given)} have no effect on a pooling model's server: they set text generation's answers"]


def given_frontend_flags(ns: argparse.Namespace) -> list[str]:
    """The served front-end flags given other than at their defaults (the replica router serves none yet)."""
    defaults, given = FrontendOptions(), frontend_options(ns)
    names = [f"--{name.replace('_', '-')}" for name in FrontendOptions.__dataclass_fields__
             if getattr(given, name) != getattr(defaults, name)]
    if ns.ssl_certfile:
        names.append("--ssl-certfile")
    if ns.disable_uvicorn_access_log:
        names.append("--disable-uvicorn-access-log")
    return names
