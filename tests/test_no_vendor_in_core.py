"""The core never names a vendor API: no torch.cuda, triton or jax under core/ or platforms/.

Vendor code lives in plugins; the core branches on declared capabilities. This scans the
source text, so a lazy import inside a function is caught as well.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("core", "platforms")
VENDOR_PATTERNS = {
    "torch.cuda": re.compile(r"\btorch\s*\.\s*cuda\b|\bfrom\s+torch\s+import\s+[^\n]*\bcuda\b"),
    "triton": re.compile(r"^\s*(?:import|from)\s+triton\b|\btriton\s*\.\s*\w", re.MULTILINE),
    "jax": re.compile(r"^\s*(?:import|from)\s+(?:jax|jaxlib)\b|\bjax\s*\.\s*\w", re.MULTILINE),
}


def vendor_mentions(text: str) -> list[tuple[int, str]]:
    """(line number, vendor) for every vendor import or attribute use in `text`."""
    hits = []
    for vendor, pattern in VENDOR_PATTERNS.items():
        for match in pattern.finditer(text):
            hits.append((text.count("\n", 0, match.start()) + 1, vendor))
    return sorted(hits)


@pytest.mark.parametrize(
    "snippet, vendor",
    [
        ("import torch.cuda", "torch.cuda"),
        ("if torch.cuda.is_available():", "torch.cuda"),
        ("from torch import nn, cuda", "torch.cuda"),
        ("import triton.language as tl", "triton"),
        ("    from triton import jit", "triton"),
        ("x = jax.numpy.zeros(3)", "jax"),
        ("import jax", "jax"),
        ("from jaxlib import xla_client", "jax"),
    ],
)
def test_the_scanner_catches_vendor_use(snippet, vendor):
    assert vendor_mentions(snippet) == [(1, vendor)]


def test_the_scanner_allows_plain_prose():
    assert vendor_mentions("# plugins may use Triton or JAX kernels; torch is fine") == []


def test_core_and_platforms_name_no_vendor_api():
    files = [path for folder in SCANNED for path in sorted((ROOT / folder).rglob("*.py"))]
    assert files, f"no source found under {SCANNED} in {ROOT}"
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {vendor}"
        for path in files
        for line, vendor in vendor_mentions(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "vendor APIs in the core (move them into a plugin):\n" + "\n".join(
        offenders
    )
