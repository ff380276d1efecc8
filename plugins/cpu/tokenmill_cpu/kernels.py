"""The plugin's fused C++ kernels (csrc/kernels.cpp), compiled on first use.

`load()` builds the extension with `torch.utils.cpp_extension` (g++ and ninja, `-O3
-march=native`, OpenMP) into a cache folder keyed by the source's hash and the torch
version, so a rebuild happens only when either changes; later processes just import it
(about 0.1 s). The first build takes 30-60 s.

When the build is impossible (no compiler, say) `load()` logs why once and returns None;
the ops then run their ATen versions. `TOKENMILL_CPU_KERNELS=0` turns the kernels off (to
compare against, or to rule them out); `TOKENMILL_CPU_KERNEL_CACHE` moves the build folder
(default: ~/.cache/tokenmill/cpu_kernels).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "kernels.cpp"


def enabled() -> bool:
    return os.environ.get("TOKENMILL_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no")


def _build_dir(tag: str) -> Path:
    root = os.environ.get("TOKENMILL_CPU_KERNEL_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "tokenmill" / "cpu_kernels"
    path = base / tag
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernels module, or None when disabled or the build failed (logged)."""
    if not enabled():
        return None
    digest = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    name = f"tokenmill_cpu_kernels_{digest}"
    build_dir = _build_dir(name)
    library = build_dir / f"{name}.so"
    try:
        if not library.exists():
            # One process builds; others (a server's workers, parallel test runs) wait here
            # and then import its result, never running ninja in the same folder at once.
            with open(build_dir / "build.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not library.exists():
                    _build(name, build_dir)
        return _import(name, library)
    except (OSError, RuntimeError, ImportError) as e:
        lines = str(e).splitlines() or [type(e).__name__]
        cause = next((line for line in lines if "error" in line.lower()), lines[-1])
        logger.warning(
            "tokenmill-cpu: building the fused CPU kernels in %s failed, using ATen ops "
            "instead (slower at small batch). Install g++ and ninja to enable them. Cause: %s",
            build_dir, cause.strip(),
        )
        return None


def _build(name: str, build_dir: Path) -> None:
    from torch.utils import cpp_extension

    logger.info("tokenmill-cpu: building the fused CPU kernels with g++ into %s (once per "
                "torch version; about a minute)", build_dir)
    start = time.monotonic()
    with _elapsed_line("tokenmill-cpu: building the fused CPU kernels"):
        cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    logger.info("tokenmill-cpu: the fused CPU kernels built in %.0f s", time.monotonic() - start)


@contextlib.contextmanager
def _elapsed_line(what: str) -> Iterator[None]:
    """A progress line on a terminal (`what: 0:42`), refreshed each second while the body
    runs; nothing where stderr is not a terminal (the log lines say it there)."""
    bar = tqdm(desc=what, bar_format="{desc}: {elapsed}", disable=None, leave=False)
    done = threading.Event()

    def tick() -> None:
        while not done.wait(1.0):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="tokenmill-cpu-build-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()


def _import(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the kernels from {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
