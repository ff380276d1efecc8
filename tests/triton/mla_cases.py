"""The Triton MLA backend (tokenmill_triton.mla) against the core's reference MLA on
random paged, ragged steps (the conformance suite's MLA harness): decodes, prefill chunks
after cached context and fresh prompts in one launch, NaN in every unwritten latent slot.
Run by test_triton_kernels.py in a fresh process (TRITON_INTERPRET=1 without a GPU); the
certification's T1 (t1/test_mla.py) runs the same backend through the plugin."""

from __future__ import annotations

import pytest
import torch

from tokenmill.platforms.interfaces import MLADims
from tokenmill_conformance.attention_harness import mixed_batch
from tokenmill_conformance.mla_harness import check_mla_step, make_mla_step, mla_spec, mla_to_device
from tokenmill_triton.configs import KernelConfigs, MLAConfig, interpreter_mode
from tokenmill_triton.mla import TritonMLAAttention

DEVICE = torch.device("cpu" if interpreter_mode() else "cuda")
CONFIGS = KernelConfigs(mla=MLAConfig(block_h=16, tile_n=16), upcast_bf16_dot=interpreter_mode())
DIMS = [MLADims(64, 32, 16, 32), MLADims(24, 12, 6, 20)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("dims", DIMS, ids=["deepseek_like", "odd"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mla_matches_the_reference(dtype, dims, block_size):
    spec = mla_spec(dtype, block_size, num_heads=5, dims=dims)
    backend = TritonMLAAttention(CONFIGS, "test")
    assert backend.supports(spec)
    seqs = [(17, 1), (1, 1), (30, 3), (0, 6), (40, 1)] + mixed_batch(1)
    step = make_mla_step(seqs, spec, seed=block_size, poison=True)
    check_mla_step(backend, spec, mla_to_device(step, DEVICE))


def test_a_separate_value_is_refused():
    spec = mla_spec(torch.float32, 16)
    step = make_mla_step([(3, 1)], spec)
    with pytest.raises(ValueError, match="value=None"):
        TritonMLAAttention(CONFIGS, "test").forward(
            spec, step.query, step.latent, step.latent, step.kv_cache, step.metadata,
            w_uk=step.w_uk, w_uv=step.w_uv)
