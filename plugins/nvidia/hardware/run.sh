#!/usr/bin/env bash
# The prepared hardware run of the nvidia plugin, written for one H200 (any CUDA GPU works).
#
#   plugins/nvidia/hardware/run.sh            # on the GPU machine, from any directory
#   plugins/nvidia/hardware/run.sh --dry-run  # anywhere: tiny shapes in Triton's interpreter
#
# 1. installs core + tokenmill-triton + tokenmill-nvidia + the conformance suite (editable,
#    into a venv that sees the machine's CUDA build of torch; the GPU machine has no
#    network, so dependencies must be installed already, or be wheels in $WHEELHOUSE);
# 2. benchmarks a random-weight Llama-3-8B-shaped model in bf16: batch-1 and batch-64 decode
#    against the HBM bandwidth roofline, a 4096-token prefill against the bf16 peak
#    (bench_llama.py), and writes docs/hardware-results.md with date, versions, fractions;
# 3. certifies the plugin T0-T5 (docs/certificates/nvidia-h200.{json,md});
# 4. times the Triton kernels (benchmarks/bench_triton.py) against the HBM and bf16 peaks,
#    and rewrites the report with the certificate's verdict and the kernel table; times the
#    LINEAR backend's three variants against the reference ($out/triton-linear.md,
#    benchmarks/bench_triton_linear.py);
# 5. (GPU only) runs the kernel cases of tests/triton on the device: the fused MoE, Gated
#    DeltaNet, KDA and Mamba2 (conv, chunked scans, recurrences, the LINEAR backend) and
#    MLA kernels, which the interpreter has checked but no GPU yet ($out/kernel-cases.txt).
# Outputs go to $TOKENMILL_HW_OUT (default: the repository's docs/); scratch (the venv, the
# 16 GB model) to $TOKENMILL_HW_WORKDIR (default /tmp/tokenmill-hardware). Exit status: the
# certification's (0 certified), or 2 when the machine has no usable GPU.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
cd "$root"
dry=0
[[ "${1:-}" == "--dry-run" ]] && dry=1
work=${TOKENMILL_HW_WORKDIR:-/tmp/tokenmill-hardware}
mkdir -p "$work"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if (( dry )); then
    export TRITON_INTERPRET=1
    out=${TOKENMILL_HW_OUT:-$work/out}
    tiers=T0  # the dry run checks this script's plumbing, not the plugin
    cert=$out/nvidia-dry-run
else
    out=${TOKENMILL_HW_OUT:-$root/docs}
    tiers=T0-T5
    cert=$out/certificates/nvidia-h200
    if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        echo "run.sh: torch sees no CUDA device (torch.version.cuda: $(python3 -c \
            'import torch; print(torch.version.cuda)' 2>/dev/null || echo 'no torch'))" >&2
        exit 2
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
    python3 -m venv --system-site-packages "$work/venv"
    # shellcheck disable=SC1091
    . "$work/venv/bin/activate"
    # A venv's bundled setuptools may predate 70.1 (no built-in bdist_wheel, so building
    # without network fails): drop it when it is older, and use the machine's.
    if ! python3 -c 'import setuptools, sys
v = tuple(int(x) for x in setuptools.__version__.split(".")[:2])
sys.exit(0 if v >= (70, 1) else 1)' 2>/dev/null; then
        pip uninstall -q -y setuptools || true
    fi
    packages=(-e . -e plugins/triton -e plugins/nvidia -e ./conformance_tests)
    if [[ -n "${WHEELHOUSE:-}" ]]; then
        pip install -q --no-index --find-links "$WHEELHOUSE" "${packages[@]}"
    else
        pip install -q --no-deps --no-build-isolation "${packages[@]}"
        pip check || echo "run.sh: some dependencies above are missing; set \$WHEELHOUSE" >&2
    fi
fi
mkdir -p "$out" "$(dirname "$cert")"

echo "== platforms"
tokenmill platforms
python3 -c 'from tokenmill.platforms.registry import load_platform; print(load_platform("nvidia"))'

# Most valuable first, in case the machine's time runs out: the model benchmark, then the
# certificate, then the kernel table; the report is rewritten at the end with all three.
dry_flag=()
(( dry )) && dry_flag=(--dry-run)
report=(--out "$out/hardware-results.md" --results "$work/llama-results.json"
        --certificate "$cert.json" --kernels "$work/kernels.md" --workdir "$work")
rm -f "$work/llama-results.json" "$work/kernels.md"
echo "== Llama-3-8B-shaped model"
timeout 420 python3 "$here/bench_llama.py" "${dry_flag[@]}" "${report[@]}" \
    || echo "run.sh: bench_llama.py failed (status $?)" >&2

echo "== certification $tiers"
cert_rc=0
timeout 420 tokenmill-conformance --platform nvidia --tier "$tiers" --quick -q \
    --report "$cert.json" --markdown "$cert.md" || cert_rc=$?

echo "== kernels"
timeout 180 python3 benchmarks/bench_triton.py --platform nvidia --markdown "$work/kernels.md" \
    || echo "run.sh: bench_triton.py failed (status $?)" >&2
timeout 180 python3 benchmarks/bench_triton_linear.py --platform nvidia \
    --markdown "$out/triton-linear.md" \
    || echo "run.sh: bench_triton_linear.py failed (status $?)" >&2
if [[ -f "$work/llama-results.json" ]]; then
    python3 "$here/bench_llama.py" "${dry_flag[@]}" "${report[@]}" --render-only > /dev/null
fi

if (( ! dry )); then  # in the interpreter these are the default suite's (tests/triton)
    echo "== kernel cases on the device"
    (cd tests/triton && timeout 240 python3 -m pytest -q -p no:cacheprovider --rootdir . \
        kernel_cases.py gated_delta_cases.py kda_cases.py mamba2_cases.py linear_cases.py \
        mla_cases.py) \
        > "$out/kernel-cases.txt" 2>&1 || echo "run.sh: kernel cases failed (see $out/kernel-cases.txt)" >&2
    tail -3 "$out/kernel-cases.txt"
fi

echo "run.sh: wrote $out/hardware-results.md and $cert.{json,md} (certification status $cert_rc)"
exit "$cert_rc"
