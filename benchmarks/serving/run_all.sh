#!/usr/bin/env bash
# The runs behind docs/benchmarks-peers.md, in the order they were made.
#   bash benchmarks/serving/run_all.sh [sweep|workloads]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}  # the environment tokenmill is installed in
R=benchmarks/serving/results
case "${1:-sweep}" in
  sweep)  # the batching engines 3 times, the one-request-at-a-time servers once, shorter points
    "$PY" benchmarks/serving/run.py --engines tokenmill vllm --workloads sweep --repeats 3 \
      --out $R/sweep-batching.json
    "$PY" benchmarks/serving/run.py --engines llamacpp-q4_1 llamacpp-bf16 transformers \
      --workloads sweep --repeats 1 --point-limit-s 30 --out $R/sweep-serial.json ;;
  workloads)
    "$PY" benchmarks/serving/run.py --engines tokenmill vllm transformers llamacpp-q4_1 llamacpp-bf16 \
      --workloads offline-uniform offline-mixed shared-prefix multi-turn claude-code mooncake \
      --out $R/workloads.json ;;
  *) echo "usage: $0 [sweep|workloads]" >&2; exit 2 ;;
esac
"$PY" benchmarks/serving/report.py $R/*.json --plot docs/benchmarks-peers-sweep.png
