"""LoRA backends beside the built-in ``torch`` and ``cpu`` ones, registered through ``pagoda_lora_backends``."""

from pagoda.markers import hookimpl


@hookimpl
def pagoda_lora_backends():
    from pagoda.plugins.lora.triton_backend import TritonLoRABackend

    return {"triton": TritonLoRABackend}
