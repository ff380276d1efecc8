"""The worker side of one rank: the core's model runner, decode-graph capture, sleep mode
(executors and the Worker that hosts a runner live in tokenmill.distributed)."""
