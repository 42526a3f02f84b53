"""Built-in entrypoints: the ``pagoda`` CLI commands and the OpenAI-compatible server's routes."""

from pagoda.markers import hookimpl


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
    from pagoda.plugins.entrypoints.server.routes import add_openai_routes

    add_openai_routes(app, engine)
