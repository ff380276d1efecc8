"""Counting XLA compilations, to prove a warm runner compiles nothing.

JAX records one `/jax/core/compile/backend_compile_duration` event per backend (XLA)
compilation; `CompileCounter` listens for it while it is open. It counts every
compilation in the process, the step's and any other.
"""

from __future__ import annotations

import jax.monitoring

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """`with CompileCounter() as c: ...` then `c.count` (and `c.seconds`)."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0

    def _listen(self, event: str, duration: float, **_: object) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1
            self.seconds += duration

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc: object) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)
