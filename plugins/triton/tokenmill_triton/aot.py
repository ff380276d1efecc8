"""Ahead-of-time compiles of the package's Triton kernels for real GPU targets, on a machine
without the GPU: what a plugin's launches compile to, with registers, spills and shared
memory per kernel and launch configuration.

How: the plugin's own launchers run on CPU tensors of production shapes while Triton's
active driver is a `TargetDriver` (Triton's `driver.set_active`) that reports the target
(sm_90, sm_100, gfx942, ...) and Triton's `knobs.runtime.jit_cache_hook` receives every
launch's specialization (argument types and alignments, constexprs, warps, stages) just
before Triton would compile it. The hook compiles that specialization with
`triton.compile(ASTSource(...), target=GPUTarget(...))` (the LLVM backend, and for NVIDIA
the ptxas that ships in the triton wheel) and tells Triton not to launch. Both are
Triton's public extension points; nothing of Triton is patched, and both are restored on
exit. The kernels are the ones the GPU runs (not interpreted), so this module must run in
a process without TRITON_INTERPRET=1: `python -m tokenmill_triton.aot` (aot_cases.py
lists the launches; `compile_plugin` runs it in a subprocess).

Per compiled kernel: NVIDIA registers and spill bytes from `ptxas -v` on the kernel's PTX
(the same ptxas and flags Triton used), AMD VGPRs, SGPRs and spill counts from the
assembly's metadata; shared memory from Triton's metadata (dynamic shared memory / LDS).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

# name -> (backend, arch, warp size) of triton.backends.compiler.GPUTarget
TARGETS = {
    "sm_90": ("cuda", 90, 32),  # H100, H200
    "sm_100": ("cuda", 100, 32),  # B200
    "gfx942": ("hip", "gfx942", 64),  # MI300X, MI325X
    "gfx950": ("hip", "gfx950", 64),  # MI350X, MI355X
}


@dataclass(frozen=True, slots=True)
class KernelCompile:
    """One kernel specialization compiled for one target (the certificate's record)."""

    target: str
    kernel: str
    config: str  # the launch configuration: constexprs, warps, stages
    case: str  # the launch that produced it (op and shape)
    registers: int | None  # per thread (NVIDIA) / VGPRs per lane (AMD)
    spill_bytes: int | None  # NVIDIA: spill stores; AMD: VGPR + SGPR spills (count x 4)
    shared_bytes: int | None  # dynamic shared memory (NVIDIA) / LDS (AMD) per program
    seconds: float
    error: str | None = None


class TargetDriver:
    """The parts of a Triton driver that `JITFunction.run` reads before compiling, for a
    target that is not attached: the target, a device index of its own (Triton caches
    binders per device index) and a stream that is never used."""

    def __init__(self, target, device_index: int) -> None:
        self.target = target
        self.device_index = device_index

    @classmethod
    def is_active(cls) -> bool:
        return False

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return self.device_index

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


def gpu_target(name: str):
    from triton.backends.compiler import GPUTarget

    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; known: {sorted(TARGETS)}")
    return GPUTarget(*TARGETS[name])


@contextlib.contextmanager
def compiling_for(name: str, records: list[KernelCompile], case: Callable[[], str]) -> Iterator[None]:
    """While active, every kernel launch compiles for target `name` instead of running and
    appends a record (once per distinct specialization); `case()` names the launch."""
    import triton
    from triton import knobs
    from triton.runtime.driver import driver

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("ahead-of-time compiles need real Triton kernels: unset "
                           "TRITON_INTERPRET (run `python -m tokenmill_triton.aot`)")
    target = gpu_target(name)
    seen: set[tuple[str, str]] = set()

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled) -> bool:
        kernel = fn.jit_function
        config = _config_text(kernel, compile)
        if (fn.name, config) in seen:
            return True
        seen.add((fn.name, config))
        records.append(_compile_one(name, target, kernel, fn.name, config, case(), compile))
        return True  # compiled here: Triton neither compiles nor launches it

    previous_hook = knobs.runtime.jit_cache_hook
    driver.set_active(TargetDriver(target, 1000 + sorted(TARGETS).index(name)))
    knobs.runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = previous_hook
        # back to "none chosen": the next use finds the default driver again (on a machine
        # without a GPU there is none, and reset_active() would raise)
        driver.set_active(None)
    del triton


def _config_text(kernel, compile: dict) -> str:
    """'HEAD=128, TILE_N=64, ...; pointers bf16,fp32,i32; num_warps=4, num_stages=3': the
    constexprs by name (arguments specialised to a constant included), the pointer types."""
    def name(path) -> str:
        return kernel.arg_names[path[0]] if isinstance(path, tuple) and len(path) == 1 else str(path)

    constants = ", ".join(f"{name(k)}={v}" for k, v in sorted(
        compile["constants"].items(), key=lambda kv: name(kv[0])))
    pointers = ",".join(sorted({t.removeprefix("*") for t in compile["signature"].values()
                                if isinstance(t, str) and t.startswith("*")}))
    return (f"{constants}; pointers {pointers}; num_warps={compile['num_warps']}, "
            f"num_stages={compile['num_stages']}")


def _compile_one(target_name, target, kernel, name, config, case, compile) -> KernelCompile:
    import triton
    from triton.compiler import ASTSource

    start = time.perf_counter()
    options = {k: compile[k] for k in ("num_warps", "num_ctas", "num_stages",
                                       "enable_fp_fusion", "launch_cooperative_grid")}
    src = ASTSource(kernel, compile["signature"], compile["constants"], compile["configs"][0])
    try:
        compiled = triton.compile(src, target=target, options=options)
    except Exception as exc:  # the record says why: a compile error fails the certificate
        return KernelCompile(target_name, name, config, case, None, None, None,
                             time.perf_counter() - start, _first_lines(exc))
    shared = int(compiled.metadata.shared)
    if target.backend == "cuda":
        registers, spills, error = _ptxas_usage(compiled.asm["ptx"], target.arch)
    else:
        registers, spills, error = _amdgcn_usage(compiled.asm["amdgcn"])
    return KernelCompile(target_name, name, config, case, registers, spills, shared,
                         time.perf_counter() - start, error)


def _first_lines(exc: BaseException, limit: int = 1500) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + " ..."


def _ptxas_usage(ptx: str, arch: int) -> tuple[int | None, int | None, str | None]:
    """(registers per thread, spill store bytes, error) from `ptxas -v` on the PTX, with
    the ptxas and architecture name Triton compiled it with."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory(prefix="tokenmill-aot-") as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        command = [ptxas, "-v", "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(arch)}",
                   path, "-o", os.path.join(tmp, "kernel.cubin")]
        result = subprocess.run(command, capture_output=True, text=True)
    log = result.stderr + result.stdout
    if result.returncode != 0:
        return None, None, f"ptxas failed ({result.returncode}): {log[-1500:]}"
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if registers is None or spills is None:
        return None, None, f"could not read ptxas -v output: {log[-800:]}"
    return int(registers.group(1)), int(spills.group(1)) + int(spills.group(2)), None


def _amdgcn_usage(asm: str) -> tuple[int | None, int | None, str | None]:
    """(VGPRs, spill bytes, error) from the AMDGPU assembly's kernel metadata."""
    def field(name: str) -> int | None:
        found = re.search(rf"\.{name}:\s+(\d+)", asm)
        return int(found.group(1)) if found else None

    vgprs, vgpr_spills, sgpr_spills = field("vgpr_count"), field("vgpr_spill_count"), field(
        "sgpr_spill_count")
    if vgprs is None or vgpr_spills is None or sgpr_spills is None:
        return None, None, "the AMDGPU metadata lacks vgpr_count / *_spill_count"
    return vgprs, 4 * (vgpr_spills + sgpr_spills), None


def compile_cases(target: str, configs, cases: dict[str, Callable[[], None]]) -> list[KernelCompile]:
    """Run each case (a launch at production shapes, see aot_cases) for `target`."""
    records: list[KernelCompile] = []
    current = [""]
    with compiling_for(target, records, lambda: current[0]):
        for name, launch in cases.items():
            current[0] = name
            launch()
    return records


def compile_plugin(builds: dict[str, str], timeout: float = 3000.0) -> list[dict]:
    """Records (as dicts) of every kernel launch of the shared kernels for each target of
    `builds` (target -> launch settings 'module:ATTRIBUTE', e.g. {"sm_90":
    "tokenmill_nvidia.configs:HOPPER"}), each target compiled in a fresh process without the
    interpreter, the targets side by side. A target whose compile cannot run at all gets one
    record with the exact error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated
    running = []
    for target, configs_ref in builds.items():
        command = [sys.executable, "-m", "tokenmill_triton.aot", configs_ref, target]
        running.append((target, configs_ref, command, subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)))
    records = []
    for target, configs_ref, command, process in running:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
            err = f"timed out after {timeout} s. {err}"
        if process.returncode != 0:
            error = f"`{' '.join(command[1:])}` exited with {process.returncode}: {err[-2000:]}"
            records.append(asdict(KernelCompile(target, "<all>", configs_ref, "", None, None,
                                                None, 0.0, error)))
        else:
            records += json.loads(out)
    return records


def main(argv: list[str]) -> int:
    """`python -m tokenmill_triton.aot MODULE:CONFIGS TARGET...`: JSON records on stdout."""
    import importlib
    import logging

    from tokenmill_triton.aot_cases import launch_cases

    logging.disable(logging.WARNING)
    if len(argv) < 2:
        print(__doc__.split("\n\n")[0], "\nusage: python -m tokenmill_triton.aot "
              "module:CONFIGS target...", file=sys.stderr)
        return 2
    module, _, attr = argv[0].partition(":")
    configs = getattr(importlib.import_module(module), attr)
    records = []
    for target in argv[1:]:
        records += [asdict(r) for r in compile_cases(target, configs, launch_cases(configs))]
    json.dump(records, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
