"""Built-in attention backends, registered through ``pagoda_attention_backends``."""

from pagoda import hookimpl


@hookimpl
def pagoda_attention_backends():
    from pagoda.plugins.attention.cpu_backend import CpuAttentionBackend
    from pagoda.plugins.attention.cuda_backend import CudaAttentionBackend
    from pagoda.plugins.attention.torch_backend import TorchAttentionBackend
    from pagoda.plugins.attention.triton_backend import TritonAttentionBackend

    return {
        "torch": TorchAttentionBackend,
        "cpu": CpuAttentionBackend,
        "triton": TritonAttentionBackend,
        "cuda": CudaAttentionBackend,
    }
