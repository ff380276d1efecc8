"""The engine's handle on its workers.

An executor runs a method on every worker (`collective_rpc`, by name, with msgspec-
encodable arguments) and steps (`execute`: the step goes to every rank, the result comes
back from the output rank: rank 0, or TP rank 0 of the last pipeline stage).
`initialize` drives the workers' set-up in order. The "uni" executor holds one worker in
the engine's process; "mp" (tokenmill.distributed.mp) one process per rank; "ray"
(tokenmill.distributed.ray_executor) one Ray actor per rank, on any node of a cluster.

Pipeline parallel keeps several steps in flight: `submit` hands a step to every rank and
returns at once, `collect` waits for a submitted step's result, in submission order;
every rank runs its steps in the order submitted, so stage s works on step k + 1 while
stage s + 1 works on step k. `max_concurrent_batches` says how many the engine may keep
in flight (the pipeline's depth); an executor that cannot overlap runs `submit` to the
end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from tokenmill.distributed.errors import ExecutorError
from tokenmill.distributed.worker import Worker
from tokenmill.engine.config import EngineConfig
from tokenmill.platforms.registry import ActivePlatform
from tokenmill.platforms.step import StepDescription, StepResult

EXECUTOR_BACKENDS = ("uni", "mp", "ray")


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        unique_reply_rank: int | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Call `Worker.<method>(*args)` on every rank; returns the ranks' results in rank
        order, or only `unique_reply_rank`'s (a list of one). Raises `ExecutorError` when
        a worker dies, raises or (with `timeout_s`) does not answer in time."""

    @abstractmethod
    def check_health(self) -> None:
        """Raises `ExecutorError` naming the failure once any worker has failed."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers; idempotent."""

    def initialize(self) -> int:
        """Set the workers up; returns the number of KV blocks every rank holds."""
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")
        num_blocks = min(self.collective_rpc("determine_num_blocks"))
        self.collective_rpc("initialize_kv_cache", (num_blocks,))
        return num_blocks

    @property
    def max_concurrent_batches(self) -> int:
        """How many submitted steps may be in flight at once: the pipeline's stages."""
        return self.config.parallel.pipeline_parallel_size

    def execute(self, step: StepDescription) -> StepResult:
        """Run one step on every rank; the output rank's result."""
        return self.collect(self.submit(step))

    def submit(self, step: StepDescription) -> Any:
        """Start `step` on every rank; a handle for `collect`. This default runs it to the
        end (the handle is the result). Raises `ExecutorError` as `collective_rpc` does."""
        (result,) = self.collective_rpc(
            "execute", (step,), unique_reply_rank=self.config.output_rank
        )
        return result

    def collect(self, handle: Any) -> StepResult:
        """The result of a submitted step (handles are collected in submission order)."""
        return check_step_result(handle, self.config.output_rank)


def check_step_result(result: Any, rank: int) -> StepResult:
    if not isinstance(result, StepResult):
        raise ExecutorError(f"rank {rank} returned {type(result).__name__}, not a StepResult")
    return result


class UniExecutor(Executor):
    """One worker, in the engine's process: calls are plain method calls."""

    def __init__(self, config: EngineConfig, platform: ActivePlatform, hf_config: Any) -> None:
        super().__init__(config)
        self.worker = Worker(config, rank=0, platform=platform, hf_config=hf_config)

    def collective_rpc(self, method, args=(), unique_reply_rank=None, timeout_s=None):
        return [getattr(self.worker, method)(*args)]

    def check_health(self) -> None:
        return None  # the worker is this process: if it died, so did we

    def shutdown(self) -> None:
        self.worker.shutdown()


def make_executor(
    backend: str, config: EngineConfig, platform: ActivePlatform, hf_config: Any,
    in_process_registry: bool,
) -> Executor:
    """The executor for `backend` ("uni", "mp" or "ray"). `in_process_registry`: the
    platform came from a registry given in-process, which worker processes cannot see."""
    if backend == "uni":
        return UniExecutor(config, platform, hf_config)
    if backend in ("mp", "ray") and in_process_registry:
        raise ValueError(
            f"distributed_executor_backend={backend!r} starts worker processes, which find the "
            f"platform {platform.name!r} among installed plugins (entry points) only; "
            "an in-process registry cannot cross to them: install the plugin or use 'uni'"
        )
    if backend == "mp":
        from tokenmill.distributed.mp import MultiprocExecutor

        return MultiprocExecutor(config)
    if backend == "ray":
        from tokenmill.distributed.ray_executor import RayExecutor

        return RayExecutor(config)
    raise ValueError(
        f"distributed_executor_backend={backend!r} is unknown; use one of {EXECUTOR_BACKENDS}"
    )
