"""The Pallas kernel directly, over the contract's KV layout (several arena slots in one
array; tier T1 checks it through the torch seam): against a numpy oracle, with NaN in
every unwritten slot, a runtime sliding window and GQA; in bfloat16 too, where each page
copy brings a pair of KV heads (the dtype's packing) and the program picks its own."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tokenmill_tpu.kernels import plan_tiles, ragged_paged_attention, write_kv

H, KVH, D, BS, NB, LAYERS, TILE = 6, 2, 32, 16, 32, 3, 8


def oracle(q, keys, values, seqs, window):
    outs, offset = [], 0
    for (cached, new), k, v in zip(seqs, keys, values):
        k, v = np.repeat(k, H // KVH, 1), np.repeat(v, H // KVH, 1)
        s = np.einsum("qhd,khd->hqk", q[offset : offset + new], k) * D**-0.5
        qp, kp = np.arange(cached, cached + new)[:, None], np.arange(cached + new)[None]
        visible = (kp <= qp) & ((kp > qp - window) if window else True)
        s = np.where(visible, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        outs.append(np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v))
        offset += new
    return np.concatenate(outs)


def _rounded(x: np.ndarray, dtype) -> np.ndarray:
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))


@pytest.mark.parametrize(("window", "dtype"), [(0, jnp.float32), (5, jnp.float32),
                                               (40, jnp.float32), (5, jnp.bfloat16)])
def test_mixed_step_against_numpy(window, dtype):
    rng = np.random.default_rng(window)
    seqs = [(30, 1), (0, 19), (7, 12), (63, 1), (0, 1)]  # decodes, prompts, a chunk
    tables, free = np.zeros((8, 8), np.int32), list(rng.permutation(NB))
    kv = np.full((LAYERS, 2, NB, BS, KVH, D), np.nan, np.float32)  # unwritten: NaN
    keys, values, slots = [], [], []
    for i, (cached, new) in enumerate(seqs):
        for j in range(-(-(cached + new) // BS)):
            tables[i, j] = free.pop()
        k = _rounded(rng.standard_normal((cached + new, KVH, D)), dtype)
        v = _rounded(rng.standard_normal((cached + new, KVH, D)), dtype)
        for p in range(cached):
            kv[1, 0, tables[i, p // BS], p % BS] = k[p]
            kv[1, 1, tables[i, p // BS], p % BS] = v[p]
        slots += [tables[i, p // BS] * BS + p % BS for p in range(cached, cached + new)]
        keys.append(k)
        values.append(v)
    num_tokens = sum(n for _, n in seqs)
    q = _rounded(rng.standard_normal((num_tokens, H, D)), dtype)
    new_k = np.concatenate([k[c:] for k, (c, _) in zip(keys, seqs)])
    new_v = np.concatenate([v[c:] for v, (c, _) in zip(values, seqs)])
    cache = write_kv(jnp.asarray(kv, dtype), jnp.int32(1), jnp.asarray(new_k), jnp.asarray(new_v),
                     jnp.asarray(np.array(slots, np.int32)))
    plan = plan_tiles([n for _, n in seqs], [c + n for c, n in seqs], TILE, 16, num_tokens)
    rows = np.minimum(plan.tile_token[:, None] + np.arange(TILE), num_tokens - 1)
    seq_lens = np.zeros(8, np.int32)
    seq_lens[: len(seqs)] = [c + n for c, n in seqs]
    out = ragged_paged_attention(
        jnp.asarray(q[rows], dtype), cache, jnp.array([1], jnp.int32), jnp.array([window], jnp.int32),
        *(jnp.asarray(a) for a in (plan.tile_seq, plan.tile_pos, plan.tile_len, seq_lens, tables)),
        scale=D**-0.5, interpret=True,
    )
    got = np.asarray(out.astype(jnp.float32))[plan.token_tile, plan.token_row]
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bfloat16: the output's rounding
    np.testing.assert_allclose(got, oracle(q, keys, values, seqs, window), atol=tol, rtol=tol)
    written = np.asarray(cache.astype(jnp.float32))
    assert np.isnan(written[0]).all() and np.isnan(written[2]).all(), "other layers written"


def test_a_step_larger_than_its_bucket_is_an_error():
    with pytest.raises(ValueError, match="needs 3 query tiles; the bucket has 2"):
        plan_tiles([17], [17], 8, 2, 32)
