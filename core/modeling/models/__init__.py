"""Built-in model architectures, registered through ``pagoda_model_architectures``."""

from pagoda import hookimpl


@hookimpl
def pagoda_model_architectures():
    from pagoda.modeling.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
    from pagoda.modeling.models.gpt_oss import GptOssForCausalLM
    from pagoda.modeling.models.granite import GraniteForCausalLM
    from pagoda.modeling.models.llama import LlamaForCausalLM
    from pagoda.modeling.models.mixtral import MixtralForCausalLM
    from pagoda.modeling.models.olmo2 import Olmo2ForCausalLM
    from pagoda.modeling.models.phi3 import Phi3ForCausalLM
    from pagoda.modeling.models.qwen3 import Qwen3ForCausalLM
    from pagoda.modeling.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
    from pagoda.modeling.models.smollm3 import SmolLM3ForCausalLM

    # Mistral and Qwen2 checkpoints differ from Llama only in config switches
    # (sliding window, QKV bias) that LlamaForCausalLM reads from config.json.
    return {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
        "Gemma2ForCausalLM": Gemma2ForCausalLM,
        "Gemma3ForCausalLM": Gemma3ForCausalLM,
        "Olmo2ForCausalLM": Olmo2ForCausalLM,
        "GraniteForCausalLM": GraniteForCausalLM,
        "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
        "Phi3ForCausalLM": Phi3ForCausalLM,
        # Mixture of Experts (pagoda.modeling.layers.moe)
        "MixtralForCausalLM": MixtralForCausalLM,
        "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
        "GptOssForCausalLM": GptOssForCausalLM,
    }
