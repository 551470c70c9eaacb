"""``dyngen serve``: an OpenAI-compatible HTTP server over the shared engine.

Optional: it needs the ``serve`` extra (``pip install 'dyngen-core[serve]'``: FastAPI and
uvicorn), and only the modules of this package import them. `options` (the command's settings
and arguments) imports neither, so the command line can describe ``serve`` without them.

Modules: `options` (what a server runs with), `schemas` (the requests, validated), `jobs` (a
request into prompt ids and jobs), `engine` (submitting jobs and reading their results, with
cancellation), `responses` (results into OpenAI response objects and stream chunks),
`errors` (OpenAI-shaped error bodies), `metrics` (Prometheus text), `routes` (the
endpoints), `app` (the FastAPI application) and `server` (uvicorn, blocking or on a thread).
The server uses only dyngen's public API.
"""
