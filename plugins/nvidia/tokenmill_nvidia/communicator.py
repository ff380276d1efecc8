"""NCCL collectives through torch.distributed; in interpreter mode gloo (CPU tensors,
`tokenmill_triton.platform_kit.INTERPRETER_BACKENDS`), so conformance tier T1 runs every
collective in real multi-process groups either way."""

GPU_BACKENDS = frozenset({"nccl"})
