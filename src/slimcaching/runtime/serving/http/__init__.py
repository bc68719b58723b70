"""The OpenAI-compatible HTTP API: the app and its routes, request schemas, response assembly,
and the connection guard."""
