"""A KV offload tier over Mooncake's distributed store: `--kv-offload-remote mooncake://...`
(entry point `mooncake` in the group `tokenmill.kv_tiers`). See tier.py."""
