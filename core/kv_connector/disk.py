"""Local disk tier: one file per object, named by its key.

Files live under `DIR/<key[:2]>/<key>.kv`. A write goes to a temporary file in the same
directory and is renamed into place (`os.replace` is atomic), so a reader or a crash
never sees half an object; a file that is there is whole or detectably corrupt. The
index (key -> size, least recently used first) is rebuilt from the directory at start, in
modification-time order, so a new engine process reuses what an earlier one saved.
Eviction deletes the least recently used files until the new object fits.

Batched reads (`read_into`, a load's blocks at once): each file is read with `readinto`
straight into the load's staging row (no intermediate copy), by `io_threads` threads at
a time, so the device queue stays busy and page-cache copies run on several cores.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenmill.kv_connector.objects import ObjectKey
from tokenmill.platforms.kv_tier import KVTier, TierUnavailableError

logger = logging.getLogger(__name__)

_SUFFIX = ".kv"


class DiskTier(KVTier):
    name = "disk"

    def __init__(
        self, path: str | os.PathLike, capacity_bytes: int, io_threads: int = 4
    ) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"kv_offload_disk_bytes={capacity_bytes} must be >= 1")
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self._capacity = capacity_bytes
        self._index: OrderedDict[ObjectKey, int] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self.num_evicted = 0  # objects dropped to make room
        self._io = ThreadPoolExecutor(max_workers=max(1, io_threads),
                                      thread_name_prefix="kv-disk-io")
        self._scan()

    def _scan(self) -> None:
        found = []
        for f in self.root.glob(f"*/*{_SUFFIX}"):
            try:
                key = bytes.fromhex(f.stem)
                st = f.stat()
            except (ValueError, FileNotFoundError):
                continue  # not ours, or deleted meanwhile
            found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._used += size
        if found:
            logger.info("disk tier %s: %d objects (%.2f GiB) from earlier runs",
                        self.root, len(found), self._used / (1 << 30))
        self._make_room(0)

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def used_bytes(self) -> int:
        return self._used

    def file_for(self, key: ObjectKey) -> Path:
        h = key.hex()
        return self.root / h[:2] / (h + _SUFFIX)

    def contains(self, key: ObjectKey) -> bool:
        return key in self._index

    def get(self, key: ObjectKey) -> memoryview | None:
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        try:
            with open(self.file_for(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    data = memoryview(b"")
                else:
                    data = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        except FileNotFoundError:  # removed behind our back: forget it
            with self._lock:
                self._forget(key)
            return None
        except OSError as exc:
            raise TierUnavailableError(f"disk tier {self.root}: {exc}") from exc
        return data

    def read_into(self, keys: list[ObjectKey], buffers: list[memoryview]) -> list[int | None]:
        with self._lock:
            for key in keys:
                if key in self._index:
                    self._index.move_to_end(key)
        try:
            return list(self._io.map(self._read_one, keys, buffers))
        except OSError as exc:
            raise TierUnavailableError(f"disk tier {self.root}: {exc}") from exc

    def _read_one(self, key: ObjectKey, buf: memoryview) -> int | None:
        if key not in self._index:
            return None
        try:
            fd = os.open(self.file_for(key), os.O_RDONLY)
        except FileNotFoundError:  # removed behind our back: forget it
            with self._lock:
                self._forget(key)
            return None
        try:
            size = os.fstat(fd).st_size
            if size != len(buf):
                return size
            done = 0
            while done < size:
                n = os.readv(fd, [buf[done:]])
                if n == 0:
                    return done  # shrank under us: a short object, refused
                done += n
            return size
        finally:
            os.close(fd)

    def put(self, key: ObjectKey, data: bytes | memoryview) -> bool:
        try:
            return self._put(key, data)
        except OSError as exc:  # disk full, directory gone, permissions: the others carry on
            logger.warning("disk tier %s: cannot write %s: %s", self.root, key.hex()[:16], exc)
            raise TierUnavailableError(f"disk tier {self.root}: {exc}") from exc

    def _put(self, key: ObjectKey, data: bytes | memoryview) -> bool:
        size = len(data)
        with self._lock:
            if key in self._index or size > self._capacity:
                return False
            self._make_room(size)
            target = self.file_for(key)
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            self._index[key] = size
            self._used += size
            return True

    def delete(self, key: ObjectKey) -> None:
        with self._lock:
            self._forget(key)

    def keys(self) -> list[ObjectKey]:
        with self._lock:
            return list(self._index)

    def close(self) -> None:
        self._io.shutdown(wait=True)

    def _forget(self, key: ObjectKey) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= size
            self.file_for(key).unlink(missing_ok=True)
            self._removed(key)

    def _make_room(self, size: int) -> None:
        while self._index and self._used + size > self._capacity:
            key = next(iter(self._index))
            self._forget(key)
            self.num_evicted += 1
