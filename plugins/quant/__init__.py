"""Built-in quantization methods, registered through ``pagoda_quant_methods``.

Each factory is ``factory(model_config, quant_config_dict)`` and returns an
object whose ``for_layer(prefix)`` gives the linear method for one layer (or
None to leave it dense). See awq.py, gptq.py, compressed_tensors.py, fp8.py, int8.py, mxfp4.py.
"""

from pagoda import hookimpl


@hookimpl
def pagoda_quant_methods():
    from pagoda.plugins.quant.awq import AWQConfig
    from pagoda.plugins.quant.compressed_tensors import CompressedTensorsConfig
    from pagoda.plugins.quant.fp8 import Fp8Config
    from pagoda.plugins.quant.gptq import GPTQConfig
    from pagoda.plugins.quant.int8 import Int8Config
    from pagoda.plugins.quant.mxfp4 import Mxfp4Config

    return {"awq": AWQConfig, "gptq": GPTQConfig, "compressed-tensors": CompressedTensorsConfig, "fp8": Fp8Config,
            "int8": Int8Config, "mxfp4": Mxfp4Config}
