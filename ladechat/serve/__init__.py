"""`ladechat serve`: the OpenAI-compatible HTTP API over any backend (app.py), its wire format
(wire.py: requests, the text streamed, errors), the requests it refuses unread (guard.py) and the
model thread its jobs run on (worker.py)."""
