"""The plugin's Pallas kernel and its jitted engine step lowered, and compiled, for real
TPUs on a machine without one (JAX's ahead-of-time path):
`python -m tokenmill_tpu.aot [--json PATH]`.

JAX lowers a Pallas kernel for TPU through Mosaic, which asks the current device what TPU
it is; an `AbstractMesh` whose abstract device names a TPU generation answers for it, so
`jit(...).trace(...).lower(lowering_platforms=("tpu",))` runs on JAX's CPU backend. Where
`libtpu` is importable (`pip install libtpu`, or the extra `tokenmill-tpu[aot]`), the
lowering is compiled for a TPU topology (`jax.experimental.topologies`: Mosaic and XLA for
that generation, no TPU attached) and the record gets the compiled program's scratch
memory; without it the record says "lowered only". One record per (generation, dtype, head
size, GQA ratio) of the kernel and per (generation, dtype) of the step, in the shape of
the contract's `KernelBuild`, with the exact error where one is raised.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from tokenmill.platforms.interfaces import KernelBuild
from tokenmill_tpu.kernels import ragged_paged_attention

# target name -> (the device kind Mosaic's tables know, a topology libtpu can describe)
GENERATIONS = {"tpu v5e": ("TPU v5 lite", "v5e:2x2"), "tpu v6e": ("TPU v6 lite", "v6e:2x2")}
TILE, NUM_TILES, BLOCK_SIZE, NUM_BLOCKS, KV_HEADS = 16, 8, 16, 64, 2


def _topology(target: str):
    """(one device of a `target` topology, None) or (None, why not): libtpu describes TPU
    topologies without the hardware."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        return None, "lowered only: libtpu is not installed (pip install libtpu)"
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(topology_name=GENERATIONS[target][1],
                                                platform="tpu")
    except Exception as exc:  # recorded: the lowering still counts, the compile is noted
        return None, f"lowered only: no {target} topology ({type(exc).__name__}: {exc})"
    return topology.devices[0], ""


def _build(target: str, trace, kernel: str, config: str, case: str) -> KernelBuild:
    """Lower `trace(sharding)` (a `jit(...).trace(...)` of abstract arguments, placed on
    `sharding` or None) for `target`, then compile it for a topology of it if libtpu is
    there."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    abstract = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        GENERATIONS[target][0], 1, "tpu"))
    start = time.perf_counter()
    device, note = _topology(target)
    scratch = None
    try:
        sharding = None if device is None else NamedSharding(
            Mesh(np.array([device]), ("x",)), PartitionSpec())
        with use_abstract_mesh(abstract):
            traced = trace(sharding)
            lowered = (traced.lower(lowering_platforms=("tpu",)) if device is None
                       else traced.lower())
        if "tpu_custom_call" not in lowered.as_text():
            raise ValueError("the lowered module holds no Mosaic kernel (tpu_custom_call)")
        if device is not None:
            stats = lowered.compile().memory_analysis()
            scratch = int(stats.temp_size_in_bytes)
            note = (f"compiled for {GENERATIONS[target][1]} with libtpu: code "
                    f"{stats.generated_code_size_in_bytes} bytes")
        error = None
    except Exception as exc:  # the record keeps the exact error: it fails the build
        error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:1500]}"
    return KernelBuild(target=target, kernel=kernel, config=config, case=case,
                       registers=None, spill_bytes=None, shared_bytes=scratch,
                       seconds=time.perf_counter() - start, error=error, note=note)


def _abstract(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def lower_kernel(target: str, dtype, head: int, group: int) -> KernelBuild:
    """The ragged paged attention kernel for `target` at one shape."""
    heads = KV_HEADS * group

    def trace(sharding):
        i32 = lambda *shape: _abstract(shape, jnp.int32, sharding)  # noqa: E731
        args = (_abstract((NUM_TILES, TILE, heads, head), dtype, sharding),
                _abstract((2, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, head), dtype, sharding),
                i32(1), i32(1), i32(NUM_TILES), i32(NUM_TILES), i32(NUM_TILES), i32(4),
                i32(4, 16))
        return ragged_paged_attention.trace(*args, scale=0.1, interpret=False)

    name = jnp.dtype(dtype).name
    return _build(target, trace, "tokenmill_ragged_paged_attention",
                  f"dtype {name}, head {head}, {heads} query / {KV_HEADS} kv heads, tile {TILE}, "
                  f"block {BLOCK_SIZE}", f"attention {name} head {head} gqa {group}")


def _step_args(dtype, sharding, tokens: int = 64, seqs: int = 8):
    """Abstract arguments of the jitted step (`model.forward`) for a Qwen3 of head size
    128 with 8 query / 2 KV heads (the runner's shapes: tiles of TILE_SIZE)."""
    from transformers import Qwen3Config

    from tokenmill_tpu.model import StepShape, model_config
    from tokenmill_tpu.runner import TILE_SIZE

    hf = Qwen3Config(vocab_size=1024, hidden_size=512, intermediate_size=1024,
                     num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                     head_dim=128, max_position_embeddings=4096)
    cfg = model_config(hf)
    hidden, layers = cfg.hidden_size, cfg.num_layers
    # linear weights [in, out], as weights.convert_weights lays them out
    shapes = {"q": (hidden, cfg.q_size), "k": (hidden, cfg.kv_size), "v": (hidden, cfg.kv_size),
              "o": (cfg.q_size, hidden), "gate": (hidden, cfg.intermediate_size),
              "up": (hidden, cfg.intermediate_size), "down": (cfg.intermediate_size, hidden),
              "input_norm": (hidden,), "post_attn_norm": (hidden,),
              "q_norm": (cfg.head_size,), "k_norm": (cfg.head_size,)}
    s = lambda shape, dt: _abstract(shape, dt, sharding)  # noqa: E731
    params = {"embed": s((hf.vocab_size, hidden), dtype), "final_norm": s((hidden,), dtype),
              "layers": {n: s((layers, *shape), dtype) for n, shape in shapes.items()}}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = s((hidden, hf.vocab_size), dtype)
    tiles = seqs + tokens // TILE_SIZE
    i32 = lambda *shape: s(shape, jnp.int32)  # noqa: E731
    # one KV group (every layer full attention), an arena slot per layer
    batch = {"input_ids": i32(tokens), "positions": i32(tokens), "slots": i32(1, tokens),
             "tile_seq": i32(tiles), "tile_pos": i32(tiles), "tile_len": i32(tiles),
             "tile_token": i32(tiles), "token_tile": i32(tokens), "token_row": i32(tokens),
             "seq_lens": i32(seqs), "block_tables": i32(1, seqs, 32), "sample_rows": i32(seqs),
             "layer_slots": i32(layers), "layer_groups": i32(layers),
             "rope": s((2, hf.max_position_embeddings, cfg.head_size), jnp.float32)}
    kv = s((layers, 2, 256, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_size), dtype)
    return (params, kv, batch), {"cfg": cfg, "shape": StepShape(TILE_SIZE, interpret=False)}


def lower_step(target: str, dtype) -> KernelBuild:
    """The jitted engine step (every layer, the kernel inside) for `target`."""
    from tokenmill_tpu.model import forward

    def trace(sharding):
        args, static = _step_args(dtype, sharding)
        return forward.trace(*args, **static)

    name = jnp.dtype(dtype).name
    return _build(target, trace, "model.forward (jitted step)",
                  f"qwen3 head 128, 8 query / 2 kv heads, 2 layers, {name}, 64 tokens, "
                  "8 sequences", f"step {name}")


def kernel_builds() -> list[KernelBuild]:
    kernels = [lower_kernel(target, dtype, head, group)
               for target in GENERATIONS
               for dtype in (jnp.bfloat16, jnp.float32)
               for head in (64, 128)
               for group in (1, 4, 8)]
    return kernels + [lower_step(t, d) for t in GENERATIONS for d in (jnp.bfloat16, jnp.float32)]


def builds_in_subprocess(timeout: float = 1800.0) -> list[KernelBuild]:
    """`kernel_builds()` in a fresh process on JAX's CPU backend (this process's JAX may be
    set up for something else); one record with the exact error if that process fails."""
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tokenmill-tpu-aot-") as tmp:
        path = os.path.join(tmp, "builds.json")
        command = [sys.executable, "-m", "tokenmill_tpu.aot", "--json", path]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
        if result.returncode != 0 or not os.path.exists(path):
            return [KernelBuild("tpu", "<all>", "", "", None, None, None, 0.0,
                                f"`{' '.join(command[1:3])}` exited with {result.returncode}: "
                                f"{result.stderr[-2000:]}")]
        with open(path) as f:
            return [KernelBuild(**record) for record in json.load(f)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenmill_tpu.aot", description=__doc__)
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    records = [asdict(b) for b in kernel_builds()]
    text = json.dumps(records, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    failed = sum(r["error"] is not None for r in records)
    print(f"{len(records)} lowerings, {failed} failed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
