"""Serving: one resident base and its BitDelta variants behind an OpenAI-compatible HTTP API.

``deltafleet.serve.model`` (the Llama-family decoder taking the variant as a forward argument),
``deltafleet.serve.engine`` (model ids, lazy single-flight artifact loading, the decode loop),
``deltafleet.serve.app`` (FastAPI app factory ``create_app(engine)``), ``serve/run.py`` (``make serve``).
"""
