"""vLLM's engine options that are not pagoda's, so a script's ``LLM(...)`` call and a ``vllm serve`` command line
written for vLLM run on pagoda: each is accepted with one log line saying why it has no effect here, or refused
where accepting it would mislead (a tokenizer or a revision pagoda cannot load).

``LLM(...)`` takes them as keyword arguments (:func:`split_offline_options`); ``pagoda serve`` as flags, whose
notes and checks come from the same table (``pagoda.plugins.entrypoints.cli.vllm_flags``).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from pagoda.errors import ConfigError

logger = logging.getLogger("pagoda")

# the tokenizer modes pagoda's Hugging Face tokenizer loading gives (vLLM's auto is hf for such checkpoints)
TOKENIZER_MODES = ("auto", "hf")
# the revision a local folder is, as far as a revision means anything for one
LOCAL_REVISIONS = (None, "main")

# option -> why it has no effect on pagoda (said when it is given, whatever its value)
NO_EFFECT: dict[str, str] = {
    "trust_remote_code": "pagoda never runs a checkpoint's code; its models are pagoda's own",
    "gpu_memory_utilization": "there is no GPU; --kv-cache-space GiB (or --kv-cache-memory-bytes) sizes the KV cache",
    "download_dir": "pagoda serves local checkpoint folders and downloads nothing",
    "enforce_eager": "pagoda always runs the model eagerly: it captures no CUDA graphs and compiles nothing",
    "max_seq_len_to_capture": "pagoda captures no CUDA graphs",
    "compilation_config": "pagoda compiles no model (no torch.compile, no CUDA graphs)",
    "disable_custom_all_reduce": "--all-reduce-backend picks the all-reduce of tensor-parallel ranks",
    "cpu_offload_gb": "the weights are in CPU memory already",
    "enable_sleep_mode": "there is no GPU memory to give back between requests",
}


def asks_for_something(value: Any) -> bool:
    """Whether an option of :data:`NO_EFFECT` was given a value that asks for anything (not None, off or 0)."""
    return value not in (None, False, 0)


def no_effect_note(option: str, shown: str) -> str:
    """The log line of ``option`` given as ``shown`` (``--enforce-eager``, ``enforce_eager=True``)."""
    return f"{shown} has no effect: {NO_EFFECT[option]}"


def check_tokenizer_and_revisions(tokenizer_mode: Optional[str], revision: Optional[str],
                                  tokenizer_revision: Optional[str], flag_style: bool) -> None:
    """Refuse a tokenizer mode or a revision pagoda cannot give (ConfigError saying what to do instead)."""
    def name(option: str) -> str:
        return "--" + option.replace("_", "-") if flag_style else option

    mode = (tokenizer_mode or "auto").lower()
    if mode not in TOKENIZER_MODES:
        raise ConfigError(f"{name('tokenizer_mode')} {tokenizer_mode}: pagoda loads the checkpoint's Hugging Face "
                          f"tokenizer only (modes {', '.join(TOKENIZER_MODES)}); a checkpoint that ships only another "
                          "format (Mistral's tekken.json) needs a tokenizer.json")
    for option, value in (("revision", revision), ("tokenizer_revision", tokenizer_revision)):
        if value not in LOCAL_REVISIONS:
            raise ConfigError(f"{name(option)} {value}: pagoda serves the checkpoint folder as it is on disk and "
                              "cannot switch it to another revision; check the revision out into a folder and serve "
                              "that")


def split_offline_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``LLM(**kwargs)``'s options without vLLM's that mean nothing here (each logged once, as a warning) and
    without the tokenizer mode and revisions (checked); what is left goes to ``EngineArgs``."""
    kwargs = dict(kwargs)
    for option in NO_EFFECT:
        if option in kwargs:
            value = kwargs.pop(option)
            if asks_for_something(value):
                logger.warning(no_effect_note(option, f"{option}={value!r}"))
    check_tokenizer_and_revisions(kwargs.pop("tokenizer_mode", None), kwargs.pop("revision", None),
                                  kwargs.pop("tokenizer_revision", None), flag_style=False)
    return kwargs
