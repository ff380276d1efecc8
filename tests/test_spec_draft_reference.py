"""The drafts of `mtp` and `eagle3` against a reference computed without the engine: the
target's hidden states from transformers, then the draft module's math over the whole
sequence with plain causal attention (transformers' DeepseekV3DecoderLayer for the MTP
block; torch ops for the EAGLE-3 layer), re-run from scratch for each chained draft.
Equal drafts step after step show the draft's paged KV (catch-up over prompt chunks and
verified positions, chained scratch positions) holds what a full recompute would.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_spec_models import add_mtp_module, make_eagle3_head
from tiny_models import load_hf, make_tokenizer
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RotaryEmbedding,
)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tokenmill import LLM, SamplingParams
from tokenmill_conformance.tiny_models import make_tiny_model

K = 3
PROMPT = "def main():\n    return 42\ndef main():\n    return"


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _causal(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


def engine_drafts(path, spec, prompt_ids, max_tokens) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens, the drafts that follow them) after each engine step; a
    pool of blocks of 4 and chunks of 16 tokens: the prompt is prefilled in chunks."""
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=16,
              speculative_config={**spec, "num_speculative_tokens": K, "adaptive": False})
    engine = llm.engine
    engine.add_request("r", prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                       ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        for rid, (count, drafts) in engine.spec.drafter._received.items():
            request = engine.scheduler.requests.get(rid)
            if request is not None and count == request.num_tokens:  # this step's
                seen.append((list(request.all_token_ids), list(drafts)))
    engine.shutdown()
    return seen


@torch.no_grad()
def mtp_reference(path, target, tokens: list[int]) -> list[int]:
    """DeepSeek-V3's MTP module (vLLM's formulation) over the whole of `tokens`."""
    config = DeepseekV3Config.from_pretrained(path)
    config._attn_implementation = "eager"
    n = config.num_hidden_layers
    w = {k.removeprefix(f"model.layers.{n}."): v for k, v in
         load_file(path / "model.safetensors").items() if k.startswith(f"model.layers.{n}.")}
    block = DeepseekV3DecoderLayer(config, layer_idx=n).eval()
    block.load_state_dict({k: v for k, v in w.items() if k.split(".")[0] in (
        "self_attn", "mlp", "input_layernorm", "post_attention_layernorm")})
    rotary = DeepseekV3RotaryEmbedding(config)
    eps = config.rms_norm_eps
    hidden = target.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
    ids, prev = list(tokens[1:]), list(hidden)
    drafts = []
    for _ in range(K):
        emb = w["embed_tokens.weight"][torch.tensor(ids)]
        emb[0] = 0  # position 0's embedding is masked
        z = torch.cat([_rms(emb, w["enorm.weight"], eps),
                       _rms(torch.stack(prev), w["hnorm.weight"], eps)], -1)
        z = (z @ w["eh_proj.weight"].T)[None]
        pos = torch.arange(len(ids))[None]
        out = block(z, attention_mask=_causal(len(ids)), position_ids=pos,
                    position_embeddings=rotary(z, pos))
        g = (out[0] if isinstance(out, tuple) else out)[0]
        logits = _rms(g[-1], w["shared_head.norm.weight"], eps) @ w["shared_head.head.weight"].T
        drafts.append(int(logits.argmax()))
        ids.append(drafts[-1])
        prev.append(g[-1])
    return drafts


@torch.no_grad()
def eagle3_reference(target, head, tokens: list[int]) -> list[int]:
    """The EAGLE-3 head (vLLM's formulation) over the whole of `tokens`."""
    cfg = json.loads((head / "config.json").read_text())
    w = load_file(head / "model.safetensors")
    layers = target.model.layers
    n = len(layers)
    aux_ids = (min(2, n), n // 2, max(n - 3, 0))
    streams = {}
    hooks = [layer.register_forward_pre_hook(
        lambda m, a, kw, i=i: streams.__setitem__(i, (a[0] if a else kw["hidden_states"])[0]),
        with_kwargs=True) for i, layer in enumerate(layers)]
    hooks.append(layers[-1].register_forward_hook(
        lambda m, a, out: streams.__setitem__(n, (out[0] if isinstance(out, tuple) else out)[0])))
    target(torch.tensor([tokens[:-1]]))
    for h in hooks:
        h.remove()
    eps, heads, kv_heads, d = cfg["rms_norm_eps"], cfg["num_attention_heads"], \
        cfg["num_key_value_heads"], cfg["head_dim"]
    embed = target.model.embed_tokens.weight
    rotary = type(target.model.rotary_emb)(target.config)
    first = torch.cat([streams[i] for i in aux_ids], -1) @ w["fc.weight"].T
    ids, prev = list(tokens[1:]), list(first)
    drafts = []
    for _ in range(K):
        h = torch.stack(prev)
        x = torch.cat([_rms(embed[torch.tensor(ids)], w["midlayer.input_layernorm.weight"], eps),
                       _rms(h, w["midlayer.hidden_norm.weight"], eps)], -1)
        L = len(ids)
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(L, heads, d).transpose(0, 1)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(L, kv_heads, d).transpose(0, 1)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(L, kv_heads, d).transpose(0, 1)
        cos, sin = rotary(x[None], torch.arange(L)[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        k = k[0].repeat_interleave(heads // kv_heads, 0)
        v = v.repeat_interleave(heads // kv_heads, 0)
        a = F.scaled_dot_product_attention(q[0], k, v, is_causal=True)
        r = a.transpose(0, 1).reshape(L, heads * d) @ w["midlayer.self_attn.o_proj.weight"].T + h
        m = _rms(r, w["midlayer.post_attention_layernorm.weight"], eps)
        m = F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)
        prenorm = m @ w["midlayer.mlp.down_proj.weight"].T + r
        logits = _rms(prenorm[-1], w["norm.weight"], eps) @ w["lm_head.weight"].T
        d_id = int(logits.argmax())
        drafts.append(d_id + int(w["d2t"][d_id]))
        ids.append(drafts[-1])
        prev.append(prenorm[-1])
    return drafts


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("draft_reference")


def test_mtp_drafts_match_the_reference(root):
    path = add_mtp_module(make_tiny_model(root / "deepseek_v3", "deepseek_v3"))
    ids = make_tokenizer(300)(PROMPT).input_ids
    seen = engine_drafts(path, {"method": "mtp"}, ids, max_tokens=3)
    assert len(seen) >= 2
    target = load_hf(path)
    for tokens, drafts in seen:
        assert drafts == mtp_reference(path, target, tokens), len(tokens)


def test_eagle3_drafts_match_the_reference(root):
    path = make_tiny_model(root / "llama", "llama")
    head = make_eagle3_head(root / "eagle3", path)
    ids = make_tokenizer(300)(PROMPT).input_ids
    seen = engine_drafts(path, {"method": "eagle3", "model": str(head)}, ids, max_tokens=6)
    assert len(seen) >= 2
    target = load_hf(path)
    for tokens, drafts in seen:
        assert drafts == eagle3_reference(target, head, tokens), len(tokens)
