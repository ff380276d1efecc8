"""KV offload refuses, at engine start and by name, the KV it cannot move yet: recurrent
state (Qwen3-Next's Gated DeltaNet groups; plan in docs/kv-offload.md)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM
from tokenmill_conformance.tiny_models import make_tokenizer


def test_offload_refuses_recurrent_groups(tmp_path):
    from test_qwen3_next import tiny_qwen3_next_config

    tokenizer = make_tokenizer(300)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_next_config(len(tokenizer)),
                                             dtype=torch.float32)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"moves full-attention and sliding-window KV only; "
                       r"this model has \['linear'\] groups"):
        LLM(str(tmp_path), dtype="float32", block_size=4, kv_offload_host_bytes="1MiB")
