"""The plugin contract: everything a tokenmill plugin imports, and nothing of the core.

- `hookspecs`: every hook of every plugin kind, each documented in one shape;
  `plugins`: the one plugin manager (kinds, discovery, validation); `registry`: a
  platform's selection and activation (`ActivePlatform`); `versions`: the API version and
  the version that introduced each part.
- `interfaces` (with `layer_state` and `model_runner`): what crosses the seam: `Platform`,
  `Capabilities`, attention specs, metadata and backends, `Communicator`, `Allocator`,
  `HardwareSpec`, recurrent-state specs, the model-runner seam and graph capture.
- `step`: the step description a runner consumes and the result it returns;
  `kv_messages`: the KV connector's part of a step; `kv_tier`: the KV tier interface.
- `tool_parsing`, `reasoning`: the parser base classes of those plugin kinds.
- The kit: `ops` (the reference ops, the conformance oracle and the fallback),
  `kit.runner_state` (the request-state table a runner keeps), `kit.sampler` (vLLM's
  sampling semantics), `kit.kv_state` (recurrent states in arena pages),
  `kit.host_allocator` (host memory with exact accounting), `communicators`
  (collectives over torch.distributed), `sleep` (sleep mode's buffer mechanics).

docs/vendor-guide.md documents every public name; docs/contract-changelog.md says what
each version added.
"""
