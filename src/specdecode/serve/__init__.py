"""``specdecode serve``: the OpenAI-compatible HTTP server over the batch engine (``app.py``, ``loop.py``, ``metrics.py``)."""
