"""Serving: an OpenAI-compatible HTTP server (serve/http.py, aiohttp) on a continuous-batching engine
(serve/engine.py: fixed cache slots, one compiled step for all of them) over `decode`."""
from tformer_jax.serve.engine import Engine, EngineError, Job

__all__ = ["Engine", "EngineError", "Job"]
