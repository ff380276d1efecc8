"""RCCL collectives through torch.distributed (a ROCm build of torch names RCCL's backend
"nccl"); gloo in interpreter mode, as the nvidia plugin (`tokenmill_triton.platform_kit`)."""

GPU_BACKENDS = frozenset({"nccl"})  # RCCL
