"""The engine loop: LLM, LLMEngine and its async form, the options, the assembly of components, metrics."""
