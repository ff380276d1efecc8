"""The frontend: what a user or the API server talks to (LLM, AsyncLLM, the engine-core
client, tokenizing, detokenizing, output assembly, the data-parallel front and router)."""
