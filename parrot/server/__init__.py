"""The HTTP server: FastAPI app, OpenAI-compatible routes, metrics, stats, Ray Serve entry point."""
