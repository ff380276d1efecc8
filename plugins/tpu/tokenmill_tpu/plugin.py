"""The TPU platform plugin: a JAX model runner, Pallas attention and XLA collectives.

Runs on a TPU (libtpu) or, when asked explicitly with `JAX_PLATFORMS=cpu`, on JAX's CPU
backend, where it is certified (`XLA_FLAGS=--xla_force_host_platform_device_count=4`
gives four devices for tensor parallelism). Importing this module imports no JAX; the
probe reads device files and the environment only (tokenmill_tpu.detect).

What the core sees: torch tensors on the CPU ("cpu" device type: the core's torch
graph, its KV arena and the conformance suite's tensors stay on the host), a Pallas
attention backend behind the torch seam, XLA collectives behind the `Communicator`, and
the plugin's own model runner, which keeps weights and KV in JAX arrays on the JAX
devices (TPU HBM, or the forced host devices) and compiles the step once per bucket.
"""

from __future__ import annotations

import os

import pluggy
import psutil
import torch

from tokenmill.platforms.interfaces import (
    Allocator,
    AllocatorPurpose,
    AttentionBackend,
    AttentionKind,
    Capabilities,
    Communicator,
    DetectionResult,
    HardwareSpec,
    KernelBuild,
    MemoryInfo,
    ModelRunnerBase,
    ModelRunnerContext,
    Platform,
)
from tokenmill_tpu.detect import forced_cpu_device_count, probe

hookimpl = pluggy.HookimplMarker("tokenmill")
TENSOR_PARALLEL_ENV = "TOKENMILL_TPU_TENSOR_PARALLEL"

CAPABILITIES = Capabilities(
    attention_kinds=frozenset({AttentionKind.FULL, AttentionKind.SLIDING_WINDOW}),
    dtypes=frozenset({torch.float32, torch.bfloat16}),
    # one page size keeps the number of compiled shapes down; 16 tokens of bf16 at head
    # size 128 is a 4 KiB key page, a whole number of TPU (8, 128) tiles
    block_sizes=frozenset({16}),
    head_sizes=frozenset({64, 128}),
    collectives=True,
    # dense weights only: the core dequantizes a quantized checkpoint left unset, and
    # refuses --quantization gguf|awq|gptq|fp8 naming the platform
    quantized_weights=False,
)


def tensor_parallel_size() -> int:
    """`$TOKENMILL_TPU_TENSOR_PARALLEL` (default 1): JAX devices the runner's mesh spans."""
    text = os.environ.get(TENSOR_PARALLEL_ENV, "1")
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"${TENSOR_PARALLEL_ENV}={text!r} must be a positive integer")
    return int(text)


def _backend() -> str:
    found = probe()
    if found.backend is None:
        raise RuntimeError(f"the tpu platform is not available: {found.reason}")
    return found.backend


def _memory_info() -> MemoryInfo:
    if _backend() == "cpu":
        memory = psutil.virtual_memory()
        return MemoryInfo(total_bytes=memory.total, free_bytes=memory.available)
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    total = int(stats.get("bytes_limit", 0))
    return MemoryInfo(total_bytes=total, free_bytes=max(total - int(stats.get("bytes_in_use", 0)), 0))


@hookimpl
def tokenmill_api_version() -> str:
    # 1.4: a device named from the hardware table; 1.5: tokenmill_kernel_builds; 1.6: the
    # runner seam (RunnerCapabilities, the worker's KV pages); 1.9: it declares that it
    # runs no quantized weights (Capabilities.quantized_weights)
    return "1.9"


@hookimpl
def tokenmill_detect() -> DetectionResult:
    found = probe()
    return DetectionResult(found.backend is not None, found.reason)


@hookimpl
def tokenmill_platform() -> Platform:
    import jax  # the module only: JAX's backend starts when the runner first needs it

    backend = _backend()
    return Platform(
        name="tpu",
        device_type="cpu",
        capabilities=CAPABILITIES,
        # bf16 is the TPU's native type; on JAX-on-CPU float32 is exact against the
        # reference and XLA's CPU bf16 is emulated anyway
        default_dtype=torch.bfloat16 if backend == "tpu" else torch.float32,
        memory_info=_memory_info,
        version=f"jax {jax.__version__} ({backend})",
        long_prefill_token_threshold=256 if backend == "cpu" else None,
    )


@hookimpl
def tokenmill_attention_backends(platform: Platform) -> list[AttentionBackend]:
    from tokenmill_tpu.attention import PallasPagedAttention

    interpret = _backend() == "cpu"
    return [
        PallasPagedAttention(AttentionKind.FULL, interpret),
        PallasPagedAttention(AttentionKind.SLIDING_WINDOW, interpret),
    ]


@hookimpl
def tokenmill_communicator(platform: Platform, group: object | None) -> Communicator:
    from tokenmill_tpu.communicator import make_communicator

    return make_communicator(group, _backend())


@hookimpl
def tokenmill_allocator(platform: Platform, purpose: AllocatorPurpose) -> Allocator:
    from tokenmill_tpu.allocator import make_allocator

    return make_allocator(purpose)


@hookimpl
def tokenmill_hardware_spec(platform: Platform | None, device: str | None) -> HardwareSpec | None:
    from tokenmill_tpu import hardware

    if device is not None:
        return hardware.named_spec(device)
    if _backend() == "cpu":
        return hardware.jax_cpu_spec(forced_cpu_device_count())
    import jax

    return hardware.tpu_spec(jax.local_devices()[0].device_kind)


@hookimpl
def tokenmill_model_runner(platform: Platform, context: ModelRunnerContext) -> ModelRunnerBase | None:
    """The JAX runner for every model type it knows (llama, qwen2, qwen3, gemma3_text, and
    the hybrid bamba; the core's runner for the others), tensor parallel over
    `$TOKENMILL_TPU_TENSOR_PARALLEL` JAX devices of this process (one for bamba)."""
    from tokenmill_tpu.hybrid import TpuBambaRunner
    from tokenmill_tpu.model import SUPPORTED_MODEL_TYPES
    from tokenmill_tpu.runner import TpuModelRunner

    model_type = context.hf_config.model_type
    if model_type not in (*SUPPORTED_MODEL_TYPES, "bamba"):
        return None
    if context.parallel.world_size != 1:
        raise ValueError(
            f"the tpu runner runs in one process over its JAX devices (tensor parallel by "
            f"sharding); got an engine of {context.parallel.world_size} worker processes. "
            f"Use one worker and set ${TENSOR_PARALLEL_ENV}=N"
        )
    runner = TpuBambaRunner if model_type == "bamba" else TpuModelRunner
    return runner.from_context(
        context, interpret=_backend() == "cpu", tensor_parallel_size=tensor_parallel_size(),
    )


@hookimpl
def tokenmill_kernel_builds(platform: Platform) -> list[KernelBuild]:
    from tokenmill_tpu.aot import builds_in_subprocess

    return builds_in_subprocess()


@hookimpl
def tokenmill_waivers(platform: Platform) -> list[tuple[str, str]]:
    return []
