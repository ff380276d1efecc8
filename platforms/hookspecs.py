"""The whole plugin API: every hook a tokenmill platform plugin may implement.

A plugin is a module (or object) whose functions carry `HookimplMarker("tokenmill")` and
are named after the hooks below. It is installed as its own distribution and announced
through the entry point group `tokenmill.platforms`; the registry
(`tokenmill.platforms.registry`) loads it, validates it and activates it.

One platform is active at a time, so the registry calls the hooks of the chosen plugin
only (never a mix of plugins) and every hook is `firstresult`: the plugin's answer is the
answer. A hook implementation may accept a subset of a hook's arguments, so hooks can
grow arguments without breaking plugins.

Required hooks: `tokenmill_api_version`, `tokenmill_detect`, `tokenmill_platform`,
`tokenmill_attention_backends`, `tokenmill_allocator`, `tokenmill_hardware_spec`.
`tokenmill_communicator` is required when the platform declares
`Capabilities.collectives`. The rest are optional.

Every hook is documented in one shape (When called / Arguments / Returns / Core checks /
Example); `tests/test_hook_docs.py` fails when one is not.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

from tokenmill.platforms.interfaces import (
    Allocator,
    AllocatorPurpose,
    AttentionBackend,
    Communicator,
    DetectionResult,
    GraphCapture,
    HardwareSpec,
    ModelRunnerBase,
    ModelRunnerContext,
    Platform,
)

PROJECT_NAME = "tokenmill"
ENTRY_POINT_GROUP = "tokenmill.platforms"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)

REQUIRED_HOOKS = frozenset(
    {
        "tokenmill_api_version",
        "tokenmill_detect",
        "tokenmill_platform",
        "tokenmill_attention_backends",
        "tokenmill_allocator",
        "tokenmill_hardware_spec",
    }
)


@hookspec(firstresult=True)
def tokenmill_api_version() -> str:
    """The plugin API version the plugin was written against, as "major.minor".

    When called: first, right after the plugin is registered, before any other hook.

    Arguments: none.

    Returns: a "major.minor" string. Write it as a literal (the version you built
    against), not as `tokenmill.platforms.interfaces.PLUGIN_API_VERSION`, or the check is
    meaningless.

    Core checks: the major equals the core's major and the minor is at most the core's
    minor; otherwise the plugin is rejected with its name and both versions.

    Example:
        @hookimpl
        def tokenmill_api_version():
            return "1.0"
    """


@hookspec(firstresult=True)
def tokenmill_detect() -> DetectionResult:
    """A cheap probe: can this platform run on this machine, and if not, why not.

    When called: by `list_platforms()` for every installed plugin, and by
    `load_platform()` before activation. Also from `tokenmill platforms`.

    Arguments: none.

    Returns: a `DetectionResult(available, reason)`. The reason is shown to the user
    either way ("2 devices found", "driver not loaded").

    Core checks: the result is a `DetectionResult`. The probe must not import heavy
    vendor libraries, allocate device memory or start background threads; do that in
    `tokenmill_platform`.

    Example:
        @hookimpl
        def tokenmill_detect():
            if not shutil.which("my-accel-smi"):
                return DetectionResult(False, "my-accel-smi not found on PATH")
            return DetectionResult(True, "1 accelerator found")
    """


@hookspec(firstresult=True)
def tokenmill_platform() -> Platform:
    """Activate the platform: the device the engine runs on and what it can do.

    When called: once by `load_platform()` after a successful detection, and by
    `list_platforms()` for available plugins (to show their capabilities). Must be
    idempotent.

    Arguments: none.

    Returns: a `Platform` with a frozen `Capabilities`.

    Core checks: the result is a `Platform`; `name` and `device_type` are non-empty
    strings; `capabilities` is a `Capabilities` with non-empty `dtypes`, `block_sizes`,
    `head_sizes` and `attention_kinds`; `default_dtype` is one of `capabilities.dtypes`;
    `memory_info` is callable.

    Example:
        @hookimpl
        def tokenmill_platform():
            return Platform(name="myaccel", device_type="privateuseone",
                            capabilities=Capabilities(...), default_dtype=torch.bfloat16,
                            memory_info=_memory_info)
    """


@hookspec(firstresult=True)
def tokenmill_attention_backends(platform: Platform) -> list[AttentionBackend]:
    """The platform's paged attention backends, in order of preference.

    When called: once at activation. The core picks, for each layer's `AttentionSpec`,
    the first backend whose `kind` equals the spec's kind and whose `supports(spec)` is
    true.

    Arguments:
        platform: the `Platform` returned by `tokenmill_platform`.

    Returns: a non-empty list of `AttentionBackend` instances.

    Core checks: every item is an `AttentionBackend`; every kind in
    `capabilities.attention_kinds` has at least one backend; no backend has a kind the
    platform does not declare. Conformance tier T1 compares every backend against the
    core's reference paged attention.

    Example:
        @hookimpl
        def tokenmill_attention_backends(platform):
            return [MyFlashAttention(AttentionKind.FULL),
                    MyFlashAttention(AttentionKind.SLIDING_WINDOW)]
    """


@hookspec(firstresult=True)
def tokenmill_communicator(platform: Platform, group: object | None) -> Communicator:
    """Collectives over one process group.

    When called: by `ActivePlatform.communicator(group)` each time the engine sets up a
    parallel group (tensor, pipeline, expert, ...), after `torch.distributed` is
    initialised with the platform's backend.

    Arguments:
        platform: the active `Platform`.
        group: a `torch.distributed.ProcessGroup`, or None for the default (world) group.

    Returns: a `Communicator` whose ranks are the group's ranks.

    Core checks: the result is a `Communicator`. Conformance tier T1 runs every
    collective in a real multi-process group and compares against the expected sums and
    concatenations.

    Example:
        @hookimpl
        def tokenmill_communicator(platform, group):
            return MyCollectives(group)
    """


@hookspec(firstresult=True)
def tokenmill_allocator(platform: Platform, purpose: AllocatorPurpose) -> Allocator:
    """The allocator for one purpose: the KV arena, weights, or host staging buffers.

    When called: at most once per purpose per activation; `ActivePlatform` keeps the
    allocator so that `bytes_in_use` accounts for the whole engine.

    Arguments:
        platform: the active `Platform`.
        purpose: which memory the allocator hands out.

    Returns: an `Allocator` whose `purpose` equals the requested one.

    Core checks: the result is an `Allocator` with the requested `purpose` and a positive
    `bytes_limit()`. The core sizes the KV arena from `bytes_limit()` and carves it into
    pages itself.

    Example:
        @hookimpl
        def tokenmill_allocator(platform, purpose):
            return MyArena(purpose, limit_bytes=int(0.9 * free_device_bytes()))
    """


@hookspec(firstresult=True)
def tokenmill_ops(platform: Platform) -> dict[str, Callable]:
    """Optional faster versions of the core's reference ops, by op name.

    When called: once at activation.

    Arguments:
        platform: the active `Platform`.

    Returns: a dict from op name (one of `interfaces.OP_NAMES`) to a function with the
    same signature as `tokenmill.ops.reference.<name>`. Return {} (or do not implement
    the hook) to use the references.

    Core checks: every key is a known op name and every value is callable; an unknown
    name is an error naming the plugin. Conformance tier T1 compares each override
    against its reference.

    Example:
        @hookimpl
        def tokenmill_ops(platform):
            return {"rms_norm": my_fused_rms_norm}
    """


@hookspec(firstresult=True)
def tokenmill_hardware_spec(platform: Platform) -> HardwareSpec:
    """What the hardware can do at best, for the parallelism planner and the roofline.

    When called: by `ActivePlatform.hardware_spec()`, when the planner or the
    performance report needs it. Must not run benchmarks.

    Arguments:
        platform: the active `Platform`.

    Returns: a `HardwareSpec` with peak FLOP/s per dtype name, memory bandwidth and size.

    Core checks: the result is a `HardwareSpec`; every peak and bandwidth is a positive
    number; `peak_flops` has an entry for the platform's default dtype.

    Example:
        @hookimpl
        def tokenmill_hardware_spec(platform):
            return HardwareSpec(name="MyAccel X1", peak_flops={"bfloat16": 400e12},
                                memory_bandwidth=2.0e12, memory_bytes=96 << 30)
    """


@hookspec(firstresult=True)
def tokenmill_graph_capture(platform: Platform) -> GraphCapture | None:
    """Optional capture and replay of the decode step (CUDA graphs, say), per batch size.

    When called: once per worker, when the core model runner is built, and only if the
    platform declares `capabilities.graphs`. Not called for a plugin's own model runner.

    Arguments:
        platform: the active `Platform`.

    Returns: a `GraphCapture` (see `tokenmill.platforms.interfaces`), or None to run every
    step eagerly. The runner asks it for `batch_sizes(max_num_seqs)`, calls
    `capture(batch_size, fn)` once per bucket at start-up, where `fn()` runs the model's
    forward over the runner's static input buffers and returns the hidden states, and
    then, for each decode-only step of n requests, fills the static buffers (padding to the
    smallest bucket >= n) and calls `replay(bucket)`. Mixed steps with prompt tokens, and
    batches larger than every bucket, run eagerly.

    Core checks: the result is None or a `GraphCapture`, and `batch_sizes` returns
    ascending positive integers no larger than `max_num_seqs`; otherwise the engine fails
    to start naming the plugin. Conformance tier T3 runs its greedy comparison with the
    reference platform through the captured path when the platform declares graphs.

    Example:
        @hookimpl
        def tokenmill_graph_capture(platform):
            return MyCudaGraphs(pool_bytes=1 << 30)
    """


@hookspec(firstresult=True)
def tokenmill_model_runner(
    platform: Platform, context: ModelRunnerContext
) -> ModelRunnerBase | None:
    """Optional: a whole model runner of the plugin's own instead of the core's.

    When called: once per worker at engine start-up, before the core loads any weights;
    when it returns a runner, the core loads none (the runner loads its own, through
    `context.weights()`).

    Arguments:
        platform: the active `Platform`.
        context: a `ModelRunnerContext`: the HF config, the checkpoint path and an iterator
            over its weights from the core's loaders, the KV cache spec (per-layer attention
            specs, block size, user-fixed block count or bytes), the parallel config (rank,
            world size), dtype, device, and the step limits (max_num_batched_tokens,
            max_num_seqs, max_model_len). No tokenizer: runners see token ids.

    Returns: None to use the core model runner, or a `ModelRunnerBase`: the core calls its
    `kv_block_bytes()`, `profile()`, `initialize_kv_cache(num_blocks)`, then `execute(step)`
    with each `tokenmill.step.StepDescription`, expecting a `tokenmill.step.StepResult`.

    Core checks: the result is None or a `ModelRunnerBase` (else the engine fails to start
    naming the plugin), and `kv_block_bytes()` is a positive integer. Conformance tier T3
    runs every greedy comparison through it (the engine uses it for every model) and
    checks that the engine really did.

    Example:
        @hookimpl
        def tokenmill_model_runner(platform, context):
            if context.hf_config.model_type not in MY_MODELS:
                return None  # the core's runner takes the rest
            return MyCompiledStepRunner(context)
    """


@hookspec(firstresult=True)
def tokenmill_waivers(platform: Platform) -> list[tuple[str, str]]:
    """Conformance tests the plugin asks to waive, each with a reason.

    When called: by the conformance suite, when it builds its certificate.

    Arguments:
        platform: the active `Platform`.

    Returns: a list of (test id, reason) pairs; [] when nothing is waived. A test id is
    the suite's, relative to its folder ("t4/test_serving.py::test_x", with or without
    "[params]"). A waived test still runs and its outcome (XFAIL/XPASS) is shown in the
    certificate next to the reason.

    Core checks: every item is a pair of non-empty strings. Waivers of the core tiers
    T0-T3 are rejected by the conformance suite and listed as rejected in the certificate.

    Example:
        @hookimpl
        def tokenmill_waivers(platform):
            return [("t4/test_serving.py::test_anthropic_messages_streamed",
                     "SSE through our gateway lands in release 2")]
    """
