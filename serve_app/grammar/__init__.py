"""Constrained decoding: what a request's output must match (spec), the llguidance grammar the
reference engine compiles it to (lark), compilation with its cache and limits (compiler), and
the per-request matchers that mask every sampled position and roll back with a verify window
(matchers)."""
