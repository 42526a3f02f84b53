"""Built-in weight loaders: ``safetensors`` (HF checkpoint directories), ``pt`` (their PyTorch files, for
checkpoints published before safetensors) and ``dummy`` (random weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from pagoda import hookimpl
from pagoda.config import ModelConfig
from pagoda.errors import CheckpointError


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the ``*.safetensors`` files of a checkpoint directory, by name."""
    from safetensors import SafetensorError, safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{model_dir} has no *.safetensors files; pass --load-format pt for a checkpoint of PyTorch "
            "files (pytorch_model*.bin, *.pt), or auto to take what the directory has"
        )
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file ({exc}); re-download or "
                                  "re-convert the checkpoint") from None


def iter_pt(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the PyTorch weight files of a checkpoint directory (:func:`pt_files`), by name, one file at
    a time, memory-mapped, tensors only."""
    files = pt_files(model_dir)
    if not files:
        raise CheckpointError(f"{model_dir} has no PyTorch weight files (pytorch_model*.bin, *.pt); pass "
                              "--load-format safetensors for a safetensors checkpoint, or auto")
    for path in files:
        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - unpickling, zip and I/O errors alike: the file is unusable
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise CheckpointError(f"{path} is not a readable PyTorch weight file ({type(exc).__name__}: "
                                  f"{first}); re-download or re-convert the checkpoint") from None
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
        if not isinstance(state, dict):
            raise CheckpointError(f"{path} holds a {type(state).__name__}, not a dictionary of tensors")
        for name, tensor in state.items():
            if isinstance(tensor, torch.Tensor):
                yield name, tensor
        del state


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint directory, from the files :func:`auto_load_format` picks."""
    return iter_pt(model_dir) if auto_load_format(model_dir) == "pt" else iter_safetensors(model_dir)


class SafetensorsLoader:
    """Streams every tensor of ``*.safetensors`` in the model directory into the model."""

    def __init__(self, model_config: ModelConfig) -> None:
        self.model_dir = Path(model_config.model)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_safetensors(self.model_dir)

    def load_weights(self, model: torch.nn.Module) -> None:
        model.load_weights(self.iter_weights())


def pt_files(model_dir: Path) -> list[Path]:
    """The PyTorch weight files of a checkpoint directory: the shards its ``pytorch_model.bin.index.json`` lists,
    else ``pytorch_model*.bin``, else ``*.pt``; empty when it has none."""
    index = model_dir / "pytorch_model.bin.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a checkpoint index ({type(exc).__name__}: {exc}); re-download "
                                  "the checkpoint") from None
        return [model_dir / name for name in names]
    return sorted(model_dir.glob("pytorch_model*.bin")) or sorted(model_dir.glob("*.pt"))


class PtLoader:
    """Streams the tensors of a checkpoint's PyTorch files (``pytorch_model*.bin``, ``*.pt``: see :func:`pt_files`)
    into the model, one file at a time, memory-mapped. Only tensors are read (``torch.load(weights_only=True)``): a
    file that holds code to run is refused, not run."""

    def __init__(self, model_config: ModelConfig) -> None:
        self.model_dir = Path(model_config.model)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_pt(self.model_dir)

    def load_weights(self, model: torch.nn.Module) -> None:
        model.load_weights(self.iter_weights())


def auto_load_format(model_dir: Path) -> str:
    """``auto``'s loader for a checkpoint directory: ``safetensors`` when it has such files, else ``pt`` when it
    has PyTorch weight files, else ``safetensors`` (whose error then says what is missing)."""
    if any(model_dir.glob("*.safetensors")):
        return "safetensors"
    return "pt" if model_dir.is_dir() and pt_files(model_dir) else "safetensors"


class DummyLoader:
    """Random weights of the right shapes, for benchmarks and tests without a checkpoint."""

    def __init__(self, model_config: ModelConfig) -> None:
        self.seed = model_config.seed

    def load_weights(self, model: torch.nn.Module) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.data.fill_(1.0)
            else:
                param.data.copy_(torch.randn(param.shape, generator=gen) * 0.02)
        for module in model.modules():
            if hasattr(module, "process_weights_after_loading") and module is not model:
                module.process_weights_after_loading()


@hookimpl
def pagoda_model_loaders():
    return {"safetensors": SafetensorsLoader, "pt": PtLoader, "dummy": DummyLoader}
