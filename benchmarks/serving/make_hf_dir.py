"""Write a bf16 HF safetensors directory from the shipped SmolLM2 Q4_1 GGUF.

Recipe from ../shared/PEERS.md: transformers dequantizes the GGUF (`gguf_file=`), a fresh
model is built from its config with `quantization_config=None`, the state dict is loaded
into it, and it is saved with the tokenizer. tokenmill, vLLM and transformers all serve
this one directory, so every engine computes with the same bf16 weights.

    python benchmarks/serving/make_hf_dir.py ../peers/models/smollm2-135m-bf16
"""

from __future__ import annotations

import argparse
from pathlib import Path


def make_hf_dir(out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tokenmill.model.loader import default_model_path

    gguf = Path(default_model_path())
    kw = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, torch_dtype=torch.float32, **kw)
    config = AutoConfig.from_pretrained(gguf.parent, **kw)
    config.quantization_config = None
    if hasattr(config, "__dict__"):
        config.__dict__.pop("quantization_config", None)
    config.torch_dtype = torch.bfloat16
    fresh = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    bad = [k for k in missing if "lm_head" not in k]  # tied embeddings
    if bad or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={bad}, unexpected={unexpected}")
    out_dir.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    make_hf_dir(parser.parse_args().out_dir)


if __name__ == "__main__":
    main()
