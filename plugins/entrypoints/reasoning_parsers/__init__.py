"""The built-in reasoning parsers (``pagoda_reasoning_parsers``), named as vLLM names them: ``deepseek_r1`` and
``qwen3`` (thinking between ``<think>`` tags) and ``openai_gptoss`` (gpt-oss's harmony channels)."""

from pagoda.plugins.entrypoints.reasoning_parsers.harmony import HarmonyReasoningParser
from pagoda.plugins.entrypoints.reasoning_parsers.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

BUILT_IN_REASONING_PARSERS = {"deepseek_r1": DeepSeekR1ReasoningParser, "qwen3": Qwen3ReasoningParser,
                              "openai_gptoss": HarmonyReasoningParser}
