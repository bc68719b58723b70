"""``slimcaching serve``: the engine and its device pool, request assignment, metrics, and the
OpenAI-compatible HTTP server (:mod:`.http`)."""
