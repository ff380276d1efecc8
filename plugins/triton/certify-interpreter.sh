#!/usr/bin/env bash
# Certify the nvidia and rocm plugins T0-T3 with their Triton kernels in Triton's interpreter
# (no GPU needed) and write docs/certificates/{nvidia,rocm}-interpreter.{json,md}: the
# certification test of tests/conformance/test_gpu_plugins.py (what CI runs), keeping the
# certificates it checked. About 6 minutes per plugin on 2 shared cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
TOKENMILL_WRITE_CERTIFICATES=1 python -m pytest -q -p no:cacheprovider \
    -m certify tests/conformance/test_gpu_plugins.py -k certifies
