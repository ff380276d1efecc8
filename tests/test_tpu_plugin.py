"""The tpu plugin: its probe and hardware table here; its JAX tests (kernel, runner,
tensor parallelism, compilation counts) in a process of their own on JAX's CPU backend
with four devices, since the environment must be set before JAX starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill_tpu import detect, hardware

ROOT = Path(__file__).resolve().parents[1]
JAX_CPU_4 = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


def test_probe_takes_jax_cpu_only_when_asked(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    found = detect.probe()
    assert found.backend == "cpu"
    assert "JAX's CPU backend" in found.reason and "4 device" in found.reason
    assert "not a TPU" in found.reason
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert detect.probe().backend is None
    assert "names no tpu or cpu" in detect.probe().reason


def test_probe_without_a_tpu_says_what_it_looked_for(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(detect, "tpu_device_files", lambda: [])
    found = detect.probe()
    assert found.backend is None
    assert "/dev/accel*" in found.reason and "JAX_PLATFORMS=cpu" in found.reason
    monkeypatch.setattr(detect, "tpu_device_files", lambda: ["/dev/accel0"])
    with_files = detect.probe()
    assert (with_files.backend == "tpu") == (
        "libtpu installed" in with_files.reason
    ), with_files.reason


def test_probe_imports_no_jax():
    code = "import sys, tokenmill_tpu.plugin as p; p.tokenmill_detect(); print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **JAX_CPU_4}, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_tpu_generation_table():
    v5e = hardware.tpu_spec("TPU v5 lite")
    assert v5e.name == "TPU v5e" and v5e.peak_flops["bfloat16"] == 197e12
    assert v5e.memory_bytes == 16 << 30 and v5e.link_bandwidth > 0
    assert hardware.tpu_spec("TPU v6 lite").peak_flops["bfloat16"] > v5e.peak_flops["bfloat16"]
    with pytest.raises(ValueError, match="unknown TPU device kind 'TPU v1'"):
        hardware.tpu_spec("TPU v1")
    cpu = hardware.jax_cpu_spec(4)
    assert "not a TPU" in cpu.name and cpu.link_bandwidth > 0


@pytest.mark.long  # the plugin's JAX suite in a subprocess with four devices: a minute
def test_jax_suite_on_four_cpu_devices():
    """plugins/tpu/tests: the kernel, the runner against transformers (llama, qwen3,
    Gemma 3), tensor parallel 4 == 1, no compilation once warm, the sampler."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "plugins/tpu/tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, **JAX_CPU_4},
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]


def test_attention_declines_what_its_kernel_lacks():
    import torch

    from tokenmill.platforms.interfaces import AttentionKind, AttentionSpec
    from tokenmill_tpu.attention import PallasPagedAttention

    full = PallasPagedAttention(AttentionKind.FULL, interpret=True)
    spec = AttentionSpec(AttentionKind.FULL, 8, 2, 64, torch.bfloat16, 16)
    assert full.supports(spec)
    assert not full.supports(AttentionSpec(AttentionKind.FULL, 8, 2, 64, torch.bfloat16, 16,
                                           sinks=True))
    assert not full.supports(AttentionSpec(AttentionKind.FULL, 8, 2, 64, torch.float16, 16))
    window = AttentionSpec(AttentionKind.SLIDING_WINDOW, 8, 2, 64, torch.float32, 16, 8)
    assert not full.supports(window)
    assert PallasPagedAttention(AttentionKind.SLIDING_WINDOW, interpret=True).supports(window)


def test_what_the_tpu_plugin_lacks_is_refused_naming_it(tiny_dirs):
    """The tpu plugin runs dense weights (`Capabilities.quantized_weights` False) and
    declares no quantized KV dtype: the default GGUF left unset is dequantized for it; kept
    quantized (`quantization="gguf"`) and an FP8 KV cache are errors that name the value
    and the way out, before any step runs (JAX's CPU backend, in a
    process of its own as JAX's environment must be set before it starts)."""
    code = (
        "import sys\n"
        "from tokenmill import LLM\n"
        "from tokenmill.engine.config import EngineArgs\n"
        "from tokenmill.engine.wiring import engine_quantization\n"
        "from tokenmill.model.loader import default_model_path, load_model_info\n"
        "from tokenmill.platforms.registry import load_platform\n"
        "info = load_model_info(default_model_path(), load_tokenizer=False)\n"
        "print('UNSET', engine_quantization(EngineArgs(), info, load_platform('tpu')), flush=True)\n"
        "cases = [dict(quantization='gguf'), dict(model=sys.argv[1], kv_cache_dtype='fp8')]\n"
        "for kw in cases:\n"
        "    try:\n"
        "        LLM(platform='tpu', dtype='float32', num_kv_blocks=16, **kw)\n"
        "    except Exception as e:\n"
        "        print('REFUSED', type(e).__name__, e, flush=True)\n"
        "    else:\n"
        "        print('ACCEPTED', kw, flush=True)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(tiny_dirs["llama"])], cwd=ROOT,
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, **JAX_CPU_4})
    lines = [ln for ln in result.stdout.splitlines()
             if ln.startswith(("UNSET", "REFUSED", "ACCEPTED"))]
    assert len(lines) == 3, (result.stdout + result.stderr)[-4000:]
    unset, gguf, fp8 = lines
    assert unset == "UNSET none"  # the GGUF left unset: dequantized for this platform
    assert gguf.startswith("REFUSED ValueError") and "platform 'tpu' runs dense weights only" in gguf
    assert "quantization 'gguf'" in gguf and "--quantization none" in gguf
    assert fp8.startswith("REFUSED ValueError")
    assert "kv_cache_dtype='fp8'" in fp8 and "platform 'tpu'" in fp8 and "['auto']" in fp8
