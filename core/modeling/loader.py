"""Built-in weight loaders: ``safetensors`` (HF checkpoint directories) and ``dummy`` (random weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from pagoda import hookimpl
from pagoda.config import ModelConfig
from pagoda.errors import CheckpointError


class SafetensorsLoader:
    """Streams every tensor of ``*.safetensors`` in the model directory into the model."""

    def __init__(self, model_config: ModelConfig) -> None:
        self.model_dir = Path(model_config.model)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import SafetensorError, safe_open

        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"{self.model_dir} has no *.safetensors files; pagoda loads safetensors checkpoints "
                "(convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True))"
            )
        for path in files:
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            except (SafetensorError, OSError, ValueError) as exc:
                raise CheckpointError(f"{path} is not a readable safetensors file ({exc}); re-download or "
                                      "re-convert the checkpoint") from None

    def load_weights(self, model: torch.nn.Module) -> None:
        model.load_weights(self.iter_weights())


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
    return {"safetensors": SafetensorsLoader, "dummy": DummyLoader}
