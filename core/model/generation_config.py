"""Default sampling parameters from a model's generation config, as vLLM's
`--generation-config`: what a request that leaves temperature / top_p / top_k / min_p /
repetition_penalty unset samples with.

- "auto" (the default): the checkpoint's `generation_config.json` (in the HF directory,
  or beside a `.gguf` file); for a GGUF without one, the settings tokenmill ships for
  that model, if any.
- "vllm" or "none": no model defaults; unset fields take the neutral values.
- any other value: a directory holding the `generation_config.json` to use.

As in vLLM, only these keys are read and HF's `do_sample` is ignored: a config that
sets a temperature is taken to want it.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenmill.sampling_params import NEUTRAL_DEFAULTS, SamplingParams

GenerationDefaults = dict[str, float | int]

OFF = ("vllm", "none")

# Recommended settings for GGUF files that carry no generation config, by file name.
# SmolLM2-135M-Instruct (the embedded default model): its generation_config.json sets no
# sampling parameters (only bos/eos/pad ids), and its model card's usage example samples
# with `temperature=0.2, top_p=0.9, do_sample=True`
# (https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct, "How to use").
SHIPPED: dict[str, GenerationDefaults] = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": {"temperature": 0.2, "top_p": 0.9},
}


def load_generation_defaults(model_path: str, setting: str = "auto") -> tuple[GenerationDefaults, str]:
    """The defaults for `model_path` under `setting`, and where they came from (for the
    log). Raises ValueError naming the file when a generation config holds a bad value,
    and FileNotFoundError when a `setting` directory has no generation_config.json."""
    if setting in OFF:
        return {}, f"generation_config={setting!r}"
    path = Path(model_path)
    if setting != "auto":
        file = Path(setting) / "generation_config.json"
        if not file.is_file():
            raise FileNotFoundError(
                f"generation_config={setting!r}: no generation_config.json there; give a "
                f"directory holding one, or one of 'auto', {', '.join(map(repr, OFF))}"
            )
        return _read(file), str(file)
    file = (path.parent if path.suffix == ".gguf" else path) / "generation_config.json"
    if file.is_file():
        return _read(file), str(file)
    if path.name in SHIPPED:
        return dict(SHIPPED[path.name]), f"tokenmill's settings for {path.name}"
    return {}, "no generation config"


def _read(file: Path) -> GenerationDefaults:
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    defaults = {k: config[k] for k in NEUTRAL_DEFAULTS if config.get(k) is not None}
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{file}: {e}") from e
    return defaults


def describe(defaults: GenerationDefaults) -> str:
    return " ".join(f"{k}={v}" for k, v in defaults.items()) or "none"
