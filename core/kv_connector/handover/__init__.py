"""Prefill/decode disaggregation through the KV connector: a prefill engine computes a
prompt and holds its KV under a lease; a decode engine pulls only the blocks its own
prefix cache lacks plus every recurrent group's state at the boundary, through a KV
transport plugin, and continues with no token recomputed (docs/disaggregation.md).

- messages.py: endpoints, offers and the step's pull jobs (msgspec Structs)
- transports.py: transports as plugins (NIXL, Mooncake's transfer engine)
- scheduler_side.py: leases (prefill), admission and pulls (decode), counters
- worker_side.py: each rank's transport over its KV arena, pulls in the background
- engine_side.py: the engine's part (endpoint, releases, first tokens, metrics)
"""
