"""The engine loop and its assembly.

- ``llm``: :class:`LLM`, the offline entry point (``pagoda.LLM``).
- ``llm_engine``: :class:`LLMEngine`, whose step is schedule -> execute -> update -> emit.
- ``request_limits``: :class:`RequestLimits`, the checks every request passes before it is queued.
- ``async_engine``, ``request_stream``: the engine on its own thread for the server, one stream per request.
- ``engine_args``: :class:`EngineArgs`, the flat options (the CLI flags) validated into ``pagoda.config``.
- ``components``: resolves every configured name at start-up and builds the engine's side of the components.
- ``metrics``: the Prometheus metrics and the per-request timings.
"""
