"""tokenmill KV transport over NIXL (transport.py)."""
