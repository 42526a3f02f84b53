"""``LoRARequest``: which PEFT adapter a request runs with (the base model when there is none)."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter by name, id and path (vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``).

    ``lora_path`` is a directory saved by PEFT (``adapter_config.json`` and ``adapter_model.safetensors``).
    ``lora_int_id`` (at least 1) identifies the adapter in the engine: requests with equal ids share its
    loaded weights and its prefix-cache blocks, so one id stands for one adapter while it is loaded.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError(f"LoRARequest lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequestError(f"LoRARequest lora_int_id must be an integer of at least 1 (0 is the base "
                                      f"model), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidRequestError(f"LoRARequest lora_path must be the adapter's directory, got {self.lora_path!r}")

    @property
    def cache_key(self) -> tuple:
        """What the prefix cache keys this adapter's blocks by: no hit across adapters, hits within one."""
        return (self.lora_int_id, self.lora_name, self.lora_path)
