"""SGLang 0.5.23's KV events -> the router's prefix index (serve_app/engines/sglang/kv_events.py).

The translator on hand-built SGLang-shaped events (as `sglang/srt/mem_cache/events.py` builds
them: one BlockStored per page, coalesced along a chain, token ids per page, the parent page's
hash; one BlockRemoved per radix node) gives exactly the router's `block_hashes`, and
`PrefixIndex.follow` on its output holds what SGLang holds. CPU only: the msgspec decode and
the ZMQ subscriber run only where those packages are installed (SGLang's GPU nodes).
"""

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
from sglang_source import sglang_file
from tiny_models import wait_for

from serve_app.engines.sglang.kv_events import (
    KVEventSubscriber,
    KVEventTranslator,
    free_port_range,
)
from serve_app.routing.prefix_index import PrefixIndex, block_hashes

B = 16  # the router's block size in these tests
HANG_GUARD_S = 120.0  # the subscriber's waits: a hang fails, not a slow machine


def sg_hash(tokens: list[int], end: int) -> int:
    """A stand-in for SGLang's SHA-256 page hash (int64): any function of the prefix."""
    return hash(("sglang", tuple(tokens[:end]))) & (2**63 - 1)


def stored(tokens: list[int], page: int, first: int = 0, last: int | None = None,
           coalesce: bool = True, medium: str | None = "GPU") -> list[dict[str, Any]]:
    """SGLang's BlockStored events for pages [first, last) of `tokens` (page size `page`), the
    parent being page first - 1 (None under the root), as tagged maps."""
    last = len(tokens) // page if last is None else last
    events: list[dict[str, Any]] = []
    parent = sg_hash(tokens, first * page) if first else None
    for i in range(first, last):
        h = sg_hash(tokens, (i + 1) * page)
        chunk = tokens[i * page:(i + 1) * page]
        if coalesce and events:
            events[-1]["block_hashes"].append(h)
            events[-1]["token_ids"].extend(chunk)
        else:
            events.append({"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
                           "token_ids": list(chunk), "block_size": page, "lora_id": None,
                           "medium": medium})
        parent = h
    return events


def removed(tokens: list[int], page: int, first: int, last: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "medium": "GPU",
            "block_hashes": [sg_hash(tokens, (i + 1) * page) for i in range(first, last)]}


def ours(t: KVEventTranslator, since: int = 0, kind: str = "stored") -> list[int]:
    _, events, _ = t.events_since(since)
    return [h for e in events if e["type"] == kind for h in e["block_hashes"]]


def doc(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(160_000) for _ in range(n)]


def test_a_stored_chain_gives_the_routers_block_hashes() -> None:
    tokens = doc(100)
    for coalesce in (True, False):
        t = KVEventTranslator(B)
        t.apply(stored(tokens, 16, coalesce=coalesce))
        assert ours(t) == list(block_hashes(tokens[:96], B)) == list(block_hashes(tokens, B))
        assert all(e["page_size"] == B for e in t.events)
        assert sorted(t.held()) == sorted(block_hashes(tokens, B))


@pytest.mark.parametrize("page", [1, 4, 16, 64])
def test_children_under_parents_at_any_sglang_page_size(page: int) -> None:
    """A second request sharing a prefix stores only its new pages under the last shared one;
    SGLang's page size (1 by default, 64 with some MLA backends) need not be the router's."""
    first = doc(150, 1)
    second = first[:70] + doc(90, 2)
    t = KVEventTranslator(B)
    t.apply(stored(first, page))
    shared = 70 // page
    t.apply(stored(second, page, first=shared))
    want = set(block_hashes(first[: len(first) // page * page], B))
    want |= set(block_hashes(second[: len(second) // page * page], B))
    assert sorted(t.held()) == sorted(want)
    assert len(ours(t)) == len(set(ours(t)))  # a block is stored once
    index = PrefixIndex()
    index.follow("r0", t.events)
    full = block_hashes(second[: len(second) // page * page], B)
    assert index.match(full) == {"r0": len(full)}


def test_removals_evict_the_routers_blocks_and_the_index_follows() -> None:
    tokens = doc(128, 3)
    t = KVEventTranslator(B)
    t.apply(stored(tokens, 16))
    seq = t.event_seq
    t.apply([removed(tokens, 16, 5, 8)])  # the leaf node (pages 5..7) evicted
    hashes = block_hashes(tokens, B)
    assert ours(t, seq, "evicted") == list(hashes[5:8])
    assert sorted(t.held()) == sorted(hashes[:5])
    index = PrefixIndex()
    nxt, events, lost = t.events_since(0)
    assert not lost and nxt == t.event_seq
    index.follow("r0", events)
    assert index.match(hashes) == {"r0": 5}
    # Stored again (SGLang restores an evicted node): the same blocks come back.
    t.apply(stored(tokens, 16, first=5))
    assert ours(t, nxt) == list(hashes[5:8])
    index.follow("r0", t.events_since(nxt)[1])
    assert index.match(hashes) == {"r0": 8}


def test_removal_with_page_smaller_than_the_block() -> None:
    """SGLang page 1: a router block goes with the page that completed it (its last token)."""
    tokens = doc(40, 4)
    t = KVEventTranslator(B)
    t.apply(stored(tokens, 1))
    hashes = block_hashes(tokens, B)  # 2 blocks
    t.apply([removed(tokens, 1, 33, 40)])  # tokens 33..39: no block ends there
    assert ours(t, 0, "evicted") == []
    t.apply([removed(tokens, 1, 31, 33)])  # token 31 completes block 1
    assert ours(t, 0, "evicted") == [hashes[1]]
    assert t.held() == [hashes[0]]


def test_an_unknown_parent_loses_the_stream_and_held_resyncs() -> None:
    first, other = doc(64, 5), doc(64, 6)
    t = KVEventTranslator(B)
    t.apply(stored(first, 16))
    index = PrefixIndex()
    report = t.state(0)
    assert report["held"] is None
    index.follow("r0", report["events"], report["held"])
    index.insert(block_hashes(other, B), "r0")  # a dispatch guess the engine never confirms
    pos = report["next"]
    t.apply(stored(other, 16, first=2))  # its parent (page 1 of `other`) was never seen
    assert t.lost == 1
    report = t.state(pos)
    assert report["held"] is not None  # the reader rebuilds from what is known
    assert sorted(report["held"]) == sorted(block_hashes(first, B))
    index.follow("r0", report["events"], report["held"])
    assert index.match(block_hashes(first, B)) == {"r0": 4}
    assert index.match(block_hashes(other, B)) == {}
    again = t.state(report["next"])  # once resynced, not again
    assert again["held"] is None and again["events"] == []
    # A store under the root (parent None) is always known.
    t.apply(stored(other, 16))
    assert sorted(t.held()) == sorted(set(block_hashes(first, B)) | set(block_hashes(other, B)))


def test_a_reader_left_behind_the_buffer_resyncs() -> None:
    t = KVEventTranslator(B, max_events=4)
    for s in range(6):
        t.apply(stored(doc(32, 10 + s), 16))
    nxt, events, lost = t.events_since(0)
    assert lost and len(events) == 4 and nxt == 6
    assert not t.events_since(2)[2]


def test_other_media_clears_bigrams_and_dp_ranks() -> None:
    tokens = doc(48, 7)
    hashes = block_hashes(tokens, B)
    t = KVEventTranslator(B)
    t.apply(stored(tokens, 16, medium="CPU_PINNED"))  # HiCache's host tier: not the device
    assert t.held() == [] and t.ignored == 1
    # Bigram pages publish (token, next) pairs: the token is the first.
    event = stored(tokens, 16)[0]
    event["token_ids"] = [(x, x + 1) for x in event["token_ids"]]
    t.apply([event])
    assert ours(t) == list(hashes)
    # The same document on attention-DP rank 1: the block stays until both ranks evict it.
    t.apply(stored(tokens, 16), dp_rank=1)
    seq = t.event_seq
    t.apply([removed(tokens, 16, 0, 3)], dp_rank=0)
    assert ours(t, seq, "evicted") == [] and sorted(t.held()) == sorted(hashes)
    t.apply([{"type": "AllBlocksCleared"}], dp_rank=1)
    assert sorted(ours(t, seq, "evicted")) == sorted(hashes) and t.held() == []


@dataclass
class BlockStored:  # the shape of SGLang's decoded Struct (the translator reads attributes)
    block_hashes: list[int]
    parent_block_hash: Optional[int]  # noqa: UP045
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None  # noqa: UP045
    medium: Optional[str] = "GPU"  # noqa: UP045
    extra: dict = field(default_factory=dict)


def test_decoded_objects_are_read_like_maps() -> None:
    tokens = doc(32, 8)
    t = KVEventTranslator(B)
    e = stored(tokens, 16)[0]
    t.apply([BlockStored(e["block_hashes"], None, e["token_ids"], 16)])
    assert ours(t) == list(block_hashes(tokens, B))


# --- msgspec: SGLang 0.5.23's own Struct definitions encode, this module's mirrors decode ----


def _sglang_structs() -> dict[str, Any]:
    """srt/disaggregation/kv_events.py of 0.5.23, as written there."""
    msgspec = pytest.importorskip("msgspec")
    from typing import Union

    class EventBatch(msgspec.Struct, array_like=True, gc=False):
        ts: float
        events: list[Any]
        attn_dp_rank: Optional[int] = None  # noqa: UP045

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: Optional[int]  # noqa: UP045
        token_ids: list[int]
        block_size: int
        lora_id: Optional[int]  # noqa: UP045
        medium: Optional[str] = None  # noqa: UP045
        cache_salt: Optional[str] = None  # noqa: UP045
        session_id: Optional[str] = None  # noqa: UP045
        lora_name: Optional[str] = None  # noqa: UP045

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: Optional[str] = None  # noqa: UP045

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]  # noqa: UP007

    return {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
            "AllBlocksCleared": AllBlocksCleared, "KVEventBatch": KVEventBatch,
            "encode": msgspec.msgpack.Encoder().encode}


def _payloads(tokens: list[int]) -> list[bytes]:
    sg = _sglang_structs()
    events = []
    for e in stored(tokens, 16):
        events.append(sg["BlockStored"](block_hashes=e["block_hashes"],
                                        parent_block_hash=e["parent_block_hash"],
                                        token_ids=e["token_ids"], block_size=16, lora_id=None,
                                        medium="GPU", session_id="s1"))
    first = sg["KVEventBatch"](ts=time.time(), events=events)
    second = sg["KVEventBatch"](ts=time.time(), events=[
        sg["BlockRemoved"](**{k: v for k, v in removed(tokens, 16, 2, 4).items() if k != "type"}),
        sg["AllBlocksCleared"]()], attn_dp_rank=0)
    return [sg["encode"](first), sg["encode"](second)]


def test_msgspec_round_trip_of_sglangs_batches() -> None:
    from serve_app.engines.sglang.kv_events import decoder, structs

    tokens = doc(64, 9)
    hashes = block_hashes(tokens, B)
    first, second = _payloads(tokens)
    batch = decoder().decode(first)
    assert type(batch).__name__ == "KVEventBatch" and batch.attn_dp_rank is None
    assert [type(e).__name__ for e in batch.events] == ["BlockStored"]
    assert isinstance(batch.events[0], structs()["BlockStored"])
    assert batch.events[0].session_id == "s1" and batch.events[0].medium == "GPU"
    t = KVEventTranslator(B)
    sub = KVEventSubscriber(t, [])
    sub._decoder = decoder()
    sub.handle((0).to_bytes(8, "big"), first)
    assert ours(t) == list(hashes) and t.lost == 0
    sub.handle((2).to_bytes(8, "big"), second)  # batch 1 never came: lost
    assert t.lost == 1
    evicted = [e["block_hashes"] for e in t.events if e["type"] == "evicted"]
    assert evicted[0] == list(hashes[2:4])  # the node of pages 2..3, then everything cleared
    assert sorted(h for e in evicted for h in e) == sorted(hashes)
    assert t.held() == []
    sub.handle((3).to_bytes(8, "big"), b"not msgpack")
    assert t.lost == 2


def test_zmq_subscriber_follows_a_publisher() -> None:
    """SGLang's ZmqEventPublisher wire format: (topic, 8-byte big-endian seq, payload). The
    test's publisher is an XPUB socket (a PUB that also hears its subscribers), so the batch
    goes out once the subscriber has subscribed: what a PUB sends before that is dropped."""
    zmq = pytest.importorskip("zmq")
    first, _ = _payloads(doc(64, 11))
    port = free_port_range(1)
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    t = KVEventTranslator(B)
    sub = KVEventSubscriber(t, [f"tcp://127.0.0.1:{port}"]).start()
    try:
        assert sub.running
        assert pub.poll(int(HANG_GUARD_S * 1000)), "the subscriber never subscribed"
        assert pub.recv() == b"\x01"  # subscribed, to every topic
        pub.send_multipart((b"", (0).to_bytes(8, "big"), first))
        assert wait_for(lambda: len(ours(t)) == 4, HANG_GUARD_S, interval=0.05), t.events
        assert t.lost == 0
    finally:
        sub.stop()
        pub.close(linger=0)
    assert not sub.running


# --- the engine: prefix_events, and no events without pyzmq/msgspec -------------------------


def test_engine_prefix_events_is_the_translators_state(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    import sys

    from sglang_helpers import app_config

    from serve_app.engines.sglang.engine import SGLangEngine

    engine = SGLangEngine.__new__(SGLangEngine)
    engine.kv_events = None
    assert engine.prefix_events(0) is None
    t = KVEventTranslator(B)
    sub = KVEventSubscriber(t, [])
    engine.kv_events = sub
    assert engine.prefix_events(0) is None  # not running
    stop = threading.Event()
    sub._thread = threading.Thread(target=stop.wait, daemon=True)
    sub._thread.start()
    try:
        tokens = doc(32, 12)
        t.apply(stored(tokens, 16))
        assert engine.prefix_events(0) == {"next": 1, "events": t.events, "held": None}
        assert engine.prefix_events(1)["events"] == []
    finally:
        stop.set()
    # Without pyzmq (CI), the engine starts without events: a warning, never a failure.
    monkeypatch.setitem(sys.modules, "zmq", None)
    config = app_config("deployments/kimi_dspark.yaml")
    with caplog.at_level("WARNING"):
        subscriber, port = SGLangEngine._kv_events(config)
    assert subscriber is None and isinstance(port, int) and port > 0
    assert "KV events not followed" in caplog.text
    off = app_config("deployments/kimi_dspark.yaml", engine={"sglang": {"kv_events": False}})
    assert SGLangEngine._kv_events(off) == (None, None)


def test_sglangs_own_structs_decode_with_the_mirrors(monkeypatch: pytest.MonkeyPatch) -> None:
    """0.5.23's srt/disaggregation/kv_events.py itself (SGLANG_SRC), its two sglang imports
    stubbed: what its publisher encodes, this module decodes and translates."""
    import importlib.util
    import sys
    import types

    source = sglang_file("srt/disaggregation/kv_events.py")
    msgspec = pytest.importorskip("msgspec")
    pytest.importorskip("zmq")
    from serve_app.engines.sglang.kv_events import decoder

    for name in ("sglang", "sglang.srt", "sglang.srt.utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    runtime = types.ModuleType("sglang.srt.runtime_context")
    runtime.get_parallel = lambda: None  # type: ignore[attr-defined]
    network = types.ModuleType("sglang.srt.utils.network")
    network.NetworkAddress = object  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, runtime.__name__, runtime)
    monkeypatch.setitem(sys.modules, network.__name__, network)
    spec = importlib.util.spec_from_file_location("sglang_kv_events_0_5_23", source)
    assert spec and spec.loader
    sg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sg)
    tokens = doc(64, 13)
    gpu = sg.StorageMedium.GPU
    batch = sg.KVEventBatch(ts=time.time(), events=[
        sg.BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=tokens[:32],
                       block_size=16, lora_id=None, medium=gpu),
        sg.BlockStored(block_hashes=[13, 14], parent_block_hash=12, token_ids=tokens[32:],
                       block_size=16, lora_id=None, medium=gpu),
        sg.BlockRemoved(block_hashes=[14], medium=gpu)], attn_dp_rank=0)
    decoded = decoder().decode(msgspec.msgpack.Encoder().encode(batch))
    t = KVEventTranslator(B)
    t.apply(decoded.events, decoded.attn_dp_rank)
    assert sorted(t.held()) == sorted(block_hashes(tokens, B)[:3])
