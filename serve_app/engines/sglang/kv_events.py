"""SGLang 0.5.23's KV events -> the router's prefix index (docs/prefix-cache.md, "SGLang").

SGLang publishes its radix cache's insertions and evictions (`--kv-events-config`, ZMQ PUB of
msgspec-msgpack `KVEventBatch`es, `sglang/srt/disaggregation/kv_events.py`). Its block hashes
are SHA-256 based (`mem_cache/utils.py`), not the router's chain, but every `BlockStored`
carries its pages' token ids and its parent block's hash, so the chain is recomputed here:

- `KVEventTranslator`: pure. SGLang events (the decoded Structs, or plain dicts with a `type`
  key) -> this project's `{seq, type: stored | evicted, block_hashes, page_size}` events over
  the router's blocks (`serve_app.routing.prefix_index.block_hashes(tokens, block_size)`, any
  SGLang page size), in a bounded buffer read with `events_since(seq)`, and `held()` for a
  resync, as `serve_app/engines/reference/prefix_cache.py` keeps them.
- `KVEventSubscriber`: the thread that reads the publisher (pyzmq and msgspec, imported lazily:
  they come with SGLang on GPU nodes; without them the engine runs without events).

Images. SGLang's radix cache does not key an image's positions on the `<|media_pad|>` id: it
keys them on the image's pad sentinels, four values >= `MM_PAD_SHIFT_VALUE` derived from a
SHA-256 identity of the image's bytes, K3's preprocessing config and its grid, repeated over
the pad run (0.5.23 managers/schedule_batch.py:167, 268-276, 422-446; mm_utils.py:313-352;
kimi_common.py:48-57), and its `BlockStored` events carry those sentinels as token ids
(mem_cache/events.py:240-270). The router keys the same positions on
`serve_app.protocol.media.cache_keys` (a negative key from our digest of the decoded image).
The translator maps every sentinel back to our key (`ImageSentinels`) before it chains, so an
engine's events and the router's own hashes of a request are one chain and agree block for
block. Keying the router SGLang's way instead is not possible from outside SGLang: the
identity hashes a fingerprint of the processor's loaded config (multimodal/cache/), and K3
refuses caller-supplied `mm_hashes` (kimi_common.py:106-118), the hook other routers use.
So the engine learns each image's sentinels from SGLang's own processor output in its process
(`SGLangEngine`, `learn_sentinels`) before the scheduler sees the request (so before any event
that holds them). A sentinel never learned (the registry's bound, a path that sets no identity
in the tokenizer) maps to a key of its own, outside our keys' range: the router then misses a
hit it could have had, and two different images still never share a block.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from serve_app.protocol.media import ImageInput
from serve_app.routing.prefix_index import chain_hashes

logger = logging.getLogger(__name__)

# The router index's hash-chain seed (serve_app.routing.prefix_index).
CHAIN_SEED = 0x9E3779B97F4A7C15
MAX_EVENTS = 4096  # kept for the router to read (oldest dropped first; it then resyncs)
MAX_RETIRED = 65_536  # evicted SGLang pages whose chain state is kept (a page stored again)
GPU_MEDIA = (None, "GPU")  # BlockStored/BlockRemoved.medium of the device cache
# 0.5.23 managers/schedule_batch.py:167: every image pad sentinel is at least this (above any
# vocabulary id; SGLang refuses a vocabulary that reaches it).
MM_PAD_SHIFT_VALUE = 1_000_000
MAX_IMAGES = 65_536  # images whose sentinels are kept (least recently seen dropped first)
# Our image keys lie in [-2**62, -1] (protocol/media.py); unlearned sentinels go below that.
_UNLEARNED_BASE = -(1 << 62) - 1


def _field(event: Any, name: str, default: Any = None) -> Any:
    if isinstance(event, dict):
        return event.get(name, default)
    return getattr(event, name, default)


def _kind(event: Any) -> str:
    """`BlockStored` / `BlockRemoved` / `AllBlocksCleared`: msgspec's tag (the class name) or
    a dict's `type` key (a tagged map decoded without the Structs)."""
    if isinstance(event, dict):
        return str(event.get("type", ""))
    return type(event).__name__


def _token(t: Any) -> int:
    # Bigram pages (EAGLE's bigram keys) publish (token, next token) pairs: the token is the
    # first one.
    return int(t[0]) if isinstance(t, (list, tuple)) else int(t)


class ImageSentinels:
    """SGLang's image pad sentinels -> our image keys (`ImageInput.key`), bounded (the least
    recently seen image first out). Thread-safe: the engine learns on its event loop, the
    subscriber thread reads."""

    def __init__(self, max_images: int = MAX_IMAGES) -> None:
        self.max_images = max_images
        self._keys: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()
        self.unlearned = 0  # sentinel tokens met that were never learned

    def learn(self, sentinels: Sequence[int], key: int) -> None:
        with self._lock:
            for s in sentinels:
                self._keys[int(s)] = key
                self._keys.move_to_end(int(s))
            # Each image holds up to four sentinels.
            while len(self._keys) > 4 * self.max_images:
                self._keys.popitem(last=False)

    def key(self, token: int) -> int:
        """The cache key of a token id as SGLang's radix cache holds it: itself for text,
        our image key for a learned sentinel, a key of its own for an unlearned one."""
        if token < MM_PAD_SHIFT_VALUE:
            return token
        with self._lock:
            key = self._keys.get(token)
        if key is None:
            self.unlearned += 1
            return _UNLEARNED_BASE - token
        return key


def item_sentinels(item: Any) -> tuple[int, ...] | None:
    """One SGLang MultimodalDataItem's pad sentinels (`padding_values()`, schedule_batch.py:
    438-439), None when SGLang has not set them yet."""
    values = getattr(item, "pad_values", None) or (getattr(item, "pad_value", None),)
    if values[0] is None:
        return None
    return tuple(int(v) for v in values)


def learn_sentinels(registry: ImageSentinels, mm_items: Sequence[Any],
                    images: Sequence[ImageInput]) -> int:
    """Learn the sentinels of one request's images from SGLang's processor output (its
    `mm_items`, one per image in `image_data` order = prompt order, kimi_k3.py:642-665).
    Returns how many images were learned (0 when the counts disagree: nothing is guessed)."""
    items = [i for i in mm_items if str(getattr(i, "modality", "IMAGE")).endswith("IMAGE")]
    if len(items) != len(images):
        logger.warning("SGLang returned %d image items for %d images: their sentinels are not "
                       "learned", len(items), len(images))
        return 0
    learned = 0
    for item, image in zip(items, images, strict=True):
        values = item_sentinels(item)
        if values is not None:
            registry.learn(values, image.key)
            learned += 1
    return learned


class _Page:
    """One SGLang page: the router's chain state at its end and the blocks completed in it."""

    __slots__ = ("boundary", "held", "ours", "parent", "rem", "tail")

    def __init__(self, ours: tuple[int, ...], boundary: int, rem: int, tail: tuple[int, ...],
                 parent: Any) -> None:
        self.ours = ours  # router block hashes whose last token is in this page
        self.boundary = boundary  # router hash at the last block boundary <= this page's end
        self.rem = rem  # tokens from that boundary to the page's end (< block_size)
        self.tail = tail  # this page's tokens after that boundary (the last min(rem, page))
        self.parent = parent  # the parent page's key, or None under the root
        self.held = True


class KVEventTranslator:
    """See the module doc. `block_size`: the router's (`router.block_size`); SGLang's page size
    comes with each event. Pages are keyed by (attention-DP rank, SGLang hash): each rank has
    its own cache and publisher; a router block held by several counts until the last goes."""

    def __init__(self, block_size: int, max_events: int = MAX_EVENTS,
                 max_retired: int = MAX_RETIRED, images: ImageSentinels | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size={block_size} must be > 0")
        self.block_size = block_size
        self.images = images or ImageSentinels()
        self.max_events = max_events
        self.max_retired = max_retired
        self.lock = threading.RLock()
        self._pages: dict[tuple[int, int], _Page] = {}
        self._retired: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._count: dict[int, int] = {}  # router block -> held pages that completed it
        self.events: list[dict[str, Any]] = []
        self.event_seq = 0  # numbers given out (a loss takes one too)
        self.lost_at = -1  # a reader at or before this position missed something
        self.lost = 0  # times the stream was lost
        self.ignored = 0  # events ignored (another medium, unknown type)

    # --- reading ------------------------------------------------------------------------------

    def events_since(self, seq: int) -> tuple[int, list[dict[str, Any]], bool]:
        """(the next sequence number, the events numbered >= seq, whether the reader must
        rebuild from `held()`: events it has not read were dropped, or the stream was lost)."""
        with self.lock:
            first = self.events[0]["seq"] if self.events else self.event_seq
            lost = seq < first or seq <= self.lost_at
            return self.event_seq, [e for e in self.events if e["seq"] >= seq], lost

    def held(self) -> list[int]:
        """Every router block some held SGLang page completes."""
        with self.lock:
            return list(self._count)

    def state(self, since: int) -> dict[str, Any]:
        """`routing_info`'s prefix report: {next, events, held (only when lost)}."""
        with self.lock:
            nxt, events, lost = self.events_since(since)
            return {"next": nxt, "events": events, "held": self.held() if lost else None}

    # --- applying -----------------------------------------------------------------------------

    def apply(self, events: Iterable[Any], dp_rank: int | None = 0) -> None:
        """One `KVEventBatch`'s events (in order), from attention-DP rank `dp_rank`."""
        rank = int(dp_rank or 0)
        with self.lock:
            for event in events:
                kind = _kind(event)
                if kind == "BlockStored":
                    self._store(event, rank)
                elif kind == "BlockRemoved":
                    self._remove(event, rank)
                elif kind == "AllBlocksCleared":
                    self._clear(rank)
                else:
                    self.ignored += 1

    def mark_lost(self, why: str) -> None:
        """Events were missed (a gap in the publisher's sequence, an undecodable batch, a page
        under an unknown parent): readers rebuild from `held()` on their next read."""
        with self.lock:
            self.lost += 1
            self.lost_at = self.event_seq
            self.event_seq += 1
        logger.warning("SGLang KV event stream lost (%s): the router resyncs from the blocks "
                       "still known", why)

    def _publish(self, kind: str, hashes: list[int]) -> None:
        self.events.append({"seq": self.event_seq, "type": kind, "block_hashes": hashes,
                            "page_size": self.block_size})
        self.event_seq += 1
        if len(self.events) > self.max_events:
            del self.events[: len(self.events) - self.max_events]

    def _pending(self, page: _Page) -> list[int] | None:
        """The tokens after `page.boundary` up to the page's end (a partial router block),
        from the tails of the page and its ancestors; None if an ancestor is unknown."""
        parts: list[tuple[int, ...]] = []
        got, cur = 0, page
        while True:
            parts.append(cur.tail)
            got += len(cur.tail)
            if got >= page.rem:
                break
            parent = None if cur.parent is None else self._pages.get(cur.parent)
            if parent is None:
                return None
            cur = parent
        out: list[int] = []
        for part in reversed(parts):
            out.extend(part)
        return out[len(out) - page.rem:]

    def _store(self, event: Any, rank: int) -> None:
        if _field(event, "medium") not in GPU_MEDIA:
            self.ignored += 1
            return
        hashes = list(_field(event, "block_hashes") or ())
        # Image positions: SGLang's sentinels -> our image keys (the module doc).
        tokens = [self.images.key(_token(t)) for t in (_field(event, "token_ids") or ())]
        page = int(_field(event, "block_size") or 0)
        if not hashes:
            return
        if page <= 0 or len(tokens) < page * (len(hashes) - 1) + 1:
            self.mark_lost(f"BlockStored with {len(tokens)} tokens for {len(hashes)} pages of "
                           f"{page}")
            return
        parent_hash = _field(event, "parent_block_hash")
        parent_key = None if parent_hash is None else (rank, int(parent_hash))
        if parent_key is None:
            prev, pending = CHAIN_SEED, []
        else:
            parent = self._pages.get(parent_key)
            found = None if parent is None else self._pending(parent)
            if parent is None or found is None:
                self.mark_lost(f"BlockStored under unknown parent {parent_hash}")
                return
            prev, pending = parent.boundary, found
        stored: list[int] = []
        bs = self.block_size
        for i, h in enumerate(hashes):
            chunk = tokens[i * page:(i + 1) * page] if i < len(hashes) - 1 else tokens[i * page:]
            buf = pending + chunk
            full = len(buf) // bs
            ours = chain_hashes((tuple(buf[j * bs:(j + 1) * bs]) for j in range(full)), prev)
            if ours:
                prev = ours[-1]
            pending = buf[full * bs:]
            tail = tuple(pending[-len(chunk):]) if pending else ()
            key = (rank, int(h))
            old = self._pages.get(key)
            if old is None or not old.held:
                self._retired.pop(key, None)
                self._pages[key] = _Page(ours, prev, len(pending), tail, parent_key)
                for o in ours:
                    self._count[o] = self._count.get(o, 0) + 1
                stored.extend(ours)
            parent_key = key
        if stored:
            self._publish("stored", stored)

    def _remove(self, event: Any, rank: int) -> None:
        if _field(event, "medium") not in GPU_MEDIA:
            self.ignored += 1
            return
        evicted: list[int] = []
        for h in _field(event, "block_hashes") or ():
            key = (rank, int(h))
            page = self._pages.get(key)
            if page is None or not page.held:
                continue  # never known (stored under an unknown parent): nothing indexed
            page.held = False
            self._retired[key] = None
            for o in page.ours:
                left = self._count.get(o, 0) - 1
                if left <= 0:
                    self._count.pop(o, None)
                    evicted.append(o)
                else:
                    self._count[o] = left
        while len(self._retired) > self.max_retired:
            key, _ = self._retired.popitem(last=False)
            page = self._pages.get(key)
            if page is not None and not page.held:
                del self._pages[key]
        if evicted:
            self._publish("evicted", evicted)

    def _clear(self, rank: int) -> None:
        keys = [k for k, p in self._pages.items() if k[0] == rank and p.held]
        self._remove({"block_hashes": [k[1] for k in keys]}, rank)
        for k in [k for k in self._pages if k[0] == rank]:
            del self._pages[k]
            self._retired.pop(k, None)


# --- decoding: mirrors of SGLang 0.5.23's Structs (srt/disaggregation/kv_events.py) ----------


@functools.cache
def structs() -> dict[str, Any]:
    """msgspec Structs with SGLang 0.5.23's tags and field order (so its batches decode
    without importing sglang): `KVEventBatch` is a positional array [ts, events, attn_dp_rank];
    events are maps tagged `type` = the class name. Fields given defaults here decode from
    any 0.5.23 payload; unknown fields are ignored (msgspec's default)."""
    import msgspec

    # msgspec.defstruct with real type objects: this module's `annotations` future would leave
    # class-body annotations as strings naming function locals, which msgspec cannot resolve.
    base = msgspec.defstruct("KVCacheEvent", [], omit_defaults=True, gc=False, tag=True)
    stored = msgspec.defstruct("BlockStored", [
        ("block_hashes", list[int]),
        ("parent_block_hash", int | None, None),
        ("token_ids", list[Any], msgspec.field(default_factory=list)),  # or (token, next) pairs
        ("block_size", int, 0),
        ("lora_id", int | None, None),
        ("medium", str | None, None),
        ("cache_salt", str | None, None),
        ("session_id", str | None, None),
        ("lora_name", str | None, None),
    ], bases=(base,), omit_defaults=True, gc=False, tag=True)
    removed = msgspec.defstruct("BlockRemoved", [
        ("block_hashes", list[int]),
        ("medium", str | None, None),
    ], bases=(base,), omit_defaults=True, gc=False, tag=True)
    cleared = msgspec.defstruct("AllBlocksCleared", [], bases=(base,), omit_defaults=True,
                                gc=False, tag=True)
    batch = msgspec.defstruct("KVEventBatch", [
        ("ts", float),
        ("events", list[stored | removed | cleared]),
        ("attn_dp_rank", int | None, None),
    ], array_like=True, gc=False)
    return {"BlockStored": stored, "BlockRemoved": removed, "AllBlocksCleared": cleared,
            "KVEventBatch": batch}


def decoder() -> Any:
    import msgspec

    return msgspec.msgpack.Decoder(structs()["KVEventBatch"])


# --- the subscriber ------------------------------------------------------------------------


def free_port_range(count: int = 1, host: str = "127.0.0.1") -> int:
    """A base port with `count` consecutive ports free on this node (the publishers of
    attention-DP ranks bind base + rank)."""
    for _ in range(64):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + count - 1 > 65535:
            continue
        ok = True
        for p in range(base + 1, base + count):
            with socket.socket() as s:
                try:
                    s.bind((host, p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


class KVEventSubscriber:
    """A daemon thread: ZMQ SUB connected to `endpoints` (SGLang's PUB sockets), every
    `KVEventBatch` decoded and applied to `translator`. A gap in a publisher's sequence numbers
    (ZMQ drops beyond its high-water mark, a late start) or an undecodable batch marks the
    stream lost. `start()` raises ImportError without pyzmq/msgspec."""

    def __init__(self, translator: KVEventTranslator, endpoints: Sequence[str],
                 topic: str = "") -> None:
        self.translator = translator
        self.endpoints = list(endpoints)
        self.topic = topic
        self.batches = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: dict[int, int] = {}  # publisher (attention-DP rank) -> last sequence

    def start(self) -> KVEventSubscriber:
        import zmq  # noqa: F401 (fail here, not in the thread, when missing)

        self._decoder = decoder()
        self._thread = threading.Thread(target=self._run, daemon=True, name="sglang-kv-events")
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def handle(self, seq_bytes: bytes, payload: bytes) -> None:
        """One message (sequence frame, payload frame)."""
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        try:
            batch = self._decoder.decode(payload)
        except Exception as exc:
            self.translator.mark_lost(f"undecodable batch {seq}: {exc}")
            return
        rank = int(batch.attn_dp_rank or 0)
        last = self._last.get(rank)
        if (last is None and seq != 0) or (last is not None and seq != last + 1):
            self.translator.mark_lost(f"rank {rank}: batch {seq} after {last}")
        self._last[rank] = seq
        self.batches += 1
        self.translator.apply(batch.events, rank)

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        try:
            for endpoint in self.endpoints:
                sock.connect(endpoint)
            sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            while not self._stop.is_set():
                if not sock.poll(200):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 3:
                    continue
                try:
                    self.handle(frames[1], frames[2])
                except Exception:  # never let one bad batch end the thread
                    logger.exception("SGLang KV event batch failed")
                    self.translator.mark_lost("a batch failed to apply")
        except Exception:
            logger.exception("SGLang KV event subscriber stopped")
        finally:
            sock.close(linger=0)


def start_subscriber(block_size: int, endpoints: Sequence[str],
                     topic: str = "") -> KVEventSubscriber | None:
    """The translator and its subscriber thread, or None (a logged warning) without pyzmq or
    msgspec: the engine then serves without KV events."""
    try:
        return KVEventSubscriber(KVEventTranslator(block_size), endpoints, topic).start()
    except ImportError as exc:
        logger.warning("SGLang KV events not followed (%s): the router's prefix index is fed by "
                       "its own dispatch guesses only", exc)
        return None
