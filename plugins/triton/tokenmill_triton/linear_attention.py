"""The LINEAR kind on Triton: a `LinearAttentionBackend` for the "gated_delta" variant
(Qwen3-Next's Gated DeltaNet) over states in the KV arena, on tokenmill_triton.gated_delta.

One step, all sequences at once (the reference, `tokenmill.ops.linear_attention`, goes
sequence by sequence and piece by piece): read every sequence's state (zeros at token 0,
a checkpoint's pages after a prefix hit, else its slot), run the conv kernel, then the
recurrence kernel when every sequence decodes one token, else the chunked scan with the
checkpoints' token counts as chunk ends, and write checkpoints and final states back. The
conv state at a checkpoint is the last K - 1 inputs before it, taken from the step's own
inputs. Does not write a source that is not the sequence's own slot (copy on extend).
"""

from __future__ import annotations

import torch

from tokenmill.kv.state import read_states, write_states, zero_states
from tokenmill.ops.linear_attention import GatedDeltaInputs, split_qkv
from tokenmill.platforms.interfaces import (
    AttentionMetadata,
    AttentionSpec,
    LinearAttentionBackend,
)
from tokenmill_triton import gated_delta
from tokenmill_triton.configs import KernelConfigs


class TritonLinearAttention(LinearAttentionBackend):
    """Gated DeltaNet layers on the Triton conv, chunked-scan and recurrence kernels."""

    variants = frozenset({"gated_delta"})

    def __init__(self, configs: KernelConfigs, platform_name: str) -> None:
        self.configs = configs
        self.name = f"{platform_name}_triton_linear"

    def forward(  # type: ignore[override]
        self, spec: AttentionSpec, inputs: GatedDeltaInputs, state_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """See `LinearAttentionBackend.forward`; returns [T, Hv, dv] in the inputs' dtype."""
        rec = metadata.recurrent
        lens = metadata.query_lens_cpu
        conv, ssm = self._initial_states(spec, state_cache, rec.source_block_ids)
        conv_before = conv.clone()
        mixed = gated_delta.causal_conv1d(inputs.mixed_qkv, inputs.conv_weight, conv, lens,
                                          inputs.conv_bias, "silu", configs=self.configs)
        q, k, v = split_qkv(mixed, inputs)
        wanted = [[n for n, _ in marks if n < lens[i]] for i, marks in enumerate(rec.checkpoints)]
        if all(n == 1 for n in lens) and not any(wanted):
            out = gated_delta.gated_delta_recurrent(q, k, v, inputs.g, inputs.beta, ssm, lens,
                                                    configs=self.configs)
            ckpts = ssm[:0]
        else:
            out, ckpts = gated_delta.gated_delta_chunked(
                q, k, v, inputs.g, inputs.beta, ssm, lens, wanted, configs=self.configs)
        self._write_checkpoints(spec, state_cache, metadata, inputs, conv_before, conv, ssm,
                                ckpts)
        write_states(state_cache, spec.state, rec.state_block_ids, [conv, ssm])
        return out

    def _initial_states(self, spec, cache, sources) -> list[torch.Tensor]:
        """[conv [N, C, K - 1], ssm f32 [N, Hv, dk, dv]], contiguous, zeros where None."""
        states = zero_states(spec.state, len(sources), cache.device)
        rows = [i for i, s in enumerate(sources) if s is not None]
        if rows:
            read = read_states(cache, spec.state, [sources[i] for i in rows])
            for full, part in zip(states, read):
                full[rows] = part
        return [t.contiguous() for t in states]

    @staticmethod
    def _write_checkpoints(spec, cache, metadata, inputs, conv_before, conv_after, ssm, ckpts):
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
                                         inputs.mixed_qkv[starts[i]:starts[i] + n].T.to(conv_before.dtype)),
                                        dim=-1)
                    conv_n, ssm_n = history[:, history.shape[-1] - width:], ckpts[at]
                    at += 1
                write_states(cache, spec.state, [pages], [conv_n[None], ssm_n[None]])
