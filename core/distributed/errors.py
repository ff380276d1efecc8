"""How an executor reports that its workers cannot go on."""

from __future__ import annotations


class ExecutorError(RuntimeError):
    """The executor's workers cannot run steps any more; the engine must stop."""


class WorkerDiedError(ExecutorError):
    """A worker process exited (crashed, was killed, ran out of memory)."""

    def __init__(self, rank: int, pid: int | None, exitcode: int | None) -> None:
        self.rank, self.pid, self.exitcode = rank, pid, exitcode
        how = f"exit code {exitcode}" if exitcode is None or exitcode >= 0 else (
            f"exit code {exitcode} (killed by signal {-exitcode})"
        )
        super().__init__(f"worker rank {rank} (pid {pid}) died with {how}")


class WorkerCallError(ExecutorError):
    """A worker raised while running a call; carries the worker's traceback text."""

    def __init__(self, rank: int, method: str, error: str) -> None:
        self.rank, self.method, self.error = rank, method, error
        super().__init__(f"worker rank {rank} failed in {method}: {error}")
