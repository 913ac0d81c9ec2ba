"""The web page at `/` (a chat playground and a live view of the engine) and the JSON endpoint
it polls, `GET /v1/engine/state` (docs/WEBUI.md). The page is plain HTML, CSS and JavaScript
shipped as package data: no build step, nothing fetched from elsewhere."""
