"""Train the embedded target to see: a tiny MoonViT-V2 tower and patchmergerv2 projector (K3's
structure, `models/moonvit.py`) together with the text model, on synthetic images
(`serve_app/synthetic_images.py`), in two stages: the tower alone with a linear probe
(`train_tower`: a ViT learns shapes slowly, and through the text model it did not learn them at
all), then the tower, projector and text model together.

The text model learns too. Frozen, it could not answer even with the answer written into its
prompt ("What colour is ...? The answer is orange." -> 0 of 40 colour and shape questions
right at K3's sampling parameters, thinking or not: it was trained on code and continues
code), and a tower trained against it for 17 minutes left every held-out answer wrong; a
stage-2 VLM recipe (LLaVA's: the language model unfrozen) is what teaches it the task. To keep
its text, every step also replays its own training stream (`encode_documents`, the target's
seed) at REPLAY_WEIGHT, and its held-out perplexity is measured before and after. The draft,
trained before this stage (`all`: target, draft, vision), is left as it is: any draft is
lossless, and `evaluate` measures its acceptance against the target that ships.

A training example is exactly what the server feeds the target for a chat
request with one image: K3's rendering of a user message whose content is the question and
then the image (`<|media_begin|>image 84x84<|media_content|>` + 9 x `<|media_pad|>` +
`<|media_end|>`), then K3's generation prompt; the completion is the assistant message whose
answer is one word (thinking: an empty think channel, then the response). The image's features
replace the pad positions' embeddings (`inputs_embeds`), and the loss is the text model's
cross-entropy on the completion's tokens.

What is measured is what ships: the bf16 text model and tower loaded from the folder,
answering held-out images (another seed's stream) at K3's sampling parameters (thinking: T 1.0,
instant: T 0.6; top_p 0.95), the answer read from the response channel.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from PIL import Image

from serve_app.chat.parameters import K3_TEMPERATURE, K3_TOP_P
from serve_app.chat.segments import MEDIA_PAD, Segment, encode_prompt, encode_segments
from serve_app.chat.xtml_render import (
    END_OF_MSG,
    Message,
    RenderOptions,
    assistant_completion,
    render,
)
from serve_app.engines.reference.sampling import SamplingParams, target_probs
from serve_app.models.k3 import K3ForCausalLM, K3State
from serve_app.models.k3_weights import load_k3, save_k3
from serve_app.models.moonvit import (
    K3Vision,
    VisionConfig,
    load_k3_vision,
    merged_tokens,
    save_k3_vision,
    vision_params,
)
from serve_app.protocol.openai import ImagePart
from serve_app.synthetic_images import (
    COLOURS,
    DIGITS,
    IMAGE_SIZE,
    KINDS,
    QUESTIONS,
    SHAPES,
    WORDS,
    SyntheticExample,
    examples,
    heldout_examples,
)
from serve_app.tokenizer import HFTokenizer
from serve_app.training.common import (
    Progress,
    ThreadTuner,
    cosine_lr,
    encode_documents,
    optimizer_step,
    random_windows,
    running_mean,
    seed_everything,
)
from serve_app.training.corpus import SourceFile
from serve_app.training.train_target import (
    ASSET_SHARD_BYTES,
    heldout_perplexity,
    heldout_windows,
    lm_loss,
    to_storage_dtype,
)
from serve_app.vision import MediaConfig, normalise
from serve_app.vision.preprocess import preprocess

# K3's config.json key (its value there: "<|kimi_image_placeholder|>"; a string the renderer
# replaces with the next image prompt, not a token of K3's vocabulary).
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"

# The target's preprocessor_config.json: K3's `media_proc_cfg` keys. K3's resize rule, its
# normalisation and transparency fill; limits sized for the mini (at most 256 patches = 64
# image tokens, 32 patches a side), not K3's 65,536 / 512.
MEDIA_PROC_CFG: dict[str, Any] = {
    "patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 256,
    "patch_limit_on_one_side": 32, "fixed_output_tokens": None,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8,
                              "chessboard_white_value": 255, "chessboard_gray_value": 180,
                              "chessboard_square_on_top_left": True},
    "transparent_bg_fill_stage": "after_resize",
    "in_patch_limit_each_frame": 256, "sample_fps": 8.0, "temporal_merge_kernel_size": 4,
}
MEDIA = MediaConfig.from_dict(MEDIA_PROC_CFG)


def mini_vision_config(text_hidden_size: int) -> VisionConfig:
    """K3's vision_config with its structure (divided_fixed position table, bilinear, 2D RoPE,
    rmsnorm, mlp2 + gelu_tanh, sd2_tpool 2x2, patchmergerv2) at ~0.5M parameters: 3 blocks of
    width 96 (3 heads of 32), an 8x8 position table (an 84-pixel image is a 6x6 grid)."""
    return VisionConfig.from_dict({
        "patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8,
        "init_pos_emb_time": 4, "vt_hidden_size": 96, "vt_num_hidden_layers": 3,
        "vt_num_attention_heads": 3, "qkv_hidden_size": 96, "vt_intermediate_size": 256,
        "text_hidden_size": text_hidden_size, "pos_emb_type": "divided_fixed",
        "pos_emb_interpolation_mode": "bilinear", "norm_type": "rmsnorm", "mlp_type": "mlp2",
        "activation_func": "gelu_pytorch_tanh", "merge_type": "sd2_tpool",
        "merge_kernel_size": [2, 2], "mm_projector_type": "patchmergerv2",
        "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5, "attn_bias": False,
        "linear_bias": False, "patch_embed_proj_bias": False,
    })


def patchify(img: Image.Image) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """An image as the served tower sees it (serve_app/vision: K3's resize, pad and patch
    order, then its normalisation) -> normalised patches [h*w, 3, 14, 14], and its grid_thw."""
    grid, _, patches = preprocess(img, MEDIA)
    return normalise(patches, MEDIA), grid


class ImageSize(NamedTuple):
    """What K3's image prompt needs of an image (chat.segments.SizedImage)."""

    width: int
    height: int
    tokens: int


def prompt_segments(question: str, thinking: bool) -> list[Segment]:
    """K3's rendering of a one-turn chat whose user content is [question, image] (the OpenAI
    parts in that order, `synthetic_images.user_content`), as the ingress renders it."""
    return render([Message("user", (question, _IMAGE_PART))], RenderOptions(thinking=thinking))


# The image part of the rendered user message: only its place matters (its pixels reach the
# model as features, its size as `ImageSize`).
_IMAGE_PART = ImagePart("messages[0].content[1]", "")


@dataclass(frozen=True)
class Encoded:
    prefix: list[int]  # ids shared by every prompt of this mode (before the question)
    prompt: list[int]  # the rest of the prompt
    completion: list[int]
    answer: tuple[int, int]  # the answer word's tokens: completion[answer[0]:answer[1]]


class PromptCache:
    """Token ids per (kind, thinking) prompt and per (answer, thinking) completion."""

    def __init__(self, tok: HFTokenizer, tokens_per_image: int) -> None:
        self.tok, self.n = tok, tokens_per_image
        self.pad_id = tok.special_ids[MEDIA_PAD]
        self.end_id = tok.special_ids[END_OF_MSG]
        self._prompts: dict[tuple[str, bool], list[int]] = {}
        self._completions: dict[tuple[str, bool], tuple[list[int], tuple[int, int]]] = {}
        self.prefix = {t: self._common_prefix(t) for t in (False, True)}

    def _common_prefix(self, thinking: bool) -> list[int]:
        ids = [self.prompt_ids(q, thinking) for q in QUESTIONS.values()]
        n = 0
        while all(len(i) > n and i[n] == ids[0][n] for i in ids):
            n += 1
        return ids[0][:n]

    def prompt_ids(self, question: str, thinking: bool) -> list[int]:
        key = (question, thinking)
        if key not in self._prompts:
            self._prompts[key], _ = encode_prompt(self.tok, prompt_segments(question, thinking),
                                                  [ImageSize(IMAGE_SIZE, IMAGE_SIZE, self.n)])
        return self._prompts[key]

    def completion_ids(self, answer: str, thinking: bool) -> tuple[list[int], tuple[int, int]]:
        """The completion's ids and where the answer word's tokens lie in them (segments
        encode one by one, so the word's ids are those of its own segment)."""
        key = (answer, thinking)
        if key not in self._completions:
            segs = assistant_completion(Message("assistant", (answer,)), thinking)
            at = next(i for i, s in enumerate(segs) if not s.control and s.text == answer)
            start = len(encode_segments(self.tok, segs[:at]))
            span = (start, start + len(encode_segments(self.tok, [segs[at]])))
            self._completions[key] = (encode_segments(self.tok, segs), span)
        return self._completions[key]

    def encoded(self, ex: SyntheticExample, thinking: bool) -> Encoded:
        full, pre = self.prompt_ids(ex.question, thinking), self.prefix[thinking]
        completion, span = self.completion_ids(ex.answer, thinking)
        return Encoded(pre, full[len(pre):], completion, span)


class TargetRunner:
    """The text model on image prompts, with the state of the prompt prefix every prompt of a
    mode shares computed once per batch size (it holds no image; no gradient passes through
    it). `forget_prefix` after the text model's weights change."""

    def __init__(self, lm: K3ForCausalLM, cache: PromptCache) -> None:
        self.lm, self.cache = lm, cache
        self._states: dict[tuple[bool, int], K3State] = {}

    def forget_prefix(self) -> None:
        self._states.clear()

    def prefix_state(self, thinking: bool, batch: int) -> K3State:
        key = (thinking, batch)
        if key not in self._states:
            ids = torch.tensor([self.cache.prefix[thinking]] * batch)
            with torch.no_grad():
                _, state = self.lm(ids)
            self._states[key] = state
        return self._states[key]

    def embeds(self, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The token embeddings of ids [B, T] with the image features, in order, at the
        `<|media_pad|>` positions (B images of n features each, concatenated)."""
        emb = self.lm.model.embed_tokens(ids)
        at = ids == self.cache.pad_id
        if int(at.sum()) != features.shape[0]:
            raise ValueError(f"{int(at.sum())} pad positions for {features.shape[0]} features")
        emb = emb.clone()
        emb[at] = features.to(emb.dtype)
        return emb

    def run(self, ids: torch.Tensor, features: torch.Tensor, thinking: bool
            ) -> tuple[torch.Tensor, K3State]:
        """(logits [B, T, V] of ids after the shared prefix, the state after them)."""
        state = self.prefix_state(thinking, ids.shape[0])
        h, new_state, _ = self.lm.model(ids, state, inputs_embeds=self.embeds(ids, features))
        assert isinstance(new_state, K3State)
        return self.lm.logits(h), new_state


def image_batch(exs: Sequence[SyntheticExample]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    parts = [patchify(e.image) for e in exs]
    return torch.cat([p for p, _ in parts]), [g for _, g in parts]


# The completion's other tokens (the channel tags, the end of the message) weigh this much
# against the answer word's: the text model predicts them almost alone, and at equal weight
# they hid a word the tower had not learned (a loss of ~1 while every answer was wrong).
STRUCTURE_WEIGHT = 0.2
PROJECTOR_LR_SCALE = 10 / 3


_ATTRIBUTES = {"colour": tuple(COLOURS), "shape": SHAPES, "digit": DIGITS, "word": WORDS}


class AttributeProbe(torch.nn.Module):
    """Training scaffolding, not saved: linear classifiers of what an image shows (its colour
    and shape, its digit, its word) from the tower's merged output averaged over the image.
    Through the text model the tower's gradient is faint (with it frozen, a first run's answers'
    loss fell from ~7 to only ~4.5-6.5 per token in 530 steps); the probe's cross-entropy gives it a
    direct one, so the tower learns what to see while the projector learns how to say it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleDict({name: torch.nn.Linear(width, len(values))
                                          for name, values in _ATTRIBUTES.items()})

    def logits(self, merged: torch.Tensor, exs: Sequence[SyntheticExample]
               ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per attribute the images show: (each head's logits for those images, their labels),
        from the merged output averaged over each image."""
        pooled = merged.view(len(exs), -1, merged.shape[-1]).mean(1)
        out = {}
        for name, values in _ATTRIBUTES.items():
            rows = [(i, values.index(dict(e.attributes)[name])) for i, e in enumerate(exs)
                    if name in dict(e.attributes)]
            if rows:
                at = torch.tensor([i for i, _ in rows])
                out[name] = (self.heads[name](pooled[at]), torch.tensor([c for _, c in rows]))
        return out

    def loss(self, merged: torch.Tensor, exs: Sequence[SyntheticExample]) -> torch.Tensor:
        return sum((F.cross_entropy(logits, labels)
                    for logits, labels in self.logits(merged, exs).values()),
                   merged.new_zeros(()))

    @torch.no_grad()
    def accuracy(self, vision: K3Vision, exs: Sequence[SyntheticExample]) -> dict[str, float]:
        """Each head's held-out accuracy (what the tower makes linearly readable)."""
        pixels, grids = image_batch(exs)
        heads = self.logits(vision.vision_tower(pixels, grids), exs)
        return {name: round(float((logits.argmax(-1) == labels).float().mean()), 4)
                for name, (logits, labels) in heads.items()}


# The tower's own stage, before the text model joins: the tower and the probe alone on shape
# images (each carries its colour too), TOWER_BATCH a step at TOWER_LR, for TOWER_SHARE of the
# loop budget. The shape is what a ViT learns slowly: with the text model in the loop a 905-step
# run left held-out shapes at chance (22% / 12%), and the probe on all four kinds at once was at
# 39% after 1,750 steps of 64, while shape images alone took off after ~1,200 steps and reached
# 95% in 5 minutes (3,134 steps). Digits and words are left to the joint stage.
TOWER_SHARE = 0.25
TOWER_BATCH = 64
TOWER_LR = 1e-3
TOWER_KINDS = ("shape",)


def train_tower(vision: K3Vision, probe: AttributeProbe, seed: int, budget_s: float,
                max_steps: int | None, heldout: Sequence[SyntheticExample]
                ) -> dict[str, Any]:
    """The tower stage; its record (steps, images, the probe's held-out accuracy after)."""
    params = [*vision.vision_tower.parameters(), *probe.parameters()]
    opt = torch.optim.AdamW(params, lr=TOWER_LR, betas=(0.9, 0.98), weight_decay=0.01)
    rng = random.Random(seed ^ 0x70E5)
    progress = Progress("tower", budget_s, max_steps=max_steps)
    vision.train()
    step, ema = 0, float("nan")
    t0 = time.monotonic()
    while not progress.finished(step):
        lr = cosine_lr(progress.share(step), step, TOWER_LR, warmup=min(50, max_steps or 50))
        for g in opt.param_groups:
            g["lr"] = lr
        exs = examples(rng.randrange(2**31), TOWER_BATCH, TOWER_KINDS)
        pixels, grids = image_batch(exs)
        loss = probe.loss(vision.vision_tower(pixels, grids), exs)
        optimizer_step(opt, loss, params)
        step += 1
        ema = running_mean(ema, float(loss.detach()))
        progress.update(step=step, loss=ema, lr=lr)
    progress.update(force=True, step=step, loss=ema)
    vision.eval()
    accuracy = probe.accuracy(vision, heldout)
    print(f"tower: {step} steps; the probe's held-out accuracy {accuracy}", flush=True)
    return {"steps": step, "images": step * TOWER_BATCH, "batch": TOWER_BATCH, "lr": TOWER_LR,
            "kinds": list(TOWER_KINDS), "wall_s": round(time.monotonic() - t0, 1),
            "loss_ema": round(ema, 4), "probe_heldout_accuracy": accuracy}


def vision_loss(target: TargetRunner, vision: K3Vision, exs: Sequence[SyntheticExample],
                thinking: bool, probe: AttributeProbe | None = None
                ) -> tuple[torch.Tensor, list[float]]:
    """Per example, the mean cross-entropy of the answer word's tokens plus STRUCTURE_WEIGHT x
    that of the completion's other tokens; the batch's mean (plus the probe's loss, if given),
    and each example's answer cross-entropy."""
    enc = [target.cache.encoded(e, thinking) for e in exs]
    seqs = [e.prompt + e.completion for e in enc]
    length = max(map(len, seqs))
    pad = target.cache.tok.pad_token_id
    # Right-padded: the model is causal, so what follows a sequence never reaches its tokens.
    ids = torch.tensor([s + [pad] * (length - len(s)) for s in seqs])
    # Position t predicts token t + 1: the completion's token j is predicted at
    # len(prompt) - 1 + j.
    word = torch.zeros(len(exs), length - 1)
    rest = torch.zeros(len(exs), length - 1)
    for i, e in enumerate(enc):
        first = len(e.prompt) - 1
        rest[i, first:first + len(e.completion)] = 1.0
        word[i, first + e.answer[0]:first + e.answer[1]] = 1.0
    rest -= word
    pixels, grids = image_batch(exs)
    merged = vision.vision_tower(pixels, grids)
    logits, _ = target.run(ids[:, :-1], vision.mm_projector(merged), thinking)
    ce = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    answer_ce = (ce * word).sum(1) / word.sum(1)
    per = answer_ce + STRUCTURE_WEIGHT * (ce * rest).sum(1) / rest.sum(1)
    loss = per.mean() + (probe.loss(merged, exs) if probe is not None else 0.0)
    return loss, answer_ce.detach().tolist()


def response_text(tok: HFTokenizer, ids: Sequence[int], thinking: bool) -> str:
    """The response channel's text of a completion (what the server returns as content)."""
    text = tok.decode(list(ids), skip_special_tokens=False)
    opened = "<|open|>response<|sep|>"
    if thinking:
        at = text.find(opened)
        if at < 0:
            return ""
        text = text[at + len(opened):]
    end = text.find("<|close|>")
    return text if end < 0 else text[:end]


def is_correct(answer: str, response: str) -> bool:
    return response.strip().rstrip(".").strip().lower() == answer.lower()


@torch.no_grad()
def answer_accuracy(target: TargetRunner, vision: K3Vision, exs: Sequence[SyntheticExample],
                    thinking: bool, seed: int, max_new_tokens: int = 32,
                    batch: int = 25) -> dict[str, Any]:
    """Each held-out question answered at K3's sampling parameters for the mode (thinking:
    T 1.0, instant: T 0.6; top_p 0.95), one seeded generator; accuracy per kind."""
    params = SamplingParams(temperature=K3_TEMPERATURE[thinking], top_p=K3_TOP_P)
    gen = torch.Generator().manual_seed(seed)
    tok, end = target.cache.tok, target.cache.end_id
    right: dict[str, int] = dict.fromkeys(KINDS, 0)
    total: dict[str, int] = dict.fromkeys(KINDS, 0)
    samples: list[dict[str, str]] = []
    by_kind: dict[str, list[SyntheticExample]] = {}
    for e in exs:
        by_kind.setdefault(e.kind, []).append(e)
    for kind, group in by_kind.items():
        for start in range(0, len(group), batch):
            chunk = group[start:start + batch]
            ids = torch.tensor([target.cache.encoded(e, thinking).prompt for e in chunk])
            pixels, grids = image_batch(chunk)
            logits, state = target.run(ids, vision(pixels, grids), thinking)
            last = logits[:, -1]
            out: list[list[int]] = [[] for _ in chunk]
            done = [False] * len(chunk)
            for _ in range(max_new_tokens):
                probs = target_probs(last, params)
                nxt = torch.multinomial(probs, 1, generator=gen)
                for i, t in enumerate(nxt[:, 0].tolist()):
                    if not done[i]:
                        out[i].append(t)
                        done[i] = t == end
                if all(done):
                    break
                step, state = target.lm(nxt, state)
                last = step[:, -1]
            for e, o in zip(chunk, out, strict=True):
                response = response_text(tok, o, thinking)
                ok = is_correct(e.answer, response)
                right[kind] += ok
                total[kind] += 1
                if sum(s["kind"] == kind for s in samples) < 3:  # a few answers per kind
                    samples.append({"kind": kind, "answer": e.answer, "response": response})
    kinds = [k for k in KINDS if total[k]]
    return {"temperature": params.temperature, "top_p": params.top_p,
            "accuracy_by_kind": {k: round(right[k] / total[k], 4) for k in kinds},
            "questions_by_kind": {k: total[k] for k in kinds},
            "accuracy": round(sum(right.values()) / max(1, sum(total.values())), 4),
            "samples": samples}


def init_vision(vision: K3Vision, text_embed_rms: float, seed: int) -> None:
    """Linear and conv layers keep torch's default initialisation; the position table starts
    at N(0, 0.02), and the projector's post_norm at the text embeddings' RMS, so the features
    start at the scale of the token embeddings they replace."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        table = vision.vision_tower.patch_embed.pos_emb.weight
        table.copy_(torch.randn(table.shape, generator=g) * 0.02)
        vision.mm_projector.post_norm.weight.fill_(text_embed_rms)


# The text model's rate against the tower's (its peak 5e-4: a fifth of the rate it was trained
# at), and its replay: REPLAY_BATCH windows of REPLAY_LEN tokens of its own training stream per
# step, their loss at REPLAY_WEIGHT. A 10-minute trial from the committed frozen-run tower
# (lr 5e-4, weight 0.5) took held-out colour answers from 0% to 96% (instant) / 84% (thinking)
# with the held-out perplexity 54.5 -> 59.1. At weight 0.5 a 30-minute run left conversations
# well-formed without a grammar 69% of the time (86% before the stage): hence 1.0.
TEXT_LR_SCALE = 1 / 6
REPLAY_WEIGHT = 1.0
JOINT_TOWER_LR_SCALE = 1 / 3
REPLAY_BATCH, REPLAY_LEN = 2, 256


@dataclass
class VisionResult:
    steps: int
    examples: int
    wall_s: float
    train_loss: float
    heldout: dict[str, dict[str, Any]]
    perplexity_before: float
    perplexity_after: float


def train_vision(
    tok: HFTokenizer,
    train_files: list[SourceFile],
    heldout_files: list[SourceFile],
    target_dir: Path,
    seed: int,
    budget_s: float,
    batch: int = 16,
    peak_lr: float = 3e-3,
    threads: int = 2,
    provenance: dict[str, Any] | None = None,
    max_steps: int | None = None,
    heldout_per_kind: int = 50,
) -> VisionResult:
    """Train the tower + projector and the text model for `budget_s` (or `max_steps`), save
    them into `target_dir` (the text model's shards, the tower's own shard, the index,
    config.json's vision_config and media_placeholder_token_id, preprocessor_config.json),
    measure what was saved (the held-out split at both K3 sampling modes, the text model's
    held-out perplexity before and after) and record it in the target's
    training_metrics.json under "vision"."""
    torch.set_num_threads(threads)
    seed_everything(seed)
    start = time.monotonic()
    lm = load_k3(target_dir, dtype=torch.float32)
    stream = encode_documents(tok, train_files, seed)
    eval_windows = heldout_windows(tok, heldout_files, seed)
    ppl_before = heldout_perplexity(lm, eval_windows)
    config = mini_vision_config(lm.config.hidden_size)
    grid = (1, IMAGE_SIZE // 14, IMAGE_SIZE // 14)
    cache = PromptCache(tok, merged_tokens(config, grid))
    target = TargetRunner(lm, cache)
    vision = K3Vision(config)
    embed = lm.model.embed_tokens.weight
    init_vision(vision, float(embed.detach().pow(2).mean().sqrt()), seed)
    params = vision_params(config)
    probe = AttributeProbe(config.merged_size)
    print(f"vision: {params:,} parameters (tower + projector), {cache.n} tokens per "
          f"{IMAGE_SIZE}x{IMAGE_SIZE} image; prompts {len(cache.prefix[True])} + "
          f"{len(cache.encoded(examples(seed, 1)[0], True).prompt)} tokens thinking, "
          f"{len(cache.prefix[False])} + "
          f"{len(cache.encoded(examples(seed, 1)[0], False).prompt)} instant; the text model's "
          f"held-out perplexity {ppl_before:.2f}", flush=True)
    # The projector at PROJECTOR_LR_SCALE x the peak rate: its output lives in the text
    # model's embedding space, where free vectors needed ~1e-2 to steer the frozen model to a
    # word within 60 steps (3e-3 for the whole tower moved the answers' loss little in 200).
    # The text model's parameters are those its own training trains (not the router bias).
    # The tower, trained already by its own stage, at JOINT_TOWER_LR_SCALE, so that the answers'
    # gradient through the text model moves what it has learned less (the probe, still on,
    # held shape at 97% through the committed run's joint stage).
    text_weights = [p for p in lm.parameters() if p.requires_grad]
    groups = []
    for weights, scale in ((list(vision.vision_tower.parameters()), JOINT_TOWER_LR_SCALE),
                           (list(vision.mm_projector.parameters()), PROJECTOR_LR_SCALE),
                           (text_weights, TEXT_LR_SCALE)):
        groups += [{"params": [p for p in weights if p.ndim >= 2], "weight_decay": 0.01,
                    "scale": scale},
                   {"params": [p for p in weights if p.ndim < 2], "weight_decay": 0.0,
                    "scale": scale}]
    groups.append({"params": list(probe.parameters()), "weight_decay": 0.0, "scale": 1.0})
    opt = torch.optim.AdamW(groups, lr=peak_lr, betas=(0.9, 0.98))
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    # Keep time for the held-out measurements (2 modes x 4 kinds, the perplexity) and the save.
    reserve = min(240.0, 0.15 * budget_s) if max_steps is None else 0.0
    loop_budget = budget_s - (time.monotonic() - start) - reserve
    held = heldout_examples(seed, heldout_per_kind)
    tower = train_tower(vision, probe, seed, TOWER_SHARE * loop_budget, max_steps, held)
    loop_budget = budget_s - (time.monotonic() - start) - reserve
    progress = Progress("vision", loop_budget, max_steps=max_steps)
    tuner = ThreadTuner(threads)
    vision.train()
    lm.train()
    step, seen, ema, replay_ema = 0, 0, float("nan"), float("nan")
    kind_ema: dict[str, float] = {}
    while not progress.finished(step):
        lr = cosine_lr(progress.share(step), step, peak_lr, warmup=min(30, max_steps or 30))
        for g in opt.param_groups:
            g["lr"] = lr * g["scale"]
        t_step = time.monotonic()
        # One mode per step (the prompts of a step share its prefix state); a fresh stream of
        # training images, drawn from the training seed's generator.
        thinking = step % 2 == 1
        exs = examples(rng.randrange(2**31), batch)
        target.forget_prefix()
        loss, per = vision_loss(target, vision, exs, thinking, probe)
        replay = lm_loss(lm, random_windows(stream, REPLAY_BATCH, REPLAY_LEN + 1, gen))
        optimizer_step(opt, loss + REPLAY_WEIGHT * replay, [*vision.parameters(), *text_weights])
        tuner.record(time.monotonic() - t_step)
        step += 1
        seen += batch
        value, replay_value = float(loss.detach()), float(replay.detach())
        ema, replay_ema = running_mean(ema, value), running_mean(replay_ema, replay_value)
        for e, v in zip(exs, per, strict=True):
            kind_ema[e.kind] = running_mean(kind_ema.get(e.kind, math.nan), v)
        progress.update(step=step, loss=ema, text=replay_ema, lr=lr, threads=tuner.current,
                        **{k: round(kind_ema.get(k, float("nan")), 3) for k in KINDS})
    progress.update(force=True, step=step, loss=ema)

    vision.eval()
    lm.eval()
    probe_after = probe.accuracy(vision, held)
    print(f"vision: the probe's held-out accuracy after the joint stage {probe_after}", flush=True)
    save_k3(to_storage_dtype(lm), target_dir, max_shard_bytes=ASSET_SHARD_BYTES)
    save_k3_vision(vision.to(torch.bfloat16), target_dir)
    write_media_files(target_dir, cache.pad_id)
    # Measure what ships: the saved bf16 weights, loaded the way the engine loads them.
    shipped_lm = load_k3(target_dir, dtype=torch.float32)
    shipped = load_k3_vision(target_dir, dtype=torch.float32)
    assert shipped is not None
    ppl_after = heldout_perplexity(shipped_lm, eval_windows)
    shipped_target = TargetRunner(shipped_lm, cache)
    results = {}
    for mode, thinking in (("thinking", True), ("instant", False)):
        results[mode] = answer_accuracy(shipped_target, shipped, held, thinking, seed)
        print(f"vision: held-out {mode} (T {results[mode]['temperature']}, top_p "
              f"{results[mode]['top_p']}): {results[mode]['accuracy_by_kind']}", flush=True)
    print(f"vision: the text model's held-out perplexity {ppl_before:.2f} -> {ppl_after:.2f}",
          flush=True)
    wall = time.monotonic() - start
    result = VisionResult(step, seen, wall, ema, results, ppl_before, ppl_after)
    metrics_path = target_dir / "training_metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
    metrics["vision"] = {
        "parameters": params, "steps": step, "train_images": seen, "batch": batch,
        "peak_lr": peak_lr, "projector_lr_scale": round(PROJECTOR_LR_SCALE, 3),
        "image_size": IMAGE_SIZE, "tokens_per_image": cache.n,
        "wall_s": round(wall, 1), "train_loss_ema": round(ema, 4),
        "answer_ce_ema_by_kind": {k: round(v, 4) for k, v in kind_ema.items()},
        "structure_weight": STRUCTURE_WEIGHT, "attribute_probe": "linear, training only",
        "tower_stage": tower, "joint_tower_lr_scale": round(JOINT_TOWER_LR_SCALE, 4),
        "probe_heldout_accuracy_after": probe_after,
        "text_model": {
            "trained": True, "lr_scale": round(TEXT_LR_SCALE, 4),
            "replay": f"{REPLAY_BATCH} x {REPLAY_LEN} tokens of its training stream per step",
            "replay_weight": REPLAY_WEIGHT, "replay_loss_ema": round(replay_ema, 4),
            "heldout_perplexity_before": round(ppl_before, 3),
            "heldout_perplexity_after": round(ppl_after, 3),
            "heldout_tokens": eval_windows[:, 1:].numel()},
        "heldout_seed": "training seed + synthetic_images.HELDOUT_SEED_OFFSET",
        "heldout_per_kind": heldout_per_kind, "heldout": results,
        "question_order": "question text, then the image", "provenance": provenance or {},
    }
    metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
    print(f"vision: {step} steps, {seen:,} images, {wall / 60:.1f} min", flush=True)
    return result


def write_media_files(target_dir: Path, pad_id: int) -> None:
    """preprocessor_config.json (K3's `media_proc_cfg`) and config.json's image keys."""
    (target_dir / "preprocessor_config.json").write_text(
        json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=2) + "\n")
    path = target_dir / "config.json"
    raw = json.loads(path.read_text())
    raw["media_placeholder_token_id"] = pad_id
    raw["image_placeholder"] = IMAGE_PLACEHOLDER
    path.write_text(json.dumps(raw, indent=2) + "\n")
