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
lists the launches; `compile_target` runs it in a subprocess with a timeout per kernel, so
one kernel that LLVM or ptxas cannot finish is recorded as such and the rest still compile).

Per compiled kernel: NVIDIA registers and spill bytes from the `ptxas -v` log of the
entry function (Triton's own ptxas run, `knobs.nvidia.dump_ptxas_log`; the same ptxas and
flags again where Triton's cache had the cubin), AMD VGPRs and scratch bytes from the
assembly's metadata (SGPRs spilled into VGPR lanes, which touch no memory, noted beside the
launch settings); shared memory from Triton's metadata (dynamic shared memory / LDS).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
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
    spill_bytes: int | None  # NVIDIA: spill stores + loads; AMD: scratch bytes per lane
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
def compiling_for(name: str, records: list[KernelCompile], case: Callable[[], str],
                  skip: frozenset[tuple[str, str]] = frozenset(),
                  on_start: Callable[[str, str, str], None] | None = None,
                  on_record: Callable[[KernelCompile], None] | None = None) -> Iterator[None]:
    """While active, every kernel launch compiles for target `name` instead of running and
    appends a record (once per distinct specialization, none for those in `skip`);
    `case()` names the launch; on_start / on_record: see compile_cases."""
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
        if (fn.name, config) in seen or (fn.name, config) in skip:
            return True
        seen.add((fn.name, config))
        if on_start is not None:
            on_start(fn.name, config, case())
        records.append(_compile_one(name, target, kernel, fn.name, config, case(), compile))
        if on_record is not None:
            on_record(records[-1])
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
    from triton import knobs
    from triton.compiler import ASTSource

    start = time.perf_counter()
    options = {k: compile[k] for k in ("num_warps", "num_ctas", "num_stages",
                                       "enable_fp_fusion", "launch_cooperative_grid")}
    src = ASTSource(kernel, compile["signature"], compile["constants"], compile["configs"][0])
    log = io.StringIO()  # Triton prints its own `ptxas -v` log when asked (a public knob)
    try:
        with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True
            compiled = triton.compile(src, target=target, options=options)
    except Exception as exc:  # the record says why: a compile error fails the certificate
        return KernelCompile(target_name, name, config, case, None, None, None,
                             time.perf_counter() - start, _first_lines(exc))
    shared = int(compiled.metadata.shared)
    if target.backend == "cuda":
        registers, spills, error = _nvidia_usage(compiled, log.getvalue(), target.arch)
    else:
        registers, spills, lane_spills, error = _amdgcn_usage(compiled.asm["amdgcn"])
        if lane_spills:  # beside the launch settings: no memory, not a problem
            config += f"; {lane_spills} SGPRs spilled to VGPR lanes"
    return KernelCompile(target_name, name, config, case, registers, spills, shared,
                         time.perf_counter() - start, error)


def _first_lines(exc: BaseException, limit: int = 1500) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + " ..."


def _nvidia_usage(compiled, log: str, arch: int) -> tuple[int | None, int | None, str | None]:
    """(registers, spill bytes, error) of the compiled kernel from the `ptxas -v` log of
    Triton's own ptxas run, or, where Triton took the cubin from its cache (no ptxas ran),
    from running the same ptxas again on the PTX."""
    name = compiled.metadata.name
    if f"Compiling entry function '{name}'" not in log:
        log, error = _run_ptxas(compiled.asm["ptx"], arch)
        if error is not None:
            return None, None, error
    try:
        registers, spills = ptxas_usage(log, name)
    except ValueError as exc:
        return None, None, str(exc)
    return registers, spills, None


def _run_ptxas(ptx: str, arch: int) -> tuple[str, str | None]:
    """(`ptxas -v` log, error) with the ptxas, architecture name and register allocation
    option Triton compiles with."""
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
        return log, f"ptxas failed ({result.returncode}): {log[-1500:]}"
    return log, None


_ENTRY = re.compile(r"^\S*ptxas\S* info\s*: Compiling entry function '([^']+)'", re.MULTILINE)


def ptxas_usage(log: str, kernel: str) -> tuple[int, int]:
    """(registers per thread, spill bytes: stores + loads) of entry function `kernel` in a
    `ptxas -v` log. A PTX module can hold several functions: only the lines from
    "Compiling entry function 'kernel'" to the next entry count, and the spills of every
    function listed there (the entry and the device functions it calls) add up."""
    entries = list(_ENTRY.finditer(log))
    for i, entry in enumerate(entries):
        if entry.group(1) != kernel:
            continue
        block = log[entry.end():entries[i + 1].start() if i + 1 < len(entries) else len(log)]
        registers = re.search(r"Used (\d+) registers", block)
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
        if registers is None or not spills:
            raise ValueError(f"ptxas -v gives no register or spill line for {kernel!r}: "
                             f"{block[-800:]}")
        return int(registers.group(1)), sum(int(s) + int(ld) for s, ld in spills)
    raise ValueError(f"ptxas -v compiled no entry function {kernel!r} (entries: "
                     f"{[e.group(1) for e in entries]}): {log[-800:]}")


def _amdgcn_usage(asm: str) -> tuple[int | None, int | None, int | None, str | None]:
    """(VGPRs, spill bytes, SGPRs spilled into VGPR lanes, error) from the AMDGPU assembly's
    kernel metadata. Spill bytes are the scratch memory a lane needs
    (`private_segment_fixed_size`, where every VGPR spill lands) and at least 4 bytes per
    spilled VGPR: memory traffic, what a spill costs. An SGPR spill goes to a lane of a VGPR
    (`v_writelane` / `v_readlane`, register moves, no memory) while one is free, to scratch
    only when none is, and is then in the scratch bytes too; the count is returned apart."""
    def field(name: str) -> int | None:
        found = re.search(rf"\.{name}:\s+(\d+)", asm)
        return int(found.group(1)) if found else None

    vgprs, vgpr_spills, sgpr_spills, scratch = (
        field("vgpr_count"), field("vgpr_spill_count"), field("sgpr_spill_count"),
        field("private_segment_fixed_size"))
    if vgprs is None or vgpr_spills is None or sgpr_spills is None or scratch is None:
        return None, None, None, ("the AMDGPU metadata lacks vgpr_count / *_spill_count / "
                                  "private_segment_fixed_size")
    return vgprs, max(scratch, 4 * vgpr_spills), sgpr_spills, None


def compile_cases(target: str, configs, cases: dict[str, Callable[[], None]],
                  skip: frozenset[tuple[str, str]] = frozenset(),
                  on_start: Callable[[str, str, str], None] | None = None,
                  on_record: Callable[[KernelCompile], None] | None = None) -> list[KernelCompile]:
    """Run each case (a launch at production shapes, see aot_cases) for `target`; the
    specializations in `skip` ((kernel, config) pairs) are neither compiled nor recorded.
    `on_start(kernel, config, case)` is called before each compile, `on_record` after."""
    records: list[KernelCompile] = []
    current = [""]
    with compiling_for(target, records, lambda: current[0], skip, on_start, on_record):
        for name, launch in cases.items():
            current[0] = name
            launch()
    return records


@dataclass(slots=True)
class _Worker:
    """One `python -m tokenmill_triton.aot` process of compile_plugin and what it said."""

    process: subprocess.Popen
    lines: queue.Queue  # stdout lines, then None at end of output
    stderr: list[str]
    stderr_reader: threading.Thread
    started: dict | None = None  # the compile in progress: kernel, config, case
    since: float = 0.0


def _start_worker(command: list[str], env: dict[str, str]) -> _Worker:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    lines: queue.Queue = queue.Queue()
    stderr: list[str] = []

    def pump() -> None:
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    stderr_reader = threading.Thread(target=lambda: stderr.extend(process.stderr), daemon=True)
    stderr_reader.start()
    return _Worker(process, lines, stderr, stderr_reader, since=time.perf_counter())


def compile_target(target: str, configs_ref: str, cases: list[str] | None = None,
                   kernel_timeout: float = 1200.0) -> list[dict]:
    """Records (as dicts) of every kernel launch of `cases` (aot_cases names; None: all)
    for `target` with the launch settings `configs_ref` ('module:ATTRIBUTE', e.g.
    "tokenmill_nvidia.configs:HOPPER"), in a fresh process without the interpreter that
    streams one record per kernel. A kernel whose compile runs past `kernel_timeout`
    seconds (LLVM or ptxas) becomes a record with that error: the process is killed and a
    new one runs the cases again, skipping that specialization and those recorded. A process that fails otherwise
    gives one record with its exact error, after the records it produced."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated
    base = [sys.executable, "-m", "tokenmill_triton.aot", configs_ref, target]
    for name in cases or []:
        base += ["--case", name]
    records: list[dict] = []
    while True:  # a restarted process skips what is recorded: compiled, failed or timed out
        command = base + [a for r in records for a in ("--skip", f"{r['kernel']}\t{r['config']}")]
        worker = _start_worker(command, env)
        timed_out = _collect(worker, records, kernel_timeout)
        if timed_out is None:
            break
        records.append(asdict(KernelCompile(
            target, timed_out["kernel"], timed_out["config"], timed_out["case"], None, None,
            None, kernel_timeout, f"compile timed out after {kernel_timeout:.0f} s (LLVM and "
            "ptxas still running; killed, the remaining kernels compiled in a new process)")))
    worker.process.wait()
    worker.stderr_reader.join(timeout=10.0)
    if worker.process.returncode != 0:
        error = (f"`{' '.join(command[1:])}` exited with {worker.process.returncode}: "
                 f"{''.join(worker.stderr)[-2000:]}")
        case = worker.started["case"] if worker.started else ""
        records.append(asdict(KernelCompile(target, "<all>", configs_ref, case, None, None,
                                            None, 0.0, error)))
    return records


def _collect(worker: _Worker, records: list[dict], kernel_timeout: float) -> dict | None:
    """Read the worker's lines into `records` until it ends (None) or a compile runs past
    `kernel_timeout` (kills the worker; returns that compile's kernel, config, case)."""
    while True:
        wait = 5.0 if worker.started is None else max(
            0.0, kernel_timeout - (time.perf_counter() - worker.since))
        try:
            line = worker.lines.get(timeout=wait)
        except queue.Empty:
            line = ""
        if line is None:
            return None
        if line.strip():
            message = json.loads(line)
            if "record" in message:
                records.append(message["record"])
                worker.started = None
            else:
                worker.started, worker.since = message["compiling"], time.perf_counter()
        if worker.started is not None and time.perf_counter() - worker.since > kernel_timeout:
            worker.process.kill()
            worker.process.wait()
            return worker.started


def compile_plugin(builds: dict[str, str], cases: list[str] | None = None,
                   kernel_timeout: float = 1200.0) -> list[dict]:
    """compile_target for each target of `builds` (target -> launch settings
    'module:ATTRIBUTE', e.g. {"sm_90": "tokenmill_nvidia.configs:HOPPER"}), one target
    after the other (ptxas and LLVM take a core each; side by side they only contend)."""
    records = []
    for target, configs_ref in builds.items():
        records += compile_target(target, configs_ref, cases, kernel_timeout)
    return records


def main(argv: list[str]) -> int:
    """`python -m tokenmill_triton.aot MODULE:CONFIGS TARGET [--case NAME]... [--skip
    KERNEL<tab>CONFIG]...`: one JSON line per compile started ({"compiling": {kernel,
    config, case}}) and per record ({"record": {...}}) on stdout, flushed as they come."""
    import argparse
    import importlib
    import logging

    from tokenmill_triton.aot_cases import launch_cases

    logging.disable(logging.WARNING)
    parser = argparse.ArgumentParser(prog="python -m tokenmill_triton.aot",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", help="launch settings, module:ATTRIBUTE")
    parser.add_argument("target", choices=sorted(TARGETS))
    parser.add_argument("--case", action="append", default=[],
                        help="an aot_cases name (repeat for more; default: every case)")
    parser.add_argument("--skip", action="append", default=[],
                        help="KERNEL<tab>CONFIG: a specialization not to compile")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    args = parser.parse_args(argv)
    module, _, attr = args.configs.partition(":")
    configs = getattr(importlib.import_module(module), attr)
    cases = launch_cases(configs)
    if args.list:
        print("\n".join(cases))
        return 0
    unknown = [c for c in args.case if c not in cases]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; `--list` prints the known ones")
    chosen = {name: cases[name] for name in args.case} if args.case else cases
    skip = frozenset(tuple(s.split("\t", 1)) for s in args.skip)

    def say(message: dict) -> None:
        print(json.dumps(message), flush=True)

    compile_cases(args.target, configs, chosen, skip,
                  on_start=lambda kernel, config, case: say(
                      {"compiling": {"kernel": kernel, "config": config, "case": case}}),
                  on_record=lambda record: say({"record": asdict(record)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
