"""The engine: EngineArgs and their resolution, requests, the scheduler, the step loop
(LLMEngine, EngineCore) and the steps in flight under pipeline parallelism."""
