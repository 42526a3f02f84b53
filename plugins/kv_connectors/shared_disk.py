"""``shared-disk``: a KV connector over a folder that several engines share (one host, or a shared
filesystem such as NFS): one file per key, written under a temporary name and renamed into place, so a
reader sees a whole value or none. pagoda checks every value it loads (crc32, the block's identity), so a
file cut short or damaged costs a recompute, never a wrong token.

The folder may be bounded (``max_size_gb``): the engine that writes past the bound deletes the least
recently used files (a load touches its file) until the folder is back under 90% of it.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

logger = logging.getLogger("pagoda")

SUFFIX = ".kvc"


class SharedDiskConnector:
    """Files ``<path>/<key>.kvc``. Options: ``path`` (an existing, writable directory), ``max_size_gb`` (the
    files' total, oldest deleted first; default: no bound)."""

    def __init__(self, path: str, max_size_gb: Optional[float] = None) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise ValueError(f"path {str(self.path)!r} is not an existing directory; create it (mkdir -p "
                             f"{self.path}) or pass another")
        if not os.access(self.path, os.W_OK):
            raise ValueError(f"path {str(self.path)!r} is not writable; pass a directory pagoda may create files in")
        if max_size_gb is not None and (not isinstance(max_size_gb, (int, float)) or max_size_gb <= 0):
            raise ValueError(f"max_size_gb {max_size_gb!r} must be a positive number of GiB (or left out)")
        self.max_bytes = None if max_size_gb is None else int(max_size_gb * (1 << 30))
        self._written = 0  # bytes written since the folder was last measured
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, engine_config: Any, **options: Any) -> "SharedDiskConnector":
        if "path" not in options:
            raise ValueError('the shared-disk connector needs a folder: --kv-connector-options \'{"path": "DIR"}\'')
        unknown = sorted(set(options) - {"path", "max_size_gb"})
        if unknown:
            raise ValueError(f"unknown option {unknown[0]!r}; the shared-disk connector takes path and max_size_gb")
        return cls(**options)

    def lookup(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            if not self._file(key).exists():
                return i
        return len(keys)

    def load(self, key: str) -> Optional[bytes]:
        path = self._file(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            os.utime(path)  # its place in the least-recently-used order
        except OSError:
            pass
        return data

    def save(self, key: str, value: bytes) -> None:
        path = self._file(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(value)
            os.replace(tmp, path)  # atomic: readers see the old file, the new one, or none
        finally:
            tmp.unlink(missing_ok=True)
        if self.max_bytes is not None:
            with self._lock:
                self._written += len(value)
                due = self._written > self.max_bytes // 20
                if due:
                    self._written = 0
            if due:
                self._trim()

    def close(self) -> None:
        pass

    def _file(self, key: str) -> Path:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"bad KV connector key {key!r}")
        return self.path / (key + SUFFIX)

    def _trim(self) -> None:
        """Delete the least recently used files until the folder holds at most 90% of ``max_bytes``."""
        entries = []
        for entry in os.scandir(self.path):
            if entry.name.endswith(SUFFIX):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue  # another engine deleted it
                entries.append((st.st_mtime_ns, st.st_size, entry.path))
        total = sum(size for _, size, _ in entries)
        if total <= self.max_bytes:
            return
        entries.sort()
        target = self.max_bytes * 9 // 10
        for _, size, name in entries:
            if total <= target:
                break
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass
            total -= size
