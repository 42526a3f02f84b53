"""Built-in entrypoints: the ``pagoda`` CLI commands (and the OpenAI-compatible server)."""

from pagoda.markers import hookimpl


@hookimpl
def pagoda_cli_commands():
    from pagoda.plugins.entrypoints import bench, commands

    return {
        "generate": commands.register_generate,
        "plugins": commands.register_plugins,
        "bench": bench.register,
    }
