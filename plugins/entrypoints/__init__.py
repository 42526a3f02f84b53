"""Built-in entrypoints: CLI commands and the OpenAI-compatible server."""
