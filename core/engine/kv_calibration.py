"""The sample a quantized KV cache's scales are calibrated on (`calculate_kv_scales`).

vLLM computes its scales from the first batch it runs; tokenmill computes them before any
request, from a fixed text every instance has: CPython's own `heapq.py`, `bisect.py`,
`fractions.py` and `statistics.py` (English prose in their docstrings, code after), read
from the interpreter's stdlib, no download. Two engines of the same model, dtype and
platform so calibrate to the same scales, and a scale never changes once KV is stored
with it. The files are not those `benchmarks/bench_kv_quant_accuracy.py` scores.
"""

from __future__ import annotations

import logging
import sysconfig
from pathlib import Path

logger = logging.getLogger(__name__)

CALIBRATION_FILES = ("heapq.py", "bisect.py", "fractions.py", "statistics.py")
# tokens of the sample the calibration prefill runs (fewer when a step or the context
# holds fewer): enough for every head to see typical and outlier tokens
CALIBRATION_TOKENS = 1024


def calibration_text() -> str:
    """The calibration sample's text: CALIBRATION_FILES from the stdlib, in that order.
    FileNotFoundError naming the directory when the interpreter ships none of them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = [(root / name).read_text(encoding="utf-8") for name in CALIBRATION_FILES
             if (root / name).is_file()]
    if not parts:
        raise FileNotFoundError(
            f"calculate_kv_scales calibrates on {CALIBRATION_FILES} from the Python stdlib, "
            f"and {root} holds none of them; drop calculate_kv_scales")
    return "\n\n".join(parts)


def calibration_token_ids(
    calculate_kv_scales: bool, kv_cache_quantized: bool, tokenizer, most_tokens: int
) -> tuple[int, ...]:
    """The token ids the workers calibrate KV scales on: empty unless `calculate_kv_scales`
    with a quantized KV cache (with `kv_cache_dtype` auto it does nothing, as in vLLM, and
    says so); else the sample's first min(CALIBRATION_TOKENS, `most_tokens`) tokens."""
    if not calculate_kv_scales:
        return ()
    if not kv_cache_quantized:
        logger.warning("calculate_kv_scales is ignored: kv_cache_dtype is 'auto', the KV "
                       "cache is not quantized and takes no scales")
        return ()
    ids = tokenizer.encode(calibration_text())
    return tuple(ids[: min(CALIBRATION_TOKENS, most_tokens)])
