"""The GPU plugins' parts that run without a GPU or the interpreter: the probes (on fake
driver files), the hardware tables, sleep mode of the device allocator, and that detection
imports neither triton nor initialises CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tokenmill.platforms.interfaces import AllocatorPurpose, OutOfMemoryError
from tokenmill_nvidia import hardware as nvidia_hardware
from tokenmill_nvidia import probe as nvidia_probe
from tokenmill_rocm import hardware as rocm_hardware
from tokenmill_rocm import probe as rocm_probe
from tokenmill_triton.memory import DeviceAllocator

GIB = 1 << 30


@pytest.fixture(autouse=True)
def no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_nvidia_probe_without_a_driver(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    found = nvidia_probe.probe(tmp_path / "version", tmp_path)
    assert not found.available and "no NVIDIA driver" in found.reason
    assert "TRITON_INTERPRET=1" in found.reason


def test_nvidia_probe_reads_the_driver_files(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar 5\n")
    found = nvidia_probe.probe(version, tmp_path)
    assert not found.available and "550.54.15 but no GPU device file" in found.reason
    (tmp_path / "nvidia0").touch()
    (tmp_path / "nvidiactl").touch()  # not a GPU
    found = nvidia_probe.probe(version, tmp_path)
    if torch.version.cuda is None:  # this machine's torch is a CPU build
        assert not found.available and "not a CUDA build" in found.reason
    else:
        assert found.available and "1 GPU(s) (nvidia0)" in found.reason


def test_rocm_probe_reads_the_kfd_topology(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    kfd, topology = tmp_path / "kfd", tmp_path / "nodes"
    assert "amdgpu kernel driver is not loaded" in rocm_probe.probe(kfd, topology).reason
    kfd.touch()
    for node, target in enumerate((0, 90402, 90402)):  # node 0 is the CPU
        (topology / str(node)).mkdir(parents=True)
        (topology / str(node) / "properties").write_text(
            f"cpu_cores_count 0\ngfx_target_version {target}\nsimd_count 1216\n")
    assert rocm_probe.gpu_targets(topology) == ["90402", "90402"]
    found = rocm_probe.probe(kfd, topology)
    if torch.version.hip is None:
        assert not found.available and "not a ROCm build" in found.reason
    else:
        assert found.available and "2 AMD GPU(s)" in found.reason


def test_probes_in_interpreter_mode(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for probe in (nvidia_probe.probe, rocm_probe.probe):
        found = probe()
        assert found.available and found.interpreter
        assert found.reason.startswith("Triton interpreter on CPU")


def test_detection_imports_nothing_heavy_and_never_initialises_the_device():
    code = (
        "import sys, json, torch\n"
        "from tokenmill.platforms.registry import PlatformRegistry\n"
        "infos = {i.name: i for i in PlatformRegistry.discover().list_platforms()}\n"
        "print(json.dumps({'triton': 'triton' in sys.modules,\n"
        "                  'cuda': torch.cuda.is_initialized(),\n"
        "                  'reasons': {n: infos[n].reason for n in ('nvidia', 'rocm')}}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["triton"] is False and result["cuda"] is False
    assert all(result["reasons"].values())


def test_nvidia_hardware_table():
    h200 = nvidia_hardware.spec_for("NVIDIA H200", 132, 141 * 10**9, 9)
    assert h200.peak_flops["bfloat16"] == pytest.approx(989.4e12)
    assert h200.memory_bandwidth == pytest.approx(4.8e12) and "132 SMs" in h200.name
    pcie = nvidia_hardware.spec_for("NVIDIA H100 PCIe", 114, 80 * GIB, 9)
    sxm = nvidia_hardware.spec_for("NVIDIA H100 80GB HBM3", 132, 80 * GIB, 9)
    assert pcie.memory_bandwidth == pytest.approx(2.0e12)
    assert sxm.memory_bandwidth == pytest.approx(3.35e12)
    assert nvidia_hardware.spec_for("NVIDIA B200", 148, 180 * GIB, 10).peak_flops[
        "bfloat16"] == pytest.approx(2.25e15)
    unknown = nvidia_hardware.spec_for("NVIDIA RTX 9999", 100, 32 * GIB, 9)
    assert "(estimated)" in unknown.name
    assert unknown.peak_flops["bfloat16"] == pytest.approx(100 * 4096 * 1.5e9)


def test_rocm_hardware_table(monkeypatch):
    for name, bandwidth, bf16 in (("AMD Instinct MI300X", 5.3e12, 1307.4e12),
                                  ("AMD Instinct MI325X", 6.0e12, 1307.4e12),
                                  ("AMD Instinct MI355X", 8.0e12, 2516.6e12)):
        spec = rocm_hardware.spec_for(name, 304, 192 * GIB, "gfx942:sramecc+:xnack-")
        assert spec.memory_bandwidth == pytest.approx(bandwidth)
        assert spec.peak_flops["bfloat16"] == pytest.approx(bf16)
    assert "gfx942" in spec.name and "304 CUs" in spec.name
    monkeypatch.setenv("TOKENMILL_ROCM_MEMORY_BANDWIDTH_GBS", "4000")
    spec = rocm_hardware.spec_for("AMD Instinct MI300X", 304, 192 * GIB, "gfx942")
    assert spec.memory_bandwidth == pytest.approx(4.0e12)
    monkeypatch.setenv("TOKENMILL_ROCM_MEMORY_BANDWIDTH_GBS", "fast")
    with pytest.raises(ValueError, match="TOKENMILL_ROCM_MEMORY_BANDWIDTH_GBS='fast'"):
        rocm_hardware.spec_for("AMD Instinct MI300X", 304, 192 * GIB, "gfx942")


def _allocator(purpose, limit=1 << 20):
    return DeviceAllocator(purpose, torch.device("cpu"), limit, "test", "nvidia")


def test_sleep_drops_the_kv_arena_and_wake_gives_it_back_zeroed():
    allocator = _allocator(AllocatorPurpose.KV_ARENA)
    arena = allocator.allocate(4096)
    layer = arena[1024:2048].view(torch.float32).view(2, 4, 32)  # a layer cache, as the core
    layer.fill_(3.0)
    assert allocator.sleep() == 4096
    assert allocator.sleeping and arena.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="asleep"):
        allocator.allocate(16)
    with pytest.raises(RuntimeError, match="already asleep"):
        allocator.sleep()
    allocator.wake()
    assert not allocator.sleeping and arena.untyped_storage().nbytes() == 4096
    assert torch.equal(layer, torch.zeros(2, 4, 32))  # the view follows its storage
    layer.fill_(1.0)
    assert arena.view(torch.float32)[256:512].eq(1.0).all()
    with pytest.raises(RuntimeError, match="not asleep"):
        allocator.wake()
    assert allocator.bytes_in_use() == 4096


def test_sleep_keeps_the_weights():
    allocator = _allocator(AllocatorPurpose.WEIGHTS)
    weights = [allocator.allocate(n) for n in (100, 3000)]
    for i, w in enumerate(weights):
        w.copy_(torch.arange(w.numel()) % 251 + i)
    expected = [w.clone() for w in weights]
    allocator.sleep()
    assert all(w.untyped_storage().nbytes() == 0 for w in weights)
    allocator.wake()
    assert all(torch.equal(w, e) for w, e in zip(weights, expected))


def test_device_allocator_limits_and_double_free():
    allocator = _allocator(AllocatorPurpose.KV_ARENA, limit=1000)
    with pytest.raises(OutOfMemoryError, match="cannot allocate 1001 bytes"):
        allocator.allocate(1001)
    buffer = allocator.allocate(1000)
    allocator.free(buffer)
    with pytest.raises(ValueError, match="already freed"):
        allocator.free(buffer)
    assert allocator.bytes_in_use() == 0


def test_cuda_graph_buckets_and_the_interpreter_runs_eagerly(monkeypatch):
    from tokenmill_nvidia.plugin import plugin
    from tokenmill_rocm.plugin import plugin as rocm_plugin
    from tokenmill_triton.graphs import CudaGraphCapture
    from tokenmill_triton.platform_kit import GPU_CAPABILITIES

    graphs = CudaGraphCapture()
    assert graphs.batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graphs.batch_sizes(3) == [1, 2, 3] and graphs.batch_sizes(1) == [1]
    assert graphs.batch_sizes(4096)[-1] == 512
    with pytest.raises(KeyError, match="no graph was captured for batch size 8"):
        graphs.replay(8)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    platform = plugin.tokenmill_platform()
    assert not platform.capabilities.graphs and GPU_CAPABILITIES.graphs
    assert plugin.tokenmill_graph_capture(platform) is None
    rocm = rocm_plugin.tokenmill_platform()
    assert not rocm.capabilities.graphs and GPU_CAPABILITIES.graphs
    assert rocm_plugin.tokenmill_graph_capture(rocm) is None
