"""What a checkpoint's ``generation_config.json`` asks of generation: the tokens that end a sequence, and the
sampling settings its authors recommend (Qwen3's temperature 0.6, top_p 0.95, top_k 20; Llama 3's temperature 0.6,
top_p 0.9), which become the defaults of requests that do not set them.

``--generation-config auto`` (the default) reads the model's folder, ``none`` (or ``vllm``, vLLM's name for it)
keeps pagoda's own defaults (temperature 1, top_p 1, no top_k), a folder path reads that folder's file;
``--override-generation-config '{"temperature": 0.5}'`` sets or replaces settings on top.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

from pagoda.errors import ConfigError

logger = logging.getLogger("pagoda.engine")

# generation_config.json's keys a request's sampling takes as defaults (max_new_tokens becomes max_tokens), with
# the value transformers writes for a key it was not given: such a value is no recommendation and is not applied
SAMPLING_KEYS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0,
                 "max_new_tokens": None}
# the names --generation-config takes besides a folder
SOURCES = ("auto", "none", "vllm")


def read_generation_config(folder: Path) -> dict[str, Any]:
    """``folder/generation_config.json`` as a dict ({} when the folder has none); a file that is not a JSON
    object is a ConfigError naming it."""
    path = Path(folder, "generation_config.json")
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); fix the file, or pass --generation-config none to "
                          "ignore it") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds a {type(data).__name__}, not a JSON object; fix the file, or pass "
                          "--generation-config none to ignore it")
    return data


def sampling_defaults(model_dir: Path, source: str, overrides: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The sampling settings requests take when they do not set them, as ``SamplingParams`` fields
    (``max_tokens`` for generation_config's ``max_new_tokens``). Each value is checked here: a bad one is a
    ConfigError at start-up naming the file or flag, not a 400 on every request."""
    from pagoda.sampling_params import SamplingParams

    if source in ("none", "vllm"):
        found: dict[str, Any] = {}
        where = "--override-generation-config"
    else:
        folder = model_dir if source == "auto" else Path(source).expanduser()
        if source != "auto" and not folder.is_dir():
            raise ConfigError(f"--generation-config {source!r} is neither auto, none nor a folder; pass auto (the "
                              "model's generation_config.json), none (pagoda's defaults) or a folder holding one")
        config = read_generation_config(folder)
        found = {key: config[key] for key, unset in SAMPLING_KEYS.items()
                 if config.get(key) is not None and config[key] != unset}
        where = f"{folder}/generation_config.json"
    for key, value in (overrides or {}).items():
        if key not in SAMPLING_KEYS:
            raise ConfigError(f"--override-generation-config sets {key!r}; it takes {', '.join(SAMPLING_KEYS)}")
        found[key] = value
    if overrides and source not in ("none", "vllm"):
        where += " and --override-generation-config"
    defaults = {("max_tokens" if key == "max_new_tokens" else key): value for key, value in found.items()}
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"the sampling defaults {defaults} (from {where}) are invalid: {exc}; fix them, or pass "
                          "--generation-config none") from None
    if defaults:
        logger.info("requests that do not set them sample with %s (from %s; --generation-config none keeps "
                    "pagoda's own defaults)", defaults, where)
    return defaults


def eos_token_ids(model_dir: str, tokenizer: Any) -> list[int]:
    """The tokens that end a sequence: every ``eos_token_id`` of the model's generation_config.json (a list for
    chat models whose turns end with their own token: Llama 3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``,
    gpt-oss's ``<|return|>`` and ``<|call|>``), then the tokenizer's, each once."""
    eos = read_generation_config(Path(model_dir)).get("eos_token_id")
    ids = [int(t) for t in (eos if isinstance(eos, list) else [eos]) if t is not None]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    return ids
