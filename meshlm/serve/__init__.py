"""Serving: the generation engine (engine/), the HTTP API (api/), and loading a model for them (loading)."""
