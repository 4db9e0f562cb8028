"""The routing policy alone (pure Python, no Ray): ledger, prefix index, admission, affinity,
long/short separation, aging."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

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
HANG_GUARD_S = 120.0  # an asyncio.wait_for's bound below: a hang fails, not a slow machine


def ask_from(listing: Callable[[], Awaitable[Any]]) -> Callable[[dict[str, int]], Awaitable[list[Any]]]:
    """The ingress's transport, as the admission stage sees it, over a test's replica listing:
    each replica's report as its answer (a bare count is its kv_tokens_total), and one
    failed answer when the listing is incomplete."""
    async def ask(since: dict[str, int]) -> list[Any]:
        replicas, complete = await listing()
        answers: list[Any] = [{"replica": r, **(rep if isinstance(rep, dict)
                                               else {"kv_tokens_total": rep})}
                              for r, rep in replicas.items()]
        return answers if complete else [*answers, TimeoutError()]
    return ask


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


def test_a_decode_pool_has_no_long_class() -> None:
    """A disaggregated app's decode replicas run no prefill: the ingress's stage to them
    places four long prompts at once (the prefill side paces them), where an aggregated
    app's stage, with the same router settings, starts two."""
    from serve_app.config import AppConfig
    from serve_app.embedded import DRAFT, TARGET

    app = AppConfig.model_validate({
        "models": {"target": str(TARGET), "draft": str(DRAFT)},
        "router": {"long_threshold": 1000},
        "disaggregation": {"enabled": True}})
    out = {}
    for role in ("both", "decode"):
        s = app.admission(role)
        assert s is not None
        p = make_policy(s.model_copy(update={"max_long_prefills_per_replica": 1,
                                             "long_prefill_replica_fraction": 0.5}))
        for name in "abcd":
            p.add_replica(name, 100_000)
        for i in range(4):
            p.submit(req(f"L{i}", 20_000, 100, doc(f"doc{i}", 20_000)), now=0.0)
        out[role] = len(p.dispatch(0.0))
    assert out == {"both": 2, "decode": 4}
    assert app.admission("prefill") == app.admission("both")


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

    class Gauge:
        def __init__(self) -> None:
            self.last: dict[str, float] = {}

        def set(self, value: float, tags: dict[str, str] | None = None) -> None:
            assert tags is not None
            self.last[tags["replica"]] = value

    class Metrics:
        router_decisions = Counter()
        router_state_slots_reserved = Gauge()
        router_kv_tokens_committed = Gauge()

    monkeypatch.setattr(admission, "app_metrics", lambda: Metrics)
    async def two_replicas() -> admission.ReplicaList:
        return {"a": 100_000, "b": 100_000}, True

    stage = admission.AdmissionStage(settings(), ask_from(two_replicas))
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

    stage = admission.AdmissionStage(settings(), ask_from(listed), refresh_s=3600)

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


# --- state slots: the second resource ----------------------------------------------------------


def slotted(replicas: dict[str, tuple[int, int | None]], **kw: object) -> KVRouterPolicy:
    """A kv_aware policy over replicas given as name -> (KV tokens, state slots)."""
    p = policy({}, **kw)
    for name, (kv, slots) in replicas.items():
        p.add_replica(name, kv, slots)
    return p


def test_kv_room_without_a_free_slot_is_never_chosen() -> None:
    d = doc("d", 800)
    for slots_a, expected in ((2, "a"), (1, "b")):
        p = slotted({"a": (100_000, slots_a), "b": (100_000, 4)})
        p.submit(req("q0", 810, 50, d), now=0.0)
        assert p.dispatch(0.0)[0][1] == "a"  # a tie: the first replica
        p.prefill_done("q0")
        p.submit(req("q1", 812, 50, d), now=1.0)
        (second, where), = p.dispatch(1.0)
        # With a slot free, the cached prefix wins (affinity); with a's only slot taken, a has
        # 99,140 KV tokens free and still is not chosen.
        assert where == expected, (slots_a, second.reason)
        assert p.ledger.free("a") > 90_000
        assert p.ledger.slots_reserved("a") <= slots_a


def test_all_slots_full_queues_then_dispatches_when_one_is_released() -> None:
    p = slotted({"a": (100_000, 2), "b": (100_000, 1)})
    for i in range(5):
        p.submit(req(f"s{i}", 100, 50), now=float(i))
    out = p.dispatch(5.0)
    assert [r.request_id for r, _ in out] == ["s0", "s1", "s2"] and p.queued() == 2
    assert (p.ledger.slots_reserved("a"), p.ledger.slots_reserved("b")) == (2, 1)
    assert all(p.ledger.free(r) > 99_000 for r in ("a", "b"))  # KV is not what is short
    assert p.dispatch(6.0) == []
    on_b = next(r.request_id for r, rep in out if rep == "b")
    p.complete(on_b)
    assert [(r.request_id, rep) for r, rep in p.dispatch(7.0)] == [("s3", "b")]
    p.complete(on_b)  # idempotent: the slot is not given back twice
    assert p.dispatch(8.0) == [] and p.ledger.slots_reserved("b") == 1
    assert p.expire(8.0 + 31.0)[0].request_id == "s4"  # still waiting: the queue timeout


def test_slots_full_and_queue_full_gets_429_but_400_stays_kv_only() -> None:
    p = slotted({"a": (10_000, 1)}, queue_size=3)
    p.submit(req("r0", 100, 50), now=0.0)
    assert len(p.dispatch(0.0)) == 1
    for i in range(1, 4):  # KV for all of them, no slot: they queue
        p.submit(req(f"r{i}", 100, 50), now=0.0)
    assert p.dispatch(0.0) == [] and p.queued() == 3
    with pytest.raises(QueueFull) as exc:
        p.submit(req("r4", 100, 50), now=0.0)
    assert exc.value.status == 429
    with pytest.raises(RequestTooLarge):  # larger than any replica's KV: never fits
        p.submit(req("big", 9_950, 100), now=0.0)


def test_a_burst_never_overcommits_a_slot() -> None:
    """Shorts, long documents and their batched follow-up questions (which follow a prefill
    to its replica) arrive in bursts while random requests finish: at every step no replica
    has more requests routed to it than state slots, and every request is eventually served."""
    import random

    rng = random.Random(7)
    slots = {"a": 1, "b": 2, "c": 3}
    p = slotted({r: (200_000, n) for r, n in slots.items()}, queue_size=1000,
                queue_timeout_s=1e9)
    docs = [doc(f"doc{i}", 20_000) for i in range(3)]
    submitted = served = 0
    live: list[str] = []
    reasons: set[str] = set()
    for step in range(600):
        t = float(step)
        for _ in range(rng.randrange(6) if step < 120 else 0):
            rid = f"q{submitted}"
            submitted += 1
            if rng.random() < 0.5:
                p.submit(req(rid, 20_000 + rng.randrange(50), 100, rng.choice(docs)), now=t)
            else:
                p.submit(req(rid, 100 + rng.randrange(400), 50), now=t)
        for r, _ in p.dispatch(t):
            live.append(r.request_id)
            reasons.add(r.reason)
            served += 1
        for r in p.replicas():
            assert p.load[r].in_flight == p.ledger.slots_reserved(r) <= slots[r], (step, r)
        for rid in list(live):  # some finish their prefill, some finish
            roll = rng.random()
            if roll < 0.2:
                p.complete(rid)
                live.remove(rid)
            elif roll < 0.4:
                p.prefill_done(rid)
    assert served == submitted and p.queued() == 0
    assert "batched" in reasons  # the batch path (which bypasses _place) was exercised


def test_replicas_without_a_slot_bound_are_unbounded() -> None:
    p = slotted({"old": (100_000, None)})
    for i in range(50):
        p.submit(req(f"r{i}", 100, 50), now=0.0)
        assert len(p.dispatch(0.0)) == 1
    assert p.ledger.slots_reserved("old") == 50
    assert p.ledger.slots_total("old") is None and p.ledger.has_slot("old")


def test_admission_stage_takes_slots_from_the_capacity_report_and_shows_them() -> None:
    """The stage reads each replica's capacity() report (TargetReplica.routing_info): a
    report with state_slots_total bounds the replica, one without it (or a bare token count,
    as older callers send) leaves it unbounded; /v1/router's snapshot shows total, reserved
    (the router's) and used (the engine's last report). A request that finds every slot taken
    waits and is admitted when one is released."""
    import asyncio

    from serve_app.routing import admission

    report = {"kv_tokens_total": 10_000, "kv_tokens_used": 0, "kv_tokens_free": 10_000,
              "kv_tokens_reserved": 0, "state_slots_total": 1, "state_slots_used": 0,
              "state_slots_free": 1, "state_slots_reserved": 0}

    async def listed() -> admission.ReplicaList:
        return {"a": report}, True

    stage = admission.AdmissionStage(settings(), ask_from(listed), refresh_s=3600)

    async def run() -> None:
        assert await stage.admit("q0", list(range(100)), 50) == "a"
        second = asyncio.ensure_future(stage.admit("q1", list(range(200, 300)), 50))
        await asyncio.sleep(0.05)
        state = stage.snapshot()
        assert not second.done() and state["queued"] == 1
        a = state["replicas"]["a"]
        assert (a["state_slots_total"], a["state_slots_reserved"], a["state_slots_used"]) == (
            1, 1, 0)
        assert a["kv_tokens_committed"] == 150 < a["kv_tokens_total"]
        stage.release("q0")
        assert await asyncio.wait_for(second, HANG_GUARD_S) == "a"
        stage.release("q1")
        # Older callers: no slot bound in the report, or a bare kv_tokens_total.
        stage.sync({"a": {"kv_tokens_total": 10_000}, "b": 10_000})
        snap = stage.snapshot()["replicas"]
        assert snap["a"]["state_slots_total"] is None and snap["b"]["state_slots_total"] is None
        assert stage.policy.ledger.has_slot("a") and stage.policy.ledger.has_slot("b")

    asyncio.run(run())


def test_sglang_reports_its_resolved_max_running_requests_as_slots() -> None:
    """The SGLang backend's slot bound: SGLang 0.5.23's scheduler info has no
    max_running_requests, its internal state has the resolved value per DP rank
    (effective_max_running_requests_per_dp); the configured value is the fallback."""
    from serve_app.engines.sglang.engine import capacity_report, slot_bound

    info = {"max_total_num_tokens": 1_169_236, "max_req_input_len": 1_048_570}
    args = {"max_running_requests": 16}
    assert slot_bound(info, args) == 16
    assert slot_bound(info, args, [{"effective_max_running_requests_per_dp": 12}]) == 12
    assert slot_bound(info, args, [{"effective_max_running_requests_per_dp": 8}] * 2) == 16
    assert slot_bound({**info, "max_running_requests": 10}, args, []) == 10
    assert slot_bound(info, {"max_running_requests": None}) is None
    cap = capacity_report(1000, 1200, 4, 3, 900)
    assert cap == {"kv_tokens_total": 1000, "kv_tokens_used": 1000, "kv_tokens_free": 0,
                   "kv_tokens_reserved": 1000, "state_slots_total": 4, "state_slots_used": 3,
                   "state_slots_free": 1, "state_slots_reserved": 3, "max_req_input_len": 900}
    # No bound known: no slot keys, which the router reads as unbounded.
    unknown = capacity_report(1000, 10, None, 3, 900)
    assert not any(k.startswith("state_slots") for k in unknown)
    from serve_app.routing.admission import _resources

    assert _resources(unknown) == (1000, None) and _resources(cap) == (1000, 4)


# --- several ingress replicas: the target replica's ledger decides, the stage holds a hint ----


def test_a_refused_request_goes_back_to_the_front_and_is_not_counted_twice() -> None:
    """`requeue` undoes the dispatch (ledger, load, the client's in-flight counters) and puts
    the request at the head of its queue with its arrival: it goes before a later request,
    its client still counts it once, and the other ingresses' load (`set_external`, from the
    refusal's numbers) keeps it off the full replica until that load goes."""
    p = slotted({"a": (10_000, 1), "b": (10_000, 1)}, client_max_requests=3)
    for i in range(3):
        p.submit(RouteRequest(f"r{i}", 100, 50, client="c"), now=float(i))
    out = p.dispatch(3.0)
    assert [(r.request_id, rep) for r, rep in out] == [("r0", "a"), ("r1", "b")]
    assert p.queued() == 1
    client = p.clients["c"]
    assert (client.requests, client.in_flight, client.committed) == (3, 2, 300)
    # a refuses r0: another ingress holds its only slot.
    assert p.requeue("r0")
    p.ledger.set_external("a", 150, 1)
    assert p.queue[0].request_id == "r0" and p.queue[0].arrival == 0.0 and p.queued() == 2
    assert (client.requests, client.in_flight, client.committed) == (3, 1, 150)
    assert p.ledger.slots_reserved("a") == 0 and p.ledger.free("a") == 10_000 - 150
    assert p.load["a"].in_flight == 0
    with pytest.raises(QueueFull):  # still 3 of its client's requests: a 4th is refused
        p.submit(RouteRequest("r3", 100, 50, client="c"), now=4.0)
    assert p.dispatch(4.0) == []  # a is full (the other ingress), b is full (r1)
    p.ledger.set_external("a", 0, 0)  # the other ingress's request ended
    assert [(r.request_id, rep) for r, rep in p.dispatch(5.0)] == [("r0", "a")]
    assert p.queue[0].request_id == "r2"  # the later request still waits behind
    assert not p.requeue("gone") and p.expire(5.0 + 31.0)[0].request_id == "r2"
    for rid in ("r0", "r1"):
        p.complete(rid)
    assert "c" not in p.clients  # every count given back exactly once


def test_replica_ledger_is_atomic_reports_each_callers_share_and_releases_once() -> None:
    from serve_app.routing.reservation import ReplicaFull, ReplicaLedger, Reservation

    d = doc("d", 160)
    lg = ReplicaLedger(BS, True, 1_000, 2)
    lg.reserve("x", "i0", Reservation(170, 100, d))
    lg.reserve("y", "i1", Reservation(170, 100, d))  # the shared prefix counted once
    rep = lg.report()
    assert rep["kv_tokens_committed"] == 160 + 2 * 110 and rep["state_slots_reserved"] == 2
    assert rep["callers"] == {"i0": {"kv_tokens_committed": 270, "state_slots_reserved": 1},
                              "i1": {"kv_tokens_committed": 270, "state_slots_reserved": 1}}
    with pytest.raises(ReplicaFull) as exc:  # no slot left, however much KV is free
        lg.reserve("z", "i0", Reservation(10, 10))
    assert exc.value.info["state_slots_reserved"] == 2 and exc.value.info["refused"] == 1
    assert "z" not in lg.report()["requests"]  # a refusal changes nothing
    seq = lg.seq
    assert lg.release("x") and not lg.release("x") and lg.seq == seq + 1
    assert lg.report()["kv_tokens_committed"] == 270 and "i0" not in lg.report()["callers"]
    with pytest.raises(ReplicaFull):  # KV: 270 + 800 > 1000
        lg.reserve("big", "i0", Reservation(700, 100))
    assert lg.reservation_for(list(range(40)), 8) == Reservation(40, 8, block_hashes(
        list(range(40)), BS))


def test_two_admission_stages_over_authoritative_replicas_never_overcommit_or_idle() -> None:
    """Two ingresses' admission stages (the real AdmissionStage), each believing it sees the
    whole fleet, route a burst to two replicas whose own ledgers (ReplicaLedger) decide: no
    replica ever holds more than its slots, refused requests are re-queued and all are
    served; and a request waiting in one stage, which asks the replicas again every
    `refresh_waiting_s` while it waits, is dispatched by the first answer that shows a slot
    freed by the other stage's request."""
    import asyncio

    from serve_app.routing import admission
    from serve_app.routing.reservation import ReplicaFull, ReplicaLedger

    auth = {r: ReplicaLedger(BS, True, 10_000, 2) for r in ("a", "b")}
    peak = {"a": 0, "b": 0}
    asks = [0, 0]  # each stage's replica listings

    def listing(k: int) -> Callable[[], Awaitable[admission.ReplicaList]]:
        async def listed() -> admission.ReplicaList:
            asks[k] += 1
            return {r: {"kv_tokens_total": 10_000, "state_slots_total": 2,
                        "ledger": lg.report()} for r, lg in auth.items()}, True
        return listed

    stages = [admission.AdmissionStage(settings(), ask_from(listing(k)), refresh_s=3600,
                                       me=f"i{k}", refresh_waiting_s=0.05) for k in range(2)]

    async def start(stage: admission.AdmissionStage, rid: str, first: int) -> str:
        replica = await stage.admit(rid, list(range(first, first + 100)), 50)
        while True:
            try:
                auth[replica].reserve(rid, stage.me, stage.reservation(rid))
            except ReplicaFull as exc:
                replica = await stage.requeue(rid, replica, exc.info)
                continue
            for r, lg in auth.items():
                peak[r] = max(peak[r], lg.report()["state_slots_reserved"])
            return replica

    def end(stage: admission.AdmissionStage, rid: str, replica: str) -> None:
        auth[replica].release(rid)
        stage.release(rid)

    async def one(k: int, i: int) -> None:
        stage = stages[k]
        replica = await start(stage, f"s{k}-{i}", 1000 * i + k)
        await asyncio.sleep(0.02 * (1 + i % 3))
        end(stage, f"s{k}-{i}", replica)

    async def asked(k: int, times: int) -> None:
        """Until stage k has listed the replicas `times` more times."""
        until = asks[k] + times
        while asks[k] < until:
            await asyncio.sleep(0.01)

    async def run() -> None:
        await asyncio.wait_for(asyncio.gather(*[one(i % 2, i) for i in range(16)]),
                               HANG_GUARD_S)
        assert max(peak.values()) <= 2, peak
        assert sum(s.refusals for s in stages) > 0  # each believed it had 4 free slots
        assert all(lg.report()["state_slots_reserved"] == 0 for lg in auth.values())
        assert all(s.policy.queued() == 0 and not s.policy.clients for s in stages)
        # Stage 0 fills every slot; stage 1's request waits though its own ledger is empty.
        held = [(f"h{i}", await start(stages[0], f"h{i}", 50_000 + 100 * i)) for i in range(4)]
        waiting = asyncio.ensure_future(start(stages[1], "w", 90_000))
        # It waits through several of its stage's listings (refresh_s is an hour: these are
        # the waiting refreshes), each showing every slot taken.
        await asyncio.wait_for(asked(1, 3), HANG_GUARD_S)
        assert not waiting.done() and stages[1].policy.queued() == 1
        end(stages[0], *held[0])
        freed = asks[1]
        where = await asyncio.wait_for(waiting, HANG_GUARD_S)
        assert where == held[0][1]
        assert asks[1] == freed + 1  # placed by the first listing after the slot was freed
        end(stages[1], "w", where)
        for rid, replica in held[1:]:
            end(stages[0], rid, replica)

    asyncio.run(run())


# --- disaggregated pairs: the hand-over's transfer cost ------------------------------------------


def test_a_prefill_replica_on_the_decode_replicas_node_wins_at_equal_work() -> None:
    """At equal work the prefill replica on the decode replica's node is chosen (its hand-over
    goes through that node's object store); a request with no decode replica (`near` None)
    is placed as before, and so is a replica whose node is unknown."""
    for near, expected in (("node-a", "pa"), ("node-b", "pb")):
        p = policy({"pa": 10_000, "pb": 10_000})
        p.nodes.update({"pa": "node-a", "pb": "node-b"})
        r = req("q", 800)
        r.near = near
        p.submit(r, 0.0)
        assert p.dispatch(0.0) == [(r, expected)]
        assert r.reason == "least_work"


def test_the_transfer_costs_handoff_cost_per_prompt_token_against_prefill_work() -> None:
    """A remote prefill replica costs `handoff_cost` x prompt tokens of prefill work more: the
    local one wins while its pending prefill is below that, the remote one once it is above."""
    def choice(pending_on_local: int) -> str:
        p = policy({"local": 100_000, "remote": 100_000}, handoff_cost=0.05)
        p.nodes.update({"local": "n1", "remote": "n2"})
        p.load["local"].pending_prefill = pending_on_local
        r = req("q", 2000)  # the transfer: 0.05 x 2000 = 100 tokens of prefill
        r.near = "n1"
        p.submit(r, 0.0)
        return p.dispatch(0.0)[0][1]

    assert choice(99) == "local"
    assert choice(101) == "remote"


def test_affinity_is_not_traded_for_a_shorter_transfer() -> None:
    """A cached prefix on a remote prefill replica saves more prefill than the transfer costs:
    affinity still wins there."""
    p = policy({"local": 10_000, "remote": 10_000})
    p.nodes.update({"local": "n1", "remote": "n2"})
    d = doc("manual", 1600)
    p.index.insert(d, "remote")
    r = req("q", 1600, blocks=d)
    r.near = "n1"
    p.submit(r, 0.0)
    assert p.dispatch(0.0) == [(r, "remote")] and r.reason == "affinity"


def test_admission_stage_learns_each_replicas_node_and_prices_by_it() -> None:
    """The stage takes each replica's node from its report (shown in /v1/router) and places a
    request `near` a node on that node's replica."""
    import asyncio

    from serve_app.routing import admission

    async def listed() -> admission.ReplicaList:
        return {"a": {"kv_tokens_total": 10_000, "node": "n1"},
                "b": {"kv_tokens_total": 10_000, "node": "n2"}}, True

    stage = admission.AdmissionStage(settings(), ask_from(listed), refresh_s=3600)

    async def run() -> None:
        assert await stage.admit("q0", list(range(500)), 10, near="n2") == "b"  # not the first
        assert stage.node_of("a") == "n1"
        assert {r: s["node"] for r, s in stage.snapshot()["replicas"].items()} == {
            "a": "n1", "b": "n2"}

    asyncio.run(run())
