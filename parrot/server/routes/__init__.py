"""HTTP routers: system (health, metrics), OpenAI-compatible API, task APIs."""
