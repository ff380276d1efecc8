"""KV offload: a connector that moves KV blocks between the device arena and a stack of
tiers (host memory, local disk, a remote store), content-addressed by the prefix-cache
chain, so a session's history is saved once and loaded back instead of recomputed.

- objects.py: object keys (layout fingerprint + block hash) and self-checking framing
- tier.py: the `KVTier` interface; host.py, disk.py, redis_tier.py: the built-in tiers
- stack.py: the tiers stacked fastest first (write-through saves, checked promoting reads)
- registry.py: tiers as plugins (entry point group `tokenmill.kv_tiers`), sizes, config
- messages.py: what the two halves exchange each step (msgspec Structs)
- scheduler_side.py: external hits, loads, saves and finishing, for the scheduler
- worker.py: asynchronous loads and saves between the arena and the stack
"""
