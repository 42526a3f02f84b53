"""Built-in entrypoints: the ``pagoda`` CLI commands, the OpenAI-compatible server's routes, and the tool-call
and reasoning parsers it reads chat answers with."""

from pagoda import hookimpl


@hookimpl
def pagoda_cli_commands():
    from pagoda.plugins.entrypoints.bench import command as bench
    from pagoda.plugins.entrypoints.cli import commands, serve
    from pagoda.plugins.entrypoints.simulate import command as simulate

    return {
        "generate": commands.register_generate,
        "plugins": commands.register_plugins,
        "bench": bench.register,
        "serve": serve.register,
        "simulate": simulate.register,
    }


@hookimpl
def pagoda_add_routes(app, engine):
    from pagoda.engine.pooling import AsyncPoolingEngine

    if isinstance(engine, AsyncPoolingEngine):  # a pooling model: embeddings, scores, reranking
        from pagoda.plugins.entrypoints.server.pooling import add_pooling_routes

        add_pooling_routes(app, engine)
        return
    from pagoda.plugins.entrypoints.server.routes import add_openai_routes

    add_openai_routes(app, engine)


@hookimpl
def pagoda_tool_parsers():
    from pagoda.plugins.entrypoints.tool_parsers import BUILT_IN_TOOL_PARSERS

    return dict(BUILT_IN_TOOL_PARSERS)


@hookimpl
def pagoda_reasoning_parsers():
    from pagoda.plugins.entrypoints.reasoning_parsers import BUILT_IN_REASONING_PARSERS

    return dict(BUILT_IN_REASONING_PARSERS)
