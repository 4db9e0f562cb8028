"""The reference engine serves image prompts exactly: a random tiny K3 with a random tiny
MoonViT-V2 tower (models/moonvit.py) in one checkpoint folder, as the builder loads it.

- the engine's tokens equal the plain model's (K3Model with the features spliced into
  inputs_embeds, then greedy decode), however the prefill is chunked (a chunk cutting an image)
  and batched (two requests' images in one prefill forward); the tower runs once per request;
- an engine without a tower refuses images, and bad images are refused at admission;
- speculation (a DSpark draft) is lossless with images: greedy tokens equal speculation off,
  and seeded sampling is exact (the chi-square test of the 2nd token against enumerated
  marginals);
- the prefix cache keys pad runs on pixels: the same text with another image shares nothing
  past the image, the same image resent hits and answers as a cold run; the KV events carry
  the router's hashes of `cache_keys`;
- a PD hand-over of an image prompt decodes as the aggregated engine does; TP 2 gives TP 1's
  tokens.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from spec_helpers import (
    WRONG_RULE_SAMPLES,
    chi2_pvalue,
    engine_from,
    run_tensor_parallel,
)
from tiny_models import (
    K3_BOS,
    tiny_k3_config,
    write_k3_format_pair,
    write_random_k3_pair,
    write_random_vision,
)

from serve_app.config import ReferenceEngineConfig, SpeculationConfig
from serve_app.engines.reference.engine import EngineCore
from serve_app.engines.reference.sampling import SamplingParams, target_probs
from serve_app.models.k3 import K3State
from serve_app.models.k3_weights import load_k3
from serve_app.models.moonvit import load_k3_vision
from serve_app.protocol.media import ImageInput, cache_keys
from serve_app.routing.prefix_index import block_hashes
from serve_app.vision import MediaConfig, normalise

VOCAB = 64
PAD = VOCAB - 1  # the tiny config's media placeholder id (<|media_pad|>)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def write_seeing_pair(folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """A random tiny K3 target with a random tiny tower and projector in its folder, and a
    DSpark draft."""
    target, draft = write_random_k3_pair(folder, tiny_k3_config(VOCAB), seed)
    write_random_vision(target, seed)
    return target, draft


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_seeing_pair(tmp_path_factory.mktemp("seeing"))


@pytest.fixture(scope="module")
def text_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_random_k3_pair(tmp_path_factory.mktemp("blind"), tiny_k3_config(VOCAB))


def image(seed: int, h: int = 4, w: int = 6, offset: int = 0) -> ImageInput:
    """A random image of grid (1, h, w) patches whose pad run starts at `offset`."""
    patches = np.random.default_rng(seed).integers(0, 256, (h * w, 3, 14, 14), dtype=np.uint8)
    digest = hashlib.sha256(patches.tobytes()).hexdigest()
    return ImageInput(digest, w * 14, h * 14, (1, h, w), offset, h * w // 4, patches, b"")


def image_prompt(text_before: list[int], images: list[ImageInput], text_after: list[int]
                 ) -> tuple[list[int], tuple[ImageInput, ...]]:
    """`text_before`, each image's pad run (with a token between images), `text_after`; the
    images placed at their runs."""
    ids, placed = list(text_before), []
    for n, img in enumerate(images):
        if n:
            ids.append(5)
        placed.append(ImageInput(img.digest, img.width, img.height, img.grid_thw, len(ids),
                                 img.tokens, img.patches, img.png))
        ids += [PAD] * img.tokens
    return ids + text_after, tuple(placed)


def text(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB - 2, (n,), generator=torch.Generator().manual_seed(seed)
                         ).tolist()


def engine(pair: tuple[Path, Path], draft: bool = False, **settings: Any) -> EngineCore:
    spec = settings.pop("spec", {"enabled": draft})
    return engine_from(pair, draft=draft, engine=settings, **spec)


def run(eng: EngineCore, requests: list[tuple[list[int], tuple[ImageInput, ...]]],
        params: SamplingParams = GREEDY) -> list[Any]:
    """Every request added at once, run to the end: their final outputs, tokens whole."""
    rids = [eng.add_request(ids, params, images=imgs) for ids, imgs in requests]
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    final: dict[str, Any] = {}
    while len(final) < len(rids):
        for out in eng.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                out.token_ids = tokens[out.request_id]
                final[out.request_id] = out
    return [final[r] for r in rids]


@torch.no_grad()
def oracle(pair: tuple[Path, Path], ids: list[int], images: tuple[ImageInput, ...],
           n: int) -> list[int]:
    """The plain model: the prompt's embeddings with each image's features over its pad run
    (the tower on the whole image, normalised by the folder's media config), then greedy decode."""
    model = load_k3(pair[0]).eval()
    tower = load_k3_vision(pair[0])
    assert tower is not None
    embeds = model.model.embed_tokens(torch.tensor([ids]))
    for img in images:
        pixels = normalise(img.patches, MediaConfig.from_folder(pair[0]))
        embeds[0, img.offset:img.offset + img.tokens] = tower(pixels, [img.grid_thw])
    h, state, _ = model.model(torch.tensor([ids]), K3State(), inputs_embeds=embeds)
    out = [int(model.logits(h)[0, -1].argmax())]
    while len(out) < n:
        logits, state = model(torch.tensor([[out[-1]]]), state)
        out.append(int(logits[0, -1].argmax()))
    return out


def two_image_prompt() -> tuple[list[int], tuple[ImageInput, ...]]:
    return image_prompt(text(7, 1), [image(1), image(2, 2, 4)], text(5, 2))


def test_the_engine_gives_the_plain_models_tokens(pair: tuple[Path, Path]) -> None:
    ids, images = two_image_prompt()
    want = oracle(pair, ids, images, GREEDY.max_tokens)
    eng = engine(pair)
    (out,) = run(eng, [(ids, images)])
    assert out.token_ids == want
    # The features matter: the same ids with other pixels answer otherwise.
    other = tuple(ImageInput(i.digest[::-1], i.width, i.height, i.grid_thw, i.offset, i.tokens,
                             255 - i.patches, b"") for i in images)
    assert oracle(pair, ids, other, GREEDY.max_tokens) != want
    assert eng.runner.images is not None and not eng.runner.images.any([out.request_id])


@pytest.mark.parametrize("chunk", [3, 5, 64])
def test_chunks_that_cut_an_image_and_batched_rows_give_the_same_tokens(
        pair: tuple[Path, Path], chunk: int) -> None:
    first = two_image_prompt()
    second = image_prompt(text(3, 3), [image(3, 2, 2)], text(9, 4))
    third = (text(12, 5), ())  # a text prompt in the same batch
    want = [oracle(pair, ids, imgs, GREEDY.max_tokens) for ids, imgs in (first, second, third)]
    eng = engine(pair, prefill_chunk_tokens=chunk * 3, max_prefill_tokens_per_request=chunk)
    outs = run(eng, [first, second, third])
    assert [o.token_ids for o in outs] == want
    images = eng.runner.images
    assert images is not None and images.tower_calls == 2  # once per image request
    assert not images._pending  # features dropped once their prefill passed them


def test_an_engine_without_a_tower_refuses_images(text_pair: tuple[Path, Path]) -> None:
    ids, images = two_image_prompt()
    eng = engine(text_pair)
    assert eng.runner.images is None
    with pytest.raises(ValueError, match="no vision tower"):
        eng.add_request(ids, GREEDY, images=images)
    assert not eng.has_work


@pytest.mark.parametrize("bad,match", [
    (lambda i: ImageInput(i.digest, 1, 1, i.grid_thw, 2, i.tokens, i.patches, b""),
     "not inside the prompt"),
    (lambda i: ImageInput(i.digest, 1, 1, i.grid_thw, i.offset, i.tokens, i.patches[1:], b""),
     "patches"),
    (lambda i: ImageInput(i.digest, 1, 1, (1, 2, 12), i.offset, i.tokens, i.patches, b""),
     "pad tokens|patches"),
    (lambda i: ImageInput(i.digest, 1, 1, (2, 2, 6), i.offset, i.tokens, i.patches, b""),
     "still image"),
])
def test_bad_images_are_refused_at_admission(pair: tuple[Path, Path], bad: Any,
                                             match: str) -> None:
    ids, images = two_image_prompt()
    eng = engine(pair)
    with pytest.raises(ValueError, match=match):
        eng.add_request(ids, GREEDY, images=(images[0], bad(images[1])))
    assert not eng.has_work


def test_speculation_is_lossless_with_images(pair: tuple[Path, Path]) -> None:
    requests = [two_image_prompt(), image_prompt(text(2, 6), [image(4, 4, 4)], text(4, 7))]
    plain = run(engine(pair), requests)
    for rollback in ("scratch", "replay"):
        spec = run(engine(pair, draft=True, spec={"kda_rollback": rollback}), requests)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        assert all(o.spec["spec_verify_ct"] > 0 for o in spec)


@torch.no_grad()
def image_marginal(pair: tuple[Path, Path], ids: list[int], images: tuple[ImageInput, ...],
                   params: SamplingParams) -> torch.Tensor:
    """P(2nd token) of the plain model, by enumerating every first token."""
    model = load_k3(pair[0]).eval()
    tower = load_k3_vision(pair[0])
    assert tower is not None
    embeds = model.model.embed_tokens(torch.tensor([ids]))
    for img in images:
        embeds[0, img.offset:img.offset + img.tokens] = tower(
            normalise(img.patches, MediaConfig.from_folder(pair[0])), [img.grid_thw])
    h, _, _ = model.model(torch.tensor([ids]), K3State(), inputs_embeds=embeds)
    p1 = target_probs(model.logits(h)[:, -1], params)[0]
    v = model.config.vocab_size
    firsts = torch.arange(v)[:, None]
    both = torch.cat([embeds.expand(v, -1, -1), model.model.embed_tokens(firsts)], dim=1)
    h, _, _ = model.model(torch.cat([torch.tensor([ids]).expand(v, -1), firsts], dim=1),
                          K3State(), inputs_embeds=both)
    return p1 @ target_probs(model.logits(h)[:, -1], params)


def test_sampled_verification_with_images_is_exact(pair: tuple[Path, Path]) -> None:
    ids, images = image_prompt(text(3, 8), [image(5, 2, 4)], text(2, 9))
    params = SamplingParams(temperature=0.9, max_tokens=3, ignore_eos=True)
    p2 = image_marginal(pair, ids, images, params)
    eng = engine(pair, draft=True, max_batch_size=64, kv_capacity_tokens=64 * 32)
    seconds = []
    for start in range(0, 3000, 500):
        plist = [SamplingParams(**{**params.__dict__, "seed": start + i}) for i in range(500)]
        rids = [eng.add_request(ids, p, images=images) for p in plist]
        got: dict[str, list[int]] = {r: [] for r in rids}
        while eng.has_work:
            for out in eng.step():
                got[out.request_id] += out.token_ids
        seconds += [got[r][1] for r in rids]
    assert eng.totals.spec.proposed_drafts > 0
    assert chi2_pvalue(seconds, p2) > 1e-3
    # The test can fail: the same samples against the first token's marginal do not pass.
    assert chi2_pvalue(seconds[:WRONG_RULE_SAMPLES], p2.roll(1)) < 1e-6


PAGE = 16
CACHED = {"prefill_chunk_tokens": PAGE, "max_prefill_tokens_per_request": PAGE,
          "prefix_cache": {"enabled": True, "snapshot_interval": PAGE,
                           "decode_snapshot_interval": PAGE}}


def tree_keys(eng: EngineCore) -> set[tuple[int, ...]]:
    assert eng.runner.prefix is not None
    return {n.key for n in eng.runner.prefix.nodes()}


def pages_of(keys: list[int]) -> set[tuple[int, ...]]:
    return {tuple(keys[i:i + PAGE]) for i in range(0, len(keys) - PAGE + 1, PAGE)}


def test_the_prefix_cache_keys_image_positions_on_pixels(pair: tuple[Path, Path]) -> None:
    """Pages: [0, 16) text, [16, 32) text and the image's first 12 pads, [32, 48) its last 4
    and text. Another image with the same text hits only the first page; the same image
    resent hits past it and answers as a cold run; a prompt that shares the image and not
    what follows restarts inside the image (the snapshot at 32), and the tower runs again."""
    before, after = text(20, 10), text(30, 11)
    first = image_prompt(before, [image(6, 4, 16)], after)
    other = image_prompt(before, [image(7, 4, 16)], after)
    branch = image_prompt(before, [image(6, 4, 16)], text(30, 12))
    assert first[0] == other[0] and first[1][0].offset == 20 and first[1][0].tokens == 16
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    eng = engine(pair, **CACHED)
    images = eng.runner.images
    assert images is not None
    outs = {}
    for name, request in (("first", first), ("other", other), ("resent", first),
                          ("branch", branch)):
        (outs[name],) = run(eng, [request], params)
    assert outs["other"].cached_tokens == PAGE  # nothing past the image's start
    assert outs["resent"].cached_tokens == 64  # every full page of the prompt
    assert outs["branch"].cached_tokens == 32  # inside the image: its last 4 rows spliced
    assert images.tower_calls == 3  # the resent prompt's image was wholly cached
    for name, (ids, imgs) in (("first", first), ("other", other), ("resent", first),
                              ("branch", branch)):
        assert outs[name].token_ids == oracle(pair, ids, imgs, params.max_tokens), name
    # The tree holds pages of cache keys (the pads keyed on pixels), the answers' decode
    # snapshots included; no page of the raw ids that holds the image's pads.
    keys = [cache_keys(ids, imgs) + outs[n].token_ids
            for n, (ids, imgs) in (("first", first), ("other", other), ("branch", branch))]
    held = tree_keys(eng)
    assert held <= set().union(*map(pages_of, keys))
    assert not held & (pages_of(first[0][:48]) - pages_of(first[0][:PAGE]))  # raw pad pages
    assert pages_of(keys[0][:64]) <= held  # its decode snapshot at 64 donated its pages
    # The KV events carry the router's hashes of the cache keys.
    _, events, _ = eng.runner.prefix.events_since(0)
    stored = {h for e in events if e["type"] == "stored" for h in e["block_hashes"]}
    assert set(block_hashes(keys[0][:64], PAGE)) <= stored
    assert not set(block_hashes(first[0], PAGE)[1:]) & stored


def test_a_pd_handover_of_an_image_prompt_decodes_as_aggregated(pair: tuple[Path, Path]) -> None:
    request = two_image_prompt()
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    (want,) = run(engine(pair, draft=True), [request], params)
    prefill, decode = engine(pair, draft=True, **CACHED), engine(pair, draft=True, **CACHED)
    rid = prefill.add_request(request[0], params, hand_off=True, images=request[1])
    while not any(o.prefilled for o in prefill.step() if o.request_id == rid):
        pass
    handoff = prefill.export(rid)
    # The descriptors travel (the decode side keys its cache on them), the pixels do not.
    assert [i.key for i in handoff.images] == [i.key for i in request[1]]
    assert all(i.patches is None and i.png == b"" for i in handoff.images)
    decode.adopt(handoff)
    tokens: list[int] = []  # its first output carries the prefill side's token
    while decode.has_work:
        for out in decode.step():
            tokens += out.token_ids
    assert tokens == want.token_ids
    # Its decode snapshots are keyed as the prefill side keys the prompt.
    keys = cache_keys(*request) + tokens
    assert tree_keys(decode) and tree_keys(decode) <= pages_of(keys)


def _tp_job(eng: EngineCore, requests: list[tuple[list[int], tuple[ImageInput, ...]]]
            ) -> list[list[int]]:
    outs = run(eng, requests)
    return [o.token_ids for o in outs]


def test_tp2_gives_tp1_tokens(pair: tuple[Path, Path]) -> None:
    requests = [two_image_prompt(), image_prompt(text(3, 3), [image(3, 2, 2)], text(9, 4))]
    settings = {"kv_capacity_tokens": 4096, "prefill_chunk_tokens": 15,
                "max_prefill_tokens_per_request": 5}
    tp1 = _tp_job(engine(pair, draft=True, **settings), requests)
    cfg = ReferenceEngineConfig(**settings, speculation=SpeculationConfig(enabled=True))
    assert run_tensor_parallel(pair, cfg, 2, _tp_job, (requests,)) == tp1


def test_the_k3_format_pair_sees_with_k3s_media_ids(tmp_path: Path) -> None:
    """tools/k3_format_deployment.py's checkpoint (K3's vocabulary, a random tiny tower, K3's
    preprocessor_config.json): an image prompt in K3's media ids, spliced as the plain model
    splices it."""
    paths = write_k3_format_pair(tmp_path)
    pair = (paths["target"], paths["draft"])
    begin, content, end, pad = 163602, 163603, 163604, 163605
    img = image(8, 4, 4, offset=4)
    ids = [K3_BOS, 1000, begin, content, *[pad] * img.tokens, end, 2000]
    want = oracle(pair, ids, (img,), GREEDY.max_tokens)
    (out,) = run(engine(pair, draft=True), [(ids, (img,))])
    assert out.token_ids == want
