"""The shared vocabulary: what crosses the boundaries between the ingress, the chat format,
the router and the engines. `openai`: the OpenAI wire schema and its errors; `generation`: the
engine-neutral request and output types; `grammar`: what an answer must match; `media`: an
image in a prompt and the cache keys of its positions; `problems`: the error that names every
problem of an input. Nothing here
imports anything else from serve_app (tests/test_layers.py)."""
