"""The KV pool's one error, in a module of its own so that the ingress, which maps it to a 400,
can import it without loading torch (serve_app/models/kv_cache.py needs torch)."""


class KVCapacityError(RuntimeError):
    """A request does not fit in the KV pool."""
