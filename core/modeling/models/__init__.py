"""Built-in model architectures, registered through ``pagoda_model_architectures``."""

from pagoda.markers import hookimpl


@hookimpl
def pagoda_model_architectures():
    from pagoda.modeling.models.llama import LlamaForCausalLM

    # Mistral and Qwen2 checkpoints differ from Llama only in config switches
    # (sliding window, QKV bias) that LlamaForCausalLM reads from config.json.
    return {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
    }
