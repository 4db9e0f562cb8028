"""The routing policy alone (pure Python, no Ray): ledger, prefix index, admission, affinity,
long/short separation, aging."""

from __future__ import annotations

import pytest

from serve_app.routing import (
    CapacityLedger,
    KVRouterPolicy,
    PrefixIndex,
    QueueFull,
    QueueTimeout,
    RequestTooLarge,
    RouteRequest,
    RouterSettings,
    block_hashes,
    chain_hashes,
    make_policy,
)

BS = 16


def settings(**kw: object) -> RouterSettings:
    base: dict[str, object] = {"block_size": BS, "long_threshold": 1000, "queue_size": 8,
                               "queue_timeout_s": 30.0, "aging_s": 60.0,
                               "balance_abs_tokens": 2000, "balance_rel": 1.5,
                               "share_prefix": True}
    base.update(kw)
    return RouterSettings(**base)  # type: ignore[arg-type]


def doc(name: str, tokens: int) -> tuple[int, ...]:
    return chain_hashes((name, i) for i in range(tokens // BS))


def req(rid: str, prompt: int, out: int = 100, blocks: tuple[int, ...] = ()) -> RouteRequest:
    return RouteRequest(rid, prompt, out, blocks)


def policy(replicas: dict[str, int], **kw: object) -> KVRouterPolicy:
    p = make_policy(settings(**kw))
    assert isinstance(p, KVRouterPolicy)
    for name, cap in replicas.items():
        p.add_replica(name, cap)
    return p


# --- ledger and index ------------------------------------------------------------------------


def test_block_hashes_chain_prefixes() -> None:
    a = block_hashes(list(range(64)), BS)
    b = block_hashes(list(range(48)) + [0] * 16, BS)
    c = block_hashes([1, *list(range(1, 64))], BS)
    assert len(a) == 4 and a[:3] == b[:3] and a[3] != b[3]
    assert not set(a) & set(c)  # a different first token changes every block
    assert len(block_hashes(list(range(40)), BS)) == 2  # partial block not indexed


def test_ledger_counts_shared_prefix_once_and_releases_it_last() -> None:
    led = CapacityLedger(BS, share_prefix=True)
    led.set_capacity("a", 10_000)
    d = doc("d", 4000)
    led.commit("q1", "a", 4010, 100, d)
    assert led.committed("a") == 4110
    assert led.charge("a", 4020, 100, d) == 120
    led.commit("q2", "a", 4020, 100, d)
    assert led.committed("a") == 4230
    led.release("q1")  # the document stays: q2 still reads it
    assert led.committed("a") == 4000 + 20 + 100
    led.release("q2")
    led.release("q2")  # idempotent
    assert led.committed("a") == 0


def test_ledger_without_sharing_charges_everything() -> None:
    led = CapacityLedger(BS, share_prefix=False)
    led.set_capacity("a", 10_000)
    d = doc("d", 4000)
    led.commit("q1", "a", 4010, 100, d)
    assert led.charge("a", 4020, 100, d) == 4120
    with pytest.raises(ValueError):
        led.commit("q2", "a", 6000, 100, d)


def test_prefix_index_matches_longest_prefix_and_evicts_lru() -> None:
    idx = PrefixIndex(max_entries=12)
    d1, d2 = doc("x", 8 * BS), doc("y", 8 * BS)
    idx.insert(d1, "a")
    idx.insert(d1[:3], "b")
    assert idx.match(d1) == {"a": 8, "b": 3}
    idx.insert(d2, "c")  # 19 entries > 12: the oldest go first
    assert len(idx) <= 12
    assert idx.match(d2) == {"c": 8}
    idx.set_replica_limit("c", 2)
    assert idx.size("c") == 2
    idx.remove_replica("c")
    assert idx.match(d2) == {}


# --- admission ---------------------------------------------------------------------------------


def test_capacity_is_never_exceeded_and_the_queue_holds_the_rest() -> None:
    p = policy({"a": 1000, "b": 1000})
    for i in range(6):
        p.submit(req(f"r{i}", 300, 100), now=0.0)
    out = p.dispatch(0.0)
    assert len(out) == 4 and p.queued() == 2  # 2 x 400 per replica, a third does not fit
    for r in ("a", "b"):
        assert p.ledger.committed(r) <= p.ledger.capacity(r)
    p.complete(out[0][0].request_id)
    more = p.dispatch(1.0)
    assert len(more) == 1 and more[0][1] == out[0][1]
    assert all(p.ledger.committed(r) <= 1000 for r in ("a", "b"))


def test_too_large_gets_400_with_both_numbers() -> None:
    p = policy({"a": 1000, "b": 800})
    with pytest.raises(RequestTooLarge) as exc:
        p.submit(req("big", 950, 100), now=0.0)
    assert "1050" in str(exc.value) and "1000" in str(exc.value)
    assert exc.value.status == 400


def test_queue_full_gets_429_with_retry_after() -> None:
    p = policy({"a": 100}, queue_size=3)
    for i in range(3):
        p.submit(req(f"r{i}", 50, 40), now=0.0)
    with pytest.raises(QueueFull) as exc:
        p.submit(req("r3", 50, 40), now=0.0)
    assert exc.value.status == 429 and exc.value.retry_after_s > 0


def test_queue_timeout_expires_waiting_requests() -> None:
    p = policy({"a": 500}, queue_timeout_s=10.0)
    p.submit(req("r0", 300, 100), now=0.0)
    p.submit(req("r1", 300, 100), now=1.0)
    assert [r.request_id for r, _ in p.dispatch(1.0)] == ["r0"]
    assert p.expire(5.0) == []
    gone = p.expire(11.5)
    assert [r.request_id for r in gone] == ["r1"] and p.queued() == 0
    assert QueueTimeout(10.0).status == 503


# --- affinity ----------------------------------------------------------------------------------


def test_same_prefix_same_replica_while_balanced() -> None:
    p = policy({"a": 100_000, "b": 100_000, "c": 100_000})
    d = doc("d", 800)
    p.submit(req("q0", 810, 50, d), now=0.0)
    (_, first), = p.dispatch(0.0)
    p.prefill_done("q0")
    for i in range(1, 5):
        p.submit(req(f"q{i}", 810 + i, 50, d), now=float(i))
        (_, where), = p.dispatch(float(i))
        p.prefill_done(f"q{i}")
        assert where == first


def test_affinity_yields_when_imbalanced() -> None:
    p = policy({"a": 100_000, "b": 100_000})
    d = doc("d", 800)
    p.submit(req("q0", 810, 50, d), now=0.0)
    (_, first), = p.dispatch(0.0)
    p.prefill_done("q0")
    # Pile un-prefilled work on the cached replica: pending prefill 5000 vs 0 elsewhere.
    p.load[first].pending_prefill += 5000
    p.submit(req("q1", 812, 50, d), now=1.0)
    (_, where), = p.dispatch(1.0)
    assert where != first


def test_cache_aware_baseline_uses_sglang_defaults() -> None:
    p = make_policy(settings(), "cache_aware")
    for r in ("a", "b"):
        p.add_replica(r, 10_000)
    d = doc("d", 800)
    p.submit(req("q0", 810, 50, d), now=0.0)
    (_, first), = p.dispatch(0.0)
    p.submit(req("q1", 810, 50, d), now=0.0)
    (_, again), = p.dispatch(0.0)
    assert again == first
    assert p.s.sglang_balance_abs_threshold == 32 and p.s.sglang_cache_threshold == 0.5


# --- long / short ------------------------------------------------------------------------------


def test_long_prefills_are_limited_and_shorts_avoid_them() -> None:
    p = policy({"a": 100_000, "b": 100_000, "c": 100_000, "d": 100_000},
               max_long_prefills_per_replica=1, long_prefill_replica_fraction=0.5)
    for i in range(4):
        p.submit(req(f"L{i}", 20_000, 100, doc(f"doc{i}", 20_000)), now=0.0)
    out = p.dispatch(0.0)
    long_replicas = {r for _, r in out}
    assert len(out) == 2 and len(long_replicas) == 2  # half the replicas, one each
    assert p.queued() == 2
    # Shorts go where no long prefill is pending.
    for i in range(4):
        p.submit(req(f"s{i}", 200, 50), now=1.0)
    shorts = p.dispatch(1.0)
    assert len(shorts) == 4 and not {r for _, r in shorts} & long_replicas
    # When a long prefill finishes, the next long one starts.
    p.prefill_done(out[0][0].request_id)
    nxt = p.dispatch(2.0)
    assert [r.request_id for r, _ in nxt] == ["L2"]


def test_long_requests_sharing_a_prefix_are_dispatched_together() -> None:
    p = policy({"a": 100_000, "b": 100_000}, long_prefill_replica_fraction=0.5)
    other = doc("other", 20_000)
    p.submit(req("busy", 20_010, 100, other), now=0.0)
    p.dispatch(0.0)  # one replica prefilling: the long-prefill fraction is used up
    d = doc("shared", 30_000)
    for i in range(3):
        p.submit(req(f"q{i}", 30_000 + 50 + i, 100, d), now=1.0)
    assert p.dispatch(1.0) == []
    p.prefill_done("busy")
    out = p.dispatch(2.0)
    assert [r.request_id for r, _ in out] == ["q0", "q1", "q2"]
    assert len({r for _, r in out}) == 1
    # The document is committed once: 30,000 + three questions and answers.
    rep = out[0][1]
    assert p.ledger.committed(rep) < 30_000 + 3 * 500
    # Only q0 is a long prefill there; the batched followers are not (and are not placed
    # again after routing, which used to re-flag them and skew the prefill slots).
    assert p.load[rep].long_prefills == 1
    assert [r.long_prefill for r, _ in out] == [True, False, False]
    for r, _ in out:
        p.prefill_done(r.request_id)
    assert all(load.long_prefills == 0 for load in p.load.values())


def test_aging_reserves_a_replica_so_a_long_request_is_not_starved() -> None:
    p = policy({"a": 10_000, "b": 10_000}, aging_s=5.0)
    t = 0.0
    for i in range(4):  # shorts fill both replicas
        p.submit(req(f"s{i}", 4000, 500), now=t)
    p.dispatch(t)
    p.submit(req("L", 9000, 500), now=t)
    assert p.dispatch(t) == []
    served_long_at = None
    for step in range(1, 40):
        t = float(step)
        # A steady trickle of shorts keeps arriving; the oldest in flight finish.
        for rep in p.replicas():
            routed = list(p.load[rep].routed)
            if routed:
                p.complete(routed[0])
        p.submit(req(f"x{step}", 4000, 500), now=t)
        if any(r.request_id == "L" for r, _ in p.dispatch(t)):
            served_long_at = t
            break
    assert served_long_at is not None and served_long_at <= 10.0


def test_short_fifo_within_class() -> None:
    p = policy({"a": 1000})
    for i in range(4):
        p.submit(req(f"s{i}", 300, 100), now=float(i))
    order = [r.request_id for r, _ in p.dispatch(4.0)]
    for rid in order:
        p.complete(rid)
    order += [r.request_id for r, _ in p.dispatch(5.0)]
    assert order == ["s0", "s1", "s2", "s3"]


# --- decision reasons (the router_decisions metric's label) ------------------------------------


def test_every_dispatch_carries_the_policys_reason() -> None:
    p = policy({"a": 100_000, "b": 100_000})
    d = doc("d", 800)
    p.submit(req("q0", 810, 50, d), now=0.0)
    (first, where), = p.dispatch(0.0)
    assert first.reason == "least_work"  # nothing cached anywhere yet
    p.prefill_done("q0")
    p.submit(req("q1", 812, 50, d), now=1.0)
    (second, again), = p.dispatch(1.0)
    assert (second.reason, again) == ("affinity", where)
    p.prefill_done("q1")
    p.load[where].pending_prefill += 5000  # imbalanced: affinity yields
    p.submit(req("q2", 814, 50, d), now=2.0)
    (third, _), = p.dispatch(2.0)
    assert third.reason == "least_work"
    # Long requests on one document follow its prefill: the followers are "batched".
    p = policy({"a": 100_000, "b": 100_000})
    shared = doc("shared", 30_000)
    for i in range(3):
        p.submit(req(f"L{i}", 30_050 + i, 100, shared), now=0.0)
    out = p.dispatch(0.0)
    assert [r.reason for r, _ in out] == ["least_work", "batched", "batched"]
    for name in ("round_robin", "power_of_two", "cache_aware"):
        base = make_policy(settings(), name)
        base.add_replica("a", 10_000)
        base.submit(req("x", 100), now=0.0)
        assert [r.reason for r, _ in base.dispatch(0.0)] == [name]


def test_admission_stage_counts_one_decision_per_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from serve_app.routing import admission

    class Counter:
        def __init__(self) -> None:
            self.calls: list[dict[str, str]] = []

        def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
            assert value == 1.0 and tags is not None
            self.calls.append(tags)

    class Metrics:
        router_decisions = Counter()

    monkeypatch.setattr(admission, "app_metrics", lambda: Metrics)
    async def two_replicas() -> admission.ReplicaList:
        return {"a": 100_000, "b": 100_000}, True

    stage = admission.AdmissionStage(settings(), two_replicas)
    prompt = list(range(810))

    async def run() -> list[str]:
        out = []
        for i in range(3):
            out.append(await stage.admit(f"q{i}", prompt, 50))
            stage.prefill_done(f"q{i}")
        return out

    replicas = asyncio.run(run())
    assert len(set(replicas)) == 1
    assert Metrics.router_decisions.calls == [{"reason": "least_work"}, {"reason": "affinity"},
                                              {"reason": "affinity"}]


def test_router_config_is_the_routing_model() -> None:
    """One definition of the router's fields: the config tree's `router:` is RouterSettings,
    only the two config-only `null` defaults widened, resolved in RouterConfig.settings."""
    import re
    from pathlib import Path

    from serve_app.config import RouterConfig

    assert issubclass(RouterConfig, RouterSettings)
    assert set(RouterConfig.__annotations__) == {"long_threshold", "share_prefix"}
    assert set(RouterConfig.model_fields) == set(RouterSettings.model_fields)
    cfg = RouterConfig()
    assert (cfg.long_threshold, cfg.share_prefix) == (None, None)
    resolved = cfg.settings("sglang", 1 << 20)
    assert type(resolved) is RouterSettings
    assert resolved == RouterSettings(long_threshold=32_768, share_prefix=True)
    assert cfg.settings("reference", 64).model_dump() == RouterSettings(
        long_threshold=2, share_prefix=False).model_dump()
    assert RouterConfig(policy="ray_default").settings("sglang", 1 << 20).policy == "kv_aware"
    with pytest.raises(ValueError, match="ray_default"):
        make_policy(RouterSettings(policy="ray_default"))
    # The pure layer never imports the config tree.
    for path in Path("serve_app/routing").glob("*.py"):
        assert not re.search(r"^\s*(from|import) serve_app\.config", path.read_text(),
                             re.MULTILINE), path


def test_admission_stage_syncs_replicas_and_releases_the_ones_that_left() -> None:
    """The stage's replica list comes from the ingress's broadcast: a replica missing from a
    complete answer has left (its reservations are released); one missing from an incomplete
    answer (it failed to reply once) is kept with its reservations."""
    import asyncio

    from serve_app.routing import admission

    answers: list[admission.ReplicaList] = [({"a": 10_000, "b": 10_000}, True)]

    async def listed() -> admission.ReplicaList:
        return answers[-1]

    stage = admission.AdmissionStage(settings(), listed, refresh_s=3600)

    async def run() -> None:
        where = await stage.admit("q0", list(range(900)), 100)
        other = "b" if where == "a" else "a"
        assert stage.policy.ledger.committed(where) == 1000
        stage.sync({other: 10_000}, complete=False)
        assert stage.policy.ledger.committed(where) == 1000  # kept: it may still be serving
        stage.sync({other: 10_000}, complete=True)
        assert where not in stage.capacity and where not in stage.policy.ledger.replicas()
        assert stage.snapshot()["replicas"].keys() == {other}

    asyncio.run(run())
