"""``tcp``: a KV connector over TCP to a block server, for engines on other hosts (or other processes of
one host) that share no folder.

One engine runs the server (``"serve": true``, a thread in its process holding the blocks in memory, the
least recently used dropped past ``max_size_gb``), or ``pagoda kv-server`` runs it as a process of its own;
every engine is a client of ``host:port``. The protocol is a request and an answer per round trip, each field
length-prefixed, little-endian::

    LOOKUP  b"L", u32 count, count x (u16 length, key)   ->  u32 how many of the keys, from the first, it holds
    GET     b"G", u16 length, key                       ->  u64 length (2**64 - 1: none), value
    PUT     b"P", u16 length, key, u64 length, value    ->  b"K"

A connection that fails or times out is dropped and opened again on the next call, and the call counts as a
miss (pagoda computes the block); a value cut off in transfer fails pagoda's check the same way.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
from collections import OrderedDict
from typing import Any, Optional, Sequence

logger = logging.getLogger("pagoda")

_U16, _U32, _U64 = struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<Q")
NONE = (1 << 64) - 1
MAX_KEYS = 1 << 16
MAX_VALUE = 1 << 31


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("the peer closed the connection")
        got += k
    return bytes(buf)


def _read_key(sock: socket.socket) -> str:
    (n,) = _U16.unpack(_read_exact(sock, 2))
    return _read_exact(sock, n).decode()


def _key_bytes(key: str) -> bytes:
    raw = key.encode()
    return _U16.pack(len(raw)) + raw


class BlockStore:
    """The server's memory: values by key, least recently used dropped past ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._values: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def lookup(self, keys: list[str]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._values:
                    return i
            return len(keys)

    def get(self, key: str) -> Optional[bytes]:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def put(self, key: str, value: bytes) -> None:
        if len(value) > self.max_bytes:
            return
        with self._lock:
            old = self._values.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._values[key] = value
            self._bytes += len(value)
            while self._bytes > self.max_bytes:
                _, dropped = self._values.popitem(last=False)
                self._bytes -= len(dropped)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        store: BlockStore = self.server.store  # type: ignore[attr-defined]
        sock = self.request
        try:
            while True:
                op = sock.recv(1)
                if not op:
                    return
                if op == b"L":
                    (count,) = _U32.unpack(_read_exact(sock, 4))
                    if count > MAX_KEYS:
                        return
                    sock.sendall(_U32.pack(store.lookup([_read_key(sock) for _ in range(count)])))
                elif op == b"G":
                    value = store.get(_read_key(sock))
                    if value is None:
                        sock.sendall(_U64.pack(NONE))
                    else:
                        sock.sendall(_U64.pack(len(value)) + value)
                elif op == b"P":
                    key = _read_key(sock)
                    (n,) = _U64.unpack(_read_exact(sock, 8))
                    if n > MAX_VALUE:
                        return
                    store.put(key, _read_exact(sock, n))
                    sock.sendall(b"K")
                else:
                    return  # not this protocol: drop the connection
        except (ConnectionError, OSError):
            return


class BlockServer(socketserver.ThreadingTCPServer):
    """A block server on ``(host, port)`` (port 0: any free one, see ``server_address``), serving from a
    thread of its own once :meth:`start` is called."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, port: int, max_bytes: int) -> None:
        super().__init__((host, port), _Handler)
        self.store = BlockStore(max_bytes)
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "BlockServer":
        self._thread = threading.Thread(target=self.serve_forever, name="pagoda-kv-block-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class TCPConnector:
    """A client of a block server. Options: ``host`` (default 127.0.0.1), ``port`` (required), ``serve``
    (run the server in this engine too, default false), ``max_size_gb`` (the server's memory, default 4),
    ``timeout`` (seconds a call may take, default 5)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, serve: bool = False, max_size_gb: float = 4.0,
                 timeout: float = 5.0) -> None:
        if not isinstance(port, int) or not 0 <= port < 65536 or (port == 0 and not serve):
            raise ValueError(f"port {port!r}: pass the block server's TCP port, 1 to 65535 (0, any free port, only "
                             "with serve)")
        if not isinstance(max_size_gb, (int, float)) or max_size_gb <= 0:
            raise ValueError(f"max_size_gb {max_size_gb!r} must be a positive number of GiB")
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout {timeout!r} must be a positive number of seconds")
        self.server: Optional[BlockServer] = None
        if serve:
            try:
                self.server = BlockServer(host, port, int(max_size_gb * (1 << 30))).start()
            except OSError as exc:
                raise ValueError(f"cannot serve blocks on {host}:{port}: {exc.strerror}") from None
            port = self.server.server_address[1]
            logger.info("KV block server on %s:%d", host, port)
        self.address = (host, port)
        self.timeout = float(timeout)
        self._local = threading.local()  # one connection per calling thread
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, engine_config: Any, **options: Any) -> "TCPConnector":
        unknown = sorted(set(options) - {"host", "port", "serve", "max_size_gb", "timeout"})
        if unknown:
            raise ValueError(f"unknown option {unknown[0]!r}; the tcp connector takes host, port, serve, "
                             "max_size_gb and timeout")
        return cls(**options)

    def lookup(self, keys: Sequence[str]) -> int:
        message = b"L" + _U32.pack(len(keys)) + b"".join(_key_bytes(k) for k in keys)
        return _U32.unpack(self._call(message, lambda s: _read_exact(s, 4)))[0]

    def load(self, key: str) -> Optional[bytes]:
        def answer(sock: socket.socket) -> Optional[bytes]:
            (n,) = _U64.unpack(_read_exact(sock, 8))
            return None if n == NONE else _read_exact(sock, n)

        return self._call(b"G" + _key_bytes(key), answer)

    def save(self, key: str, value: bytes) -> None:
        self._call(b"P" + _key_bytes(key) + _U64.pack(len(value)) + bytes(value), lambda s: _read_exact(s, 1))

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets:
                sock.close()
            self._sockets.clear()
        if self.server is not None:
            self.server.stop()

    def _call(self, message: bytes, read_answer: Any) -> Any:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = socket.create_connection(self.address, timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.sock = sock
            with self._lock:
                self._sockets.append(sock)
        try:
            sock.sendall(message)
            return read_answer(sock)
        except BaseException:
            self._local.sock = None  # a broken or half-read connection is never reused
            sock.close()
            raise


def register_server_command(subparsers: Any) -> None:
    parser = subparsers.add_parser("kv-server", help="a block server for the tcp KV connector",
                                   description="Holds KV blocks in memory for engines started with --kv-connector "
                                               "tcp (docs/kv_connectors.md).")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=7100, help="port to listen on (default 7100)")
    parser.add_argument("--max-size-gb", type=float, default=4.0,
                        help="GiB of blocks kept, the least recently used dropped first (default 4)")
    parser.set_defaults(func=_serve)


def _serve(args: Any) -> int:
    if args.max_size_gb <= 0:
        raise SystemExit(f"pagoda kv-server: error: --max-size-gb {args.max_size_gb:g} must be positive")
    server = BlockServer(args.host, args.port, int(args.max_size_gb * (1 << 30)))
    print(f"pagoda kv-server: serving KV blocks on {args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
