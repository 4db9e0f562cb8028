"""Whether Serve has begun stopping this replica (a scale-down, a redeploy, `serve.delete`).

Serve drains a stopping replica by waiting for its in-flight requests, up to the deployment's
graceful_shutdown_timeout_s, and tells the replica's code nothing until `__del__`, after the
wait: a replica whose streams run for minutes would either hold its GPUs that long or, past
the timeout, be killed with its streams. The flag Serve sets when the stop begins is its
replica's `_shutting_down` ("may be used by replica subclass implementations", Ray 2.60
serve/_private/replica.py); no public API exposes it, so it is read here, in one place, and
tests/test_autoscaling_serve.py pins it against the installed Ray. If a Ray upgrade moves it,
this answers False and says so once in the log: requests then finish where they are, within
the drain timeout, as with an engine that cannot move them.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_warned = False


def replica_stopping() -> bool:
    """True once Serve has begun this replica's graceful shutdown; False outside a replica."""
    global _warned
    try:
        import ray._private.worker as worker_module

        worker = worker_module.global_worker
        actor = worker.actors.get(worker.actor_id)
        if actor is None:
            return False
        return bool(actor._replica_impl._shutting_down)
    except AttributeError:
        if not _warned:
            _warned = True
            logger.warning("this Ray does not expose a replica's shutdown flag where Ray 2.60 "
                           "did: a leaving replica's requests will finish there instead of "
                           "moving")
        return False
