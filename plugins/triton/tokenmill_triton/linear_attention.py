"""The LINEAR kind on Triton: a `LinearAttentionBackend` for every variant of the core's
`REFERENCE_VARIANTS` ("gated_delta": Qwen3-Next's Gated DeltaNet, "kda": Kimi Linear's
Kimi Delta Attention, "mamba2": the SSD of Bamba and the other Mamba2 hybrids) over states
in the KV arena, on the kernels of tokenmill_triton.gated_delta, .kda and .mamba2.

One step, all sequences at once (the reference, `tokenmill.platforms.ops.linear_attention`, goes
sequence by sequence and piece by piece): read every sequence's state (zeros at token 0,
a checkpoint's pages after a prefix hit, else its slot), run the conv kernel (each
variant has a causal conv in front of its recurrence: the same kernel), then the
variant's recurrence kernel when every sequence decodes one token, else its chunked scan
with the checkpoints' token counts as chunk ends, and write checkpoints and final states
back. The conv state at a checkpoint is the last K - 1 inputs before it, taken from the
step's own inputs. Does not write a source that is not the sequence's own slot (copy on
extend). No variant falls back to the reference: a variant outside `variants` is not
given to this backend (the core logs the fallback), and `forward` refuses it.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.platforms.interfaces import (
    AttentionMetadata,
    AttentionSpec,
    LinearAttentionBackend,
)
from tokenmill.platforms.kit.kv_state import read_states, write_states, zero_states
from tokenmill.platforms.ops.linear_attention import GatedDeltaInputs, KDAInputs, split_qkv
from tokenmill.platforms.ops.mamba2 import Mamba2Inputs
from tokenmill_triton import gated_delta, kda, mamba2
from tokenmill_triton.configs import KernelConfigs

Scan = tuple[torch.Tensor, torch.Tensor]  # (output, checkpoint states)


class TritonLinearAttention(LinearAttentionBackend):
    """Gated DeltaNet, KDA and Mamba2 layers on the Triton conv, chunked-scan and
    recurrence kernels."""

    variants = frozenset({"gated_delta", "kda", "mamba2"})

    def __init__(self, configs: KernelConfigs, platform_name: str) -> None:
        self.configs = configs
        self.name = f"{platform_name}_triton_linear"

    def forward(  # type: ignore[override]
        self, spec: AttentionSpec, inputs: Any, state_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """See `LinearAttentionBackend.forward`; returns the variant's output ([T, Hv, dv]
        for gated_delta and kda, [T, H * P] for mamba2) in the inputs' dtype."""
        variant = spec.state.variant
        if variant not in self.variants:
            raise ValueError(f"{self.name} runs the variants {sorted(self.variants)}, not "
                             f"{variant!r}")
        rec = metadata.recurrent
        lens = metadata.query_lens_cpu
        conv, ssm = self._initial_states(spec, state_cache, rec.source_block_ids)
        conv_before = conv.clone()
        conv_in, weight, bias = _conv_inputs(variant, inputs)
        mixed = gated_delta.causal_conv1d(conv_in, weight, conv, lens, bias, "silu",
                                          configs=self.configs)
        wanted = [[n for n, _ in marks if n < lens[i]] for i, marks in enumerate(rec.checkpoints)]
        decode = all(n == 1 for n in lens) and not any(wanted)
        scan = {"gated_delta": self._gated_delta, "kda": self._kda, "mamba2": self._mamba2}
        out, ckpts = scan[variant](inputs, mixed, ssm, lens, wanted, decode)
        self._write_checkpoints(spec, state_cache, metadata, conv_in, conv_before, conv, ssm,
                                ckpts)
        write_states(state_cache, spec.state, rec.state_block_ids, [conv, ssm])
        return out

    def _gated_delta(self, inputs: GatedDeltaInputs, mixed, ssm, lens, wanted, decode) -> Scan:
        q, k, v = split_qkv(mixed, inputs)
        if decode:
            return gated_delta.gated_delta_recurrent(
                q, k, v, inputs.g, inputs.beta, ssm, lens, configs=self.configs), ssm[:0]
        return gated_delta.gated_delta_chunked(q, k, v, inputs.g, inputs.beta, ssm, lens,
                                               wanted, configs=self.configs)

    def _kda(self, inputs: KDAInputs, mixed, ssm, lens, wanted, decode) -> Scan:
        q, k, v = (t.unflatten(-1, (inputs.num_heads, inputs.head_dim))
                   for t in mixed.chunk(3, dim=-1))
        if decode:
            return kda.kda_recurrent(q, k, v, inputs.g, inputs.beta, ssm, lens,
                                     configs=self.configs), ssm[:0]
        return kda.kda_chunked(q, k, v, inputs.g, inputs.beta, ssm, lens, wanted,
                               configs=self.configs)

    def _mamba2(self, inputs: Mamba2Inputs, mixed, ssm, lens, wanted, decode) -> Scan:
        dims, w = inputs.dims, inputs.weights
        num_bc = dims.num_groups * dims.state_size
        x, B, C = mixed.split([dims.intermediate_size, num_bc, num_bc], dim=-1)
        x = x.unflatten(-1, (dims.num_heads, dims.head_dim))
        B, C = (t.unflatten(-1, (dims.num_groups, dims.state_size)) for t in (B, C))
        if decode:
            y = mamba2.mamba2_state_update(x, inputs.dt, w.A, B, C, w.D, w.dt_bias, ssm, lens,
                                           dims.dt_limit, configs=self.configs)
            ckpts = ssm[:0]
        else:
            y, ckpts = mamba2.mamba2_chunked(x, inputs.dt, w.A, B, C, w.D, w.dt_bias, ssm,
                                             lens, wanted, dims.dt_limit, configs=self.configs)
        return y.flatten(1), ckpts

    def _initial_states(self, spec, cache, sources) -> list[torch.Tensor]:
        """[conv [N, C, K - 1], ssm f32 [N, ...]], contiguous, zeros where None."""
        states = zero_states(spec.state, len(sources), cache.device)
        rows = [i for i, s in enumerate(sources) if s is not None]
        if rows:
            read = read_states(cache, spec.state, [sources[i] for i in rows])
            for full, part in zip(states, read):
                full[rows] = part
        return [t.contiguous() for t in states]

    @staticmethod
    def _write_checkpoints(spec, cache, metadata, conv_in, conv_before, conv_after, ssm, ckpts):
        """Each checkpoint (n, pages): the ssm state the scan stored (the final state when n
        is the whole query) and the conv inputs before token n."""
        rec = metadata.recurrent
        starts = metadata.query_start_loc.tolist()
        width = conv_before.shape[-1]
        at = 0
        for i, marks in enumerate(rec.checkpoints):
            length = metadata.query_lens_cpu[i]
            for n, pages in marks:
                if n == length:
                    conv_n, ssm_n = conv_after[i], ssm[i]
                else:
                    history = torch.cat((conv_before[i],
                                         conv_in[starts[i]:starts[i] + n].T.to(conv_before.dtype)),
                                        dim=-1)
                    conv_n, ssm_n = history[:, history.shape[-1] - width:], ckpts[at]
                    at += 1
                write_states(cache, spec.state, [pages], [conv_n[None], ssm_n[None]])


def _conv_inputs(variant: str, inputs: Any) -> tuple[torch.Tensor, torch.Tensor,
                                                      torch.Tensor | None]:
    """(the conv's input [T, C], its weight [C, K], its bias [C] or None) of a variant."""
    if variant == "mamba2":
        return inputs.xbc, inputs.weights.conv_weight, inputs.weights.conv_bias
    if variant == "kda":
        return inputs.mixed_qkv, inputs.conv_weight, None
    return inputs.mixed_qkv, inputs.conv_weight, inputs.conv_bias
