"""The OpenAI-compatible HTTP server (``pagedserve serve``): see ``api.py`` for the routes."""
