#!/usr/bin/env bash
# The cpu plugin's full certificate (every tier, full budgets, not --quick):
# docs/certificates/cpu.{json,md}.
set -euo pipefail
cd "$(dirname "$0")/../.."
tokenmill-conformance --platform cpu -q --report docs/certificates/cpu.json \
    --markdown docs/certificates/cpu.md
