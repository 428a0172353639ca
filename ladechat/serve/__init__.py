"""`ladechat serve`: the OpenAI-compatible HTTP API over any backend (app.py)."""
