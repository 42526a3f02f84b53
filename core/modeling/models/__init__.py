"""Built-in model architectures, registered through ``pagoda_model_architectures``."""

from pagoda.markers import hookimpl


@hookimpl
def pagoda_model_architectures():
    from pagoda.modeling.models.gpt_oss import GptOssForCausalLM
    from pagoda.modeling.models.llama import LlamaForCausalLM
    from pagoda.modeling.models.mixtral import MixtralForCausalLM
    from pagoda.modeling.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

    # Mistral and Qwen2 checkpoints differ from Llama only in config switches
    # (sliding window, QKV bias) that LlamaForCausalLM reads from config.json.
    return {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
        # Mixture of Experts (pagoda.modeling.layers.moe)
        "MixtralForCausalLM": MixtralForCausalLM,
        "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
        "GptOssForCausalLM": GptOssForCausalLM,
    }
