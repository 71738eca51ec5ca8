"""The OpenAI-compatible server. Constants the CLI needs live here, free of FastAPI imports."""

# --max-request-body-bytes: larger bodies are a 413 before they are parsed (server.py)
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 2**20
