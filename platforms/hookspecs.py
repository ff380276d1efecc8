"""The whole plugin API: every hook a tokenmill plugin may implement.

A plugin is a module (or object) whose functions carry `HookimplMarker("tokenmill")` and
are named after the hooks below. It is installed as its own distribution and announced
through the entry point group of its kind (`tokenmill.platforms` for a platform; see
`tokenmill.platforms.plugins` for KV tiers and parsers); one manager
(`tokenmill.platforms.plugins.PluginManager`) loads and validates every kind, and the
platform registry (`tokenmill.platforms.registry`) activates a platform.

One platform is active at a time, so the registry calls the hooks of the chosen plugin
only (never a mix of plugins) and every hook is `firstresult`: the plugin's answer is the
answer. A hook implementation may accept a subset of a hook's arguments, so hooks can
grow arguments without breaking plugins.

Every plugin implements `tokenmill_api_version`. A platform plugin must implement
`tokenmill_detect`, `tokenmill_platform`, `tokenmill_attention_backends`,
`tokenmill_allocator` and `tokenmill_hardware_spec`; `tokenmill_communicator` is required
when the platform declares `Capabilities.collectives`; the other platform hooks are
optional. A KV tier, tool parser, reasoning parser or model runner plugin implements the
one hook of its kind (`tokenmill_kv_tiers`, `tokenmill_tool_parsers`,
`tokenmill_reasoning_parsers`, `tokenmill_model_runner`).
Each hook's version is in `tokenmill.platforms.versions.HOOKS_SINCE`.

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
    KernelBuild,
    ModelRunnerBase,
    ModelRunnerContext,
    Platform,
)

PROJECT_NAME = "tokenmill"
ENTRY_POINT_GROUP = "tokenmill.platforms"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)

# what a platform plugin must implement (with tokenmill_api_version, which every plugin does)
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
# every hook a platform plugin may implement
PLATFORM_HOOKS = REQUIRED_HOOKS | frozenset(
    {
        "tokenmill_communicator",
        "tokenmill_ops",
        "tokenmill_graph_capture",
        "tokenmill_model_runner",
        "tokenmill_waivers",
        "tokenmill_kernel_builds",
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
    minor; otherwise the plugin is rejected with its name and both versions. Then every
    hook it implements, attention kind it declares, op it overrides and field it sets
    must be no newer than this version (tokenmill.platforms.versions); otherwise it is
    rejected naming the version that introduced the part. Declare the oldest version
    that has everything you use (docs/contract-changelog.md).

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
    same signature as `tokenmill.platforms.ops.reference.<name>`. Return {} (or do not implement
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
def tokenmill_hardware_spec(platform: Platform | None, device: str | None) -> HardwareSpec | None:
    """What the hardware can do at best, for the parallelism planner and the roofline.

    When called: by `ActivePlatform.hardware_spec()` (device None), when the planner, the
    server's roofline gauges or the performance report need the device at hand; and by
    `PlatformRegistry.device_spec(name)`, when the planner (`tokenmill plan --cluster
    2x8xH200`) plans for hardware that is not here: then `platform` is None, the plugin
    need not be available, and it answers from its hardware table without touching a
    device. Must not run benchmarks.

    Arguments:
        platform: the active `Platform`; None when a device is asked for by name.
        device: None for the device at hand; else a device name ("H200", "MI300X",
            "TPU v5e", case-insensitive) to look up in the plugin's table. A plugin
            without a table may leave this argument out (since API 1.4).

    Returns: a `HardwareSpec` with peak FLOP/s per dtype name, memory bandwidth and size,
    and the device-to-device link bandwidth; None for a device name the table does not
    hold. Figures in a table are the vendor's published ones (dense, no sparsity).

    Core checks: the result is a `HardwareSpec`; every peak and bandwidth is a positive
    number; `peak_flops` has an entry for the platform's default dtype (for a named
    device: a "bfloat16" entry) and a named device's `memory_bytes` is its capacity.

    Example:
        @hookimpl
        def tokenmill_hardware_spec(platform, device):
            if device is not None and device.lower() != "x1":
                return None
            return HardwareSpec(name="MyAccel X1", peak_flops={"bfloat16": 400e12},
                                memory_bandwidth=2.0e12, memory_bytes=96 << 30,
                                link_bandwidth=200e9)
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
    """A whole model runner: a platform plugin's own (optional), or the core's.

    When called: once per worker at engine start-up, before any weights are loaded, on the
    active platform's plugin first; when it returns None, on the model_runner plugins
    (entry point group `tokenmill.model_runners`; the core's own runner is the plugin
    `tokenmill` there, asked last). The runner loads its own weights, through
    `context.weights()`.

    Arguments:
        platform: the active `Platform`.
        context: a `ModelRunnerContext`: the HF config, the checkpoint path and an iterator
            over its weights from the core's loaders, the KV cache spec (per-layer attention
            specs, block size, user-fixed block count or bytes, the core's KV-group plan:
            each layer's group and arena slot), the parallel config (rank, world size and
            every parallel size), dtype, device, the step limits (max_num_batched_tokens,
            max_num_seqs, max_model_len), the seed and the `ActivePlatform`. No tokenizer:
            runners see token ids.

    Returns: None to leave the model to the next runner plugin, or a `ModelRunnerBase`:
    the worker reads its `capabilities()` and `kv_cache_layout()`, may call
    `profile(scratch)`, hands it the arena's page views with `bind_kv_cache(pages)`, then
    calls `execute(step)` with each `tokenmill.platforms.step.StepDescription`,
    expecting a `tokenmill.platforms.step.StepResult`; `sleep` / `wake_up` when it
    declares sleep mode; `shutdown` last.

    Core checks: the result is None or a `ModelRunnerBase` whose `capabilities()` is a
    `RunnerCapabilities` naming its attention kinds and whose `kv_cache_layout()` is a
    `KVCacheLayout` with one spec per layer (else the engine fails to start naming the
    plugin); then, once, that the model's layer kinds are among the runner's, and that
    KV offload is configured only for a runner that declares it. Conformance tier T3
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


@hookspec(firstresult=True)
def tokenmill_kv_tiers() -> dict[str, Callable]:
    """KV offload tiers, by the name a user picks them with (a remote URL's scheme).

    When called: when the engine builds its KV offload stack (`--kv-offload-host-bytes`,
    `--kv-offload-disk-path`, `--kv-offload-remote URL`), on every KV tier plugin (entry
    point group `tokenmill.kv_tiers`), and by `tokenmill plugins`.

    Arguments: none.

    Returns: a dict from tier name to a factory `make(options, context) -> KVTier`:
    `options` is a mapping of the tier's settings (`{"url": ...}` for a remote tier,
    `{"bytes": ...}` for host memory, `{"path": ..., "bytes": ...}` for disk) and
    `context` a `tokenmill.platforms.kv_tier.TierContext` (object size, layout
    fingerprint, the platform's host-staging allocator).

    Core checks: the result is a dict of non-empty names to callables, and no two plugins
    provide the same name; the factory's result must be a `KVTier`, else the engine fails
    to start naming the tier.

    Example:
        @hookimpl
        def tokenmill_kv_tiers():
            return {"mystore": lambda options, context: MyStoreTier(options["url"])}
    """


@hookspec(firstresult=True)
def tokenmill_kv_transports() -> dict[str, Callable]:
    """KV transports of prefill/decode disaggregation, by the name `--kv-transport` takes.

    When called: when an engine with `kv_role` prefill or decode starts its workers (each
    rank builds one transport over its KV arena), on every KV transport plugin (entry
    point group `tokenmill.kv_transports`), and by `tokenmill plugins`.

    Arguments: none.

    Returns: a dict from transport name to a factory `make(context) -> KVTransport`
    (`tokenmill.platforms.kv_transport`), `context` a `TransportContext` (the agent's
    name, host and the rank's device).

    Core checks: the result is a dict of non-empty names to callables, and no two plugins
    provide the same name; the factory's result must be a `KVTransport`, else the worker
    fails to start naming the transport.

    Example:
        @hookimpl
        def tokenmill_kv_transports():
            return {"myfabric": MyFabricTransport}
    """


@hookspec(firstresult=True)
def tokenmill_tool_parsers() -> dict[str, type]:
    """Tool-call parsers, by the name `--tool-call-parser` takes.

    When called: when the server starts with `--tool-call-parser` (or `auto`, to detect one
    from the chat template), on every tool parser plugin (entry point group
    `tokenmill.tool_parsers`), and by `tokenmill plugins`.

    Arguments: none.

    Returns: a dict from parser name to a subclass of
    `tokenmill.platforms.tool_parsing.ToolParser`.

    Core checks: every value is a `ToolParser` subclass and no two plugins provide the
    same name; otherwise the server fails to start naming the plugin.

    Example:
        @hookimpl
        def tokenmill_tool_parsers():
            return {"mymodel": MyModelToolParser}
    """


@hookspec(firstresult=True)
def tokenmill_reasoning_parsers() -> dict[str, type]:
    """Reasoning parsers (thinking split from the answer), by the name `--reasoning-parser`
    takes.

    When called: when the server starts with `--reasoning-parser`, on every reasoning
    parser plugin (entry point group `tokenmill.reasoning_parsers`), and by
    `tokenmill plugins`.

    Arguments: none.

    Returns: a dict from parser name to a subclass of
    `tokenmill.platforms.reasoning.ReasoningParser`.

    Core checks: every value is a `ReasoningParser` subclass and no two plugins provide
    the same name; otherwise the server fails to start naming the plugin.

    Example:
        @hookimpl
        def tokenmill_reasoning_parsers():
            return {"mythink": MyThinkReasoningParser}
    """


@hookspec(firstresult=True)
def tokenmill_kernel_builds(platform: Platform) -> list[KernelBuild] | None:
    """Every kernel of the plugin compiled ahead of time for the real targets it ships
    launch settings for, on this machine, whether or not the device is attached (API 1.5).

    When called: by the conformance suite (tier T1), once per certification.

    Arguments:
        platform: the active `Platform` (possibly an emulated one: the builds are for the
            real targets, not for it).

    Returns: one `KernelBuild` per (target, kernel, launch configuration), each compiled
    as the plugin launches it at production shapes; None when the plugin has no kernels
    of its own to compile (it runs the core's references or a vendor library).

    Core checks: a list of `KernelBuild`. The suite fails T1 on any record with an `error`
    or with `spill_bytes > 0`, and lists every record in the certificate's `compile`
    section (registers, spills, shared memory per kernel and configuration).

    Example:
        @hookimpl
        def tokenmill_kernel_builds(platform):
            return [compile_for("sm_90", kernel, cfg) for kernel, cfg in LAUNCHES]
    """
