"""The OpenAI-compatible HTTP server: `build_app`, `run_server` (api_server) and
`ServerHandle` (handle) for running it on a background thread."""
