#!/usr/bin/env bash
# Certify the nvidia and rocm plugins T0-T3 with their Triton kernels in Triton's interpreter
# (no GPU needed) and write docs/certificates/{nvidia,rocm}-interpreter.{json,md}.
# tests/conformance/test_gpu_plugins.py runs the same certification in CI.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p docs/certificates
for platform in nvidia rocm; do
    TRITON_INTERPRET=1 tokenmill-conformance --platform "$platform" --tier T0-T3 --quick -q \
        --report "docs/certificates/$platform-interpreter.json" \
        --markdown "docs/certificates/$platform-interpreter.md"
done
