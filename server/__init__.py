"""tokenmill's HTTP server: `build_app(engine, served_model_names)` serves an `AsyncLLM`
through the OpenAI and Anthropic routes (what `tokenmill serve` runs under uvicorn)."""

__all__ = ["build_app"]


def __getattr__(name: str):
    if name == "build_app":  # FastAPI and the engine load on first use only
        from tokenmill.server.app import build_app

        return build_app
    raise AttributeError(f"module 'tokenmill.server' has no attribute {name!r}")
