"""The plugin API's version, and the version that introduced each part of it.

A plugin declares the version it was written against (`tokenmill_api_version`). The
registry accepts it when the major equals the core's and the minor is at most the
core's, and then checks what the plugin actually uses against the tables below: a hook
it implements, an attention kind it declares or serves, an op it overrides or a field it
sets that is newer than its declared version is refused, naming the version that
introduced it. So a declared version is a true floor: a plugin that says "1.2" cannot
quietly depend on 1.3. The history in words is docs/contract-changelog.md; a test checks
that every version named here has its entry there.
"""

from __future__ import annotations

PLUGIN_API_VERSION = "1.9"

# hook name -> the version that introduced it in its current form
HOOKS_SINCE: dict[str, str] = {
    "tokenmill_api_version": "1.0",
    "tokenmill_detect": "1.0",
    "tokenmill_platform": "1.0",
    "tokenmill_attention_backends": "1.0",
    "tokenmill_communicator": "1.0",
    "tokenmill_allocator": "1.0",
    "tokenmill_ops": "1.0",
    "tokenmill_hardware_spec": "1.0",
    "tokenmill_waivers": "1.0",
    "tokenmill_graph_capture": "1.2",  # returns a GraphCapture
    # 1.5: kernels compiled ahead of time for real targets (the conformance suite's T1)
    "tokenmill_kernel_builds": "1.5",
    # 1.6: the runner declares RunnerCapabilities and runs over the worker's KV pages
    "tokenmill_model_runner": "1.6",
    "tokenmill_kv_tiers": "1.6",
    "tokenmill_kv_transports": "1.6",
    "tokenmill_tool_parsers": "1.6",
    "tokenmill_reasoning_parsers": "1.6",
}

# (hook, argument) a plugin's implementation takes -> version
HOOK_ARGS_SINCE: dict[tuple[str, str], str] = {
    # 1.4: a device asked for by name from the plugin's hardware table (the planner)
    ("tokenmill_hardware_spec", "device"): "1.4",
}

# AttentionKind value -> version
ATTENTION_KINDS_SINCE: dict[str, str] = {
    "full": "1.0",
    "sliding_window": "1.0",
    "linear": "1.3",
    "mla": "1.3",
}

# op name (interfaces.OP_NAMES) -> version
OPS_SINCE: dict[str, str] = {
    "rms_norm": "1.0",
    "fused_add_rms_norm": "1.0",
    "rotary_embedding": "1.0",
    "silu_and_mul": "1.0",
    "prepack_linear": "1.0",
    "copy_blocks": "1.0",
    "swap_blocks": "1.0",
    "apply_token_bitmask": "1.1",
    "moe_experts": "1.2",
    "gelu_tanh_and_mul": "1.2",
    # 1.8: quantized weights (tokenmill.platforms.ops.quant)
    "prepack_quantized_linear": "1.8",
}

# "Class.field" a plugin sets (to a value other than its default) or overrides -> version
FIELDS_SINCE: dict[str, str] = {
    "AttentionBackend.supports_sinks": "1.2",
    "AttentionBackend.kv_cache_shape": "1.3",
    # with Allocator.sleep / wake, which the core calls only where this is declared
    "Capabilities.sleep_mode": "1.3",
    # appeared in the 1.1 era without a bump; 1.2 is the first version that has it
    "Platform.long_prefill_token_threshold": "1.2",
    # 1.7: a quantized (FP8) KV cache: AttentionSpec.cache_dtype, k_scale / v_scale
    "Capabilities.kv_cache_dtypes": "1.7",
    "AttentionBackend.kv_cache_dtypes": "1.7",
    # 1.9: a platform that runs no quantized weights says so, and the core dequantizes an
    # unset quantized checkpoint for it (a GGUF runs quantized by default since 1.9)
    "Capabilities.quantized_weights": "1.9",
}


def parse_version(text: object) -> tuple[int, int] | None:
    """(major, minor) of a "major.minor" string; None for anything else."""
    if not isinstance(text, str):
        return None
    parts = text.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def newer_than(since: str, declared: str) -> bool:
    """Whether a part introduced in `since` is newer than a plugin's `declared` version
    (both valid "major.minor" strings)."""
    a, b = parse_version(since), parse_version(declared)
    assert a is not None and b is not None, (since, declared)
    return a > b


def all_versions() -> set[str]:
    """Every version some part of the API was introduced in, and the current one."""
    tables = (HOOKS_SINCE, HOOK_ARGS_SINCE, ATTENTION_KINDS_SINCE, OPS_SINCE, FIELDS_SINCE)
    return {v for table in tables for v in table.values()} | {PLUGIN_API_VERSION}
