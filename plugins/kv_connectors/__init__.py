"""Built-in KV connectors, registered through ``pagoda_kv_connectors`` (docs/kv_connectors.md): ``shared-disk``,
a folder several engines share, and ``tcp``, a block server one engine runs and others reach over TCP; and the
``pagoda kv-proxy`` command, which splits each request's prefill and decode between instances sharing one, and
``pagoda kv-server``, the tcp connector's block server as a process of its own."""

from pagoda import hookimpl


@hookimpl
def pagoda_kv_connectors():
    from pagoda.plugins.kv_connectors.shared_disk import SharedDiskConnector
    from pagoda.plugins.kv_connectors.tcp import TCPConnector

    return {"shared-disk": SharedDiskConnector.from_config, "tcp": TCPConnector.from_config}


@hookimpl
def pagoda_cli_commands():
    from pagoda.plugins.kv_connectors import proxy, tcp

    return {"kv-proxy": proxy.register, "kv-server": tcp.register_server_command}
