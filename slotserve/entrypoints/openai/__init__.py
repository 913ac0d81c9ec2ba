"""The OpenAI-compatible HTTP server (`slotserve serve`): see api_server.build_app."""
