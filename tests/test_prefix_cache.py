"""The reference engine's prefix cache on both families: a hit gives exactly what a miss gives,
the hybrid reuses only up to a KDA snapshot, eviction never takes what a running request uses,
aborts leave the tree consistent, and its events carry the router's block hashes."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from spec_helpers import GREEDY, engine_from
from tiny_models import tiny_k3_config, write_random_k3_pair, write_tiny_pair

from serve_app.engines.reference.engine import EngineCore
from serve_app.engines.reference.sampling import SamplingParams
from serve_app.models.k3_weights import load_k3
from serve_app.routing.prefix_index import block_hashes

VOCAB = {"k2": 62, "k3": 250}
GRID = 64
CHUNKED = {"prefill_chunk_tokens": 48, "max_prefill_tokens_per_request": 48}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    return {"k2": write_tiny_pair(tmp_path_factory.mktemp("k2")),
            "k3": write_random_k3_pair(tmp_path_factory.mktemp("k3"), tiny_k3_config(256))}


def cached_engine(pair: tuple[Path, Path], **engine: Any) -> EngineCore:
    spec = engine.pop("spec", {})
    settings = {**CHUNKED, "prefix_cache": {"enabled": True, "snapshot_interval": GRID},
                **engine}
    return engine_from(pair, engine=settings, **spec)


def document_prompts(family: str, n: int, doc_len: int = 200, seed: int = 0) -> list[list[int]]:
    """n questions on one document: a shared prefix, then a different tail each."""
    rng = random.Random(seed)
    v = VOCAB[family]
    doc = [rng.randrange(v) for _ in range(doc_len)]
    return [doc + [rng.randrange(v) for _ in range(rng.randint(3, 20))] for _ in range(n)]


def check_tree(engine: EngineCore) -> None:
    """Page references add up: every page a request or the tree holds is counted once per
    holder and is not in the free pool; locks are held only by running requests."""
    alloc, prefix = engine.runner.allocator, engine.runner.prefix
    assert prefix is not None
    holders = [0] * alloc.num_pages
    for pages in alloc._pages.values():
        for p in pages:
            holders[p] += 1
    for node in prefix.nodes():
        holders[node.page] += 1
    assert holders == alloc._refs
    assert not set(alloc._free_pages) & {p for p, n in enumerate(holders) if n}
    running = {s.request_id for s in engine.scheduler.running}
    assert set(prefix._locked) <= running
    if not running:
        assert all(n.locks == 0 for n in prefix.nodes())
    # What capacity() says the cache alone holds: its pages that no running request locks.
    free_nodes = sum(1 for n in prefix.nodes() if n.locks == 0)
    assert engine.capacity()["kv_tokens_evictable"] == free_nodes * prefix.page


@pytest.mark.parametrize("family,rollback", [("k2", "scratch"), ("k3", "scratch"),
                                             ("k3", "replay")])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_cache_hit_gives_what_a_miss_gives(pairs: dict, family: str, rollback: str,
                                             sampled: bool) -> None:
    prompts = document_prompts(family, 4, doc_len=220)
    params = (SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
              if sampled else GREEDY)
    miss = engine_from(pairs[family], engine=CHUNKED, kda_rollback=rollback)
    expected = [o.token_ids for o in miss.generate(prompts, params)]
    engine = cached_engine(pairs[family], spec={"kda_rollback": rollback})
    first = engine.generate(prompts[:1], params)  # caches the document
    rest = engine.generate(prompts[1:], params)  # three hits, batched
    assert [o.token_ids for o in first + rest] == expected
    assert first[0].cached_tokens == 0
    # K2 reuses every full page of the document; the hybrid up to its last snapshot.
    hit = 192 if family == "k3" else 208  # snapshots at 64/128/192; 13 full pages of 220
    assert [o.cached_tokens for o in rest] == [hit] * 3
    assert engine.stats()["cached_tokens_total"] == 3 * hit
    check_tree(engine)


def test_a_partial_hybrid_hit_stops_at_the_snapshot_before_it(pairs: dict) -> None:
    prompts = document_prompts("k3", 1, doc_len=200)
    engine = cached_engine(pairs["k3"])
    engine.generate(prompts, GREEDY)
    assert engine.runner.prefix.snapshots == 3  # at 64, 128, 192
    # A prompt that shares the first 150 tokens: KV matches 9 pages (144 tokens), but a KDA
    # state exists only at 128.
    other = [*prompts[0][:150], 7, 8, 9]
    out = engine.generate([other], GREEDY)[0]
    assert out.cached_tokens == 128
    expected = engine_from(pairs["k3"], engine=CHUNKED).generate([other], GREEDY)[0]
    assert out.token_ids == expected.token_ids
    # The same prompt on K2 reuses all 9 full pages.
    k2 = cached_engine(pairs["k2"])
    k2.generate(document_prompts("k2", 1, doc_len=200), GREEDY)
    shared = [*document_prompts("k2", 1, doc_len=200)[0][:150], 7, 8, 9]
    assert k2.generate([shared], GREEDY)[0].cached_tokens == 144


def test_the_copied_state_equals_prefilling_from_scratch(pairs: dict) -> None:
    prompts = document_prompts("k3", 2)
    engine = cached_engine(pairs["k3"], spec={"enabled": False})
    engine.generate(prompts[:1], GREEDY)
    rid = engine.add_request(prompts[1], GREEDY)
    engine.step()  # admitted: its slot holds the snapshot at 192 (then prefills the rest)
    seq = engine.sequences[rid]
    assert seq.cached_tokens == 192
    model = load_k3(pairs["k3"][0]).eval()
    with torch.no_grad():
        _, state = model(torch.tensor([prompts[1][:192]]))
    # The snapshot copied into the request's slot (a different chunking, the same state).
    snapshots = engine.runner.cache.snapshots
    node = engine.runner.prefix._locked[rid]
    for layer, kda in state.kda.items():
        snap = snapshots.layers[layer]
        slot = snapshots.slot(node.snapshot)
        assert torch.allclose(snap.ssm[slot], kda.ssm[0], atol=1e-5, rtol=1e-4), layer
        assert torch.allclose(snap.conv[slot], kda.conv[0].to(snap.conv.dtype), atol=1e-6)


@pytest.mark.parametrize("family", ["k2", "k3"])
def test_eviction_never_takes_what_a_running_request_uses(pairs: dict, family: str) -> None:
    # 20 pages of KV and 3 snapshots: every new document must evict older ones.
    engine = cached_engine(pairs[family], kv_capacity_tokens=320, max_batch_size=2,
                           prefix_cache={"enabled": True, "snapshot_interval": GRID,
                                         "state_snapshots": 3})
    docs = [document_prompts(family, 2, doc_len=100, seed=s) for s in range(5)]
    reference = engine_from(pairs[family], engine={**CHUNKED, "kv_capacity_tokens": 320,
                                                   "max_batch_size": 2})
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for questions in docs:
        for q in questions:
            engine.add_request(q, params)
        while engine.has_work:
            engine.step()
            check_tree(engine)
    stats = engine.stats()
    assert stats["prefix_evicted_pages"] > 0
    if family == "k3":
        assert stats["prefix_evicted_snapshots"] > 0
        assert engine.runner.cache.snapshots.used <= 3
    again = [engine.generate([q], params)[0].token_ids for q in docs[-1]]
    assert again == [o.token_ids for o in reference.generate(docs[-1], params)]


@pytest.mark.parametrize("family", ["k2", "k3"])
def test_an_abort_during_a_matched_prefill_leaves_the_tree_consistent(pairs: dict,
                                                                      family: str) -> None:
    prompts = document_prompts(family, 3)
    engine = cached_engine(pairs[family])
    engine.generate(prompts[:1], GREEDY)
    long_tail = [*prompts[1], *range(3, 60)]  # several prefill steps after the hit
    rid = engine.add_request(long_tail, GREEDY)
    engine.step()
    assert engine.sequences[rid].cached_tokens > 0
    assert engine.sequences[rid].num_cached < len(long_tail)  # still prefilling
    assert engine.abort(rid)
    check_tree(engine)
    assert all(n.locks == 0 for n in engine.runner.prefix.nodes())
    out = engine.generate(prompts[2:], GREEDY)[0]
    assert out.cached_tokens > 0
    expected = engine_from(pairs[family], engine=CHUNKED).generate(prompts[2:], GREEDY)[0]
    assert out.token_ids == expected.token_ids


def test_cache_events_carry_the_router_block_hashes(pairs: dict) -> None:
    prompts = document_prompts("k2", 1)
    engine = cached_engine(pairs["k2"], kv_capacity_tokens=320)
    engine.generate(prompts, GREEDY)
    prefix = engine.runner.prefix
    seq, events, lost = prefix.events_since(0)
    assert not lost and seq == len(events) > 0
    stored = [h for e in events if e["type"] == "stored" for h in e["block_hashes"]]
    # The router's index hashes the same blocks the same way (page size = block size 16).
    assert stored[: len(prompts[0]) // 16] == list(block_hashes(prompts[0], 16))
    assert all(e["page_size"] == 16 for e in events)
    # Evictions are published too.
    for s in range(1, 4):
        engine.generate(document_prompts("k2", 1, seed=s), GREEDY)
    _, later, _ = prefix.events_since(seq)
    evicted = {h for e in later if e["type"] == "evicted" for h in e["block_hashes"]}
    assert evicted and not evicted & set(prefix.block_hashes_held())


@pytest.mark.parametrize("spec", [{"enabled": False}, {"kda_rollback": "scratch"},
                                  {"kda_rollback": "replay"}])
def test_a_hybrid_answer_is_reusable_from_its_decode_snapshots(pairs: dict,
                                                              spec: dict[str, Any]) -> None:
    """Snapshots every `decode_snapshot_interval` tokens while decoding (from the verify
    window when speculating): a follow-up on the conversation resumes at the last one."""
    prompt = document_prompts("k3", 1, doc_len=40)[0]
    long = SamplingParams(temperature=0.0, max_tokens=110, ignore_eos=True)
    engine = cached_engine(pairs["k3"], spec=spec,
                           prefix_cache={"enabled": True, "snapshot_interval": GRID,
                                         "decode_snapshot_interval": GRID})
    answer = engine.generate([prompt], long)[0].token_ids
    assert len(prompt) + len(answer) > 2 * GRID
    follow_up = [*prompt, *answer[: 2 * GRID + 5 - len(prompt)], 7, 8, 9]
    out = engine.generate([follow_up], GREEDY)[0]
    assert out.cached_tokens == 2 * GRID  # the decode snapshot at 128
    expected = engine_from(pairs["k3"], engine=CHUNKED, **spec).generate([follow_up], GREEDY)
    assert out.token_ids == expected[0].token_ids
    check_tree(engine)


def test_the_router_index_follows_the_engine_events(pairs: dict) -> None:
    """The router's PrefixIndex, fed the engine's events, holds what the engine holds: a
    cached document matches, an evicted one stops matching; a lost stream resyncs."""
    from serve_app.routing.prefix_index import PrefixIndex

    engine = cached_engine(pairs["k2"], kv_capacity_tokens=320)
    prefix = engine.runner.prefix
    index = PrefixIndex()
    seq = 0
    docs = [document_prompts("k2", 1, doc_len=100, seed=s)[0] for s in range(4)]
    for doc in docs:
        engine.generate([doc], GREEDY)
        seq, events, lost = prefix.events_since(seq)
        index.follow("r", events, prefix.block_hashes_held() if lost else None)
    held = set(prefix.block_hashes_held())
    for doc in docs:
        hashes = block_hashes(doc, 16)
        engine_blocks = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
        assert index.match(hashes).get("r", 0) == engine_blocks
    assert index.match(block_hashes(docs[0], 16)) == {}  # evicted by the later documents
    assert index.match(block_hashes(docs[-1], 16)) == {"r": 6}  # 100 tokens: 6 full pages
    rebuilt = PrefixIndex()
    rebuilt.follow("r", [], prefix.block_hashes_held())
    assert rebuilt.match(block_hashes(docs[-1], 16)) == {"r": 6}


@pytest.mark.parametrize("family", ["k2", "k3"])
def test_admission_counts_a_cached_prefix_once(pairs: dict, family: str) -> None:
    """Two questions on a cached 300-token document in 512 KV tokens: counted twice (704) they
    would run one after the other; counted once (288 pinned + 2 x 64 private) they run
    together, and their pages never exceed the pool."""
    doc = document_prompts(family, 3, doc_len=300)
    engine = cached_engine(pairs[family], kv_capacity_tokens=512, max_batch_size=4,
                           prefix_cache={"enabled": True, "snapshot_interval": 32})
    engine.generate(doc[:1], GREEDY)
    for q in doc[1:]:
        engine.add_request(q, GREEDY)
    engine.step()
    assert len(engine.scheduler.running) == 2
    assert all(s.cached_tokens >= 256 for s in engine.scheduler.running)
    while engine.has_work:
        engine.step()
        check_tree(engine)
    alone = engine_from(pairs[family], engine=CHUNKED)
    assert ([engine.generate([q], GREEDY)[0].token_ids for q in doc[1:]]
            == [o.token_ids for o in alone.generate(doc[1:], GREEDY)])


@pytest.mark.parametrize("spec", [{"enabled": False}, {"kda_rollback": "scratch"},
                                  {"kda_rollback": "replay"}])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_full_snapshot_pool_behaves_the_same_in_prefill_and_decode(
        pairs: dict, phase: str, spec: dict[str, Any]) -> None:
    """One snapshot slot, held by an earlier document's unlocked snapshot: a new snapshot, at a
    prefill grid line or a decode one (from the verify window when speculating), evicts it
    and is taken; the earlier document is no longer reusable, the new position is."""
    engine = cached_engine(pairs["k3"], spec=spec,
                           prefix_cache={"enabled": True, "snapshot_interval": GRID,
                                         "decode_snapshot_interval": GRID,
                                         "state_snapshots": 1})
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = document_prompts("k3", 2, doc_len=100, seed=1)
    engine.generate(first[:1], short)
    prefix = engine.runner.prefix
    assert prefix.snapshots == 1 and engine.stats()["prefix_evicted_snapshots"] == 0
    if phase == "prefill":
        second = document_prompts("k3", 2, doc_len=100, seed=2)
        engine.generate(second[:1], short)
        follow_up = second[1]
    else:
        prompt = document_prompts("k3", 1, doc_len=40, seed=2)[0]
        answer = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40,
                                                          ignore_eos=True))[0].token_ids
        follow_up = [*prompt, *answer[: GRID + 5 - len(prompt)], 7, 8, 9]
    assert engine.stats()["prefix_evicted_snapshots"] == 1
    assert prefix.snapshots == 1 and engine.runner.cache.snapshots.used == 1
    out = engine.generate([follow_up], GREEDY)[0]
    assert out.cached_tokens == GRID
    assert engine.generate([first[1]], GREEDY)[0].cached_tokens == 0
    expected = engine_from(pairs["k3"], engine=CHUNKED, **spec).generate([follow_up], GREEDY)
    assert out.token_ids == expected[0].token_ids
    check_tree(engine)


def test_incremental_counts_equal_a_walk_of_the_tree(pairs: dict) -> None:
    """The prefix cache's kept counts (pages, snapshots, pinned tokens) equal what a walk of
    the tree counts, through hits, evictions and requests still running."""
    engine = cached_engine(pairs["k3"], kv_capacity_tokens=320, max_batch_size=2,
                           prefix_cache={"enabled": True, "snapshot_interval": 32,
                                         "state_snapshots": 3})
    prefix = engine.runner.prefix
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    walked = 0
    for seed in range(4):
        for q in document_prompts("k3", 2, doc_len=90, seed=seed):
            engine.add_request(q, params)
        while engine.has_work:
            engine.step()
            nodes = prefix.nodes()
            assert prefix.cached_pages == len(nodes)
            assert prefix.snapshots == sum(n.snapshot is not None for n in nodes)
            assert prefix.pinned_tokens == 16 * sum(n.locks > 0 for n in nodes)
            walked += 1
    assert walked > 20 and engine.stats()["prefix_evicted_pages"] > 0
