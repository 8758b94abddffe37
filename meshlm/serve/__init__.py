"""Serving: the generation engine (KV cache on the mesh, continuous batching), sampling, loading, HTTP API."""
