"""Synthetic images and questions for the embedded pair's vision tower: one shape, digit or
short word drawn with Pillow on a varied background, and a question whose answer is one word.

Four kinds of question: the shape's colour, the shape's name, the digit, the word. Everything
is drawn from a `random.Random`, so a seed names a split: training draws from one seed's
stream, the held-out set from another (`HELDOUT_SEED_OFFSET`), and an image's parameters are
continuous (position, size, colour jitter, background), so the two never share an image.
The font is the one Pillow ships (`ImageFont.load_default(size=...)`), not a system font, so
the same seed draws the same pixels on any machine with the same Pillow."""

from __future__ import annotations

import base64
import io
import math
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

# Images are IMAGE_SIZE x IMAGE_SIZE: a multiple of 28 (patch 14, merge 2x2), so K3's
# preprocessing neither resizes nor pads them: 6 x 6 patches, 9 image tokens.
IMAGE_SIZE = 84

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 170, 40), "blue": (40, 70, 230),
    "yellow": (240, 220, 30), "purple": (140, 40, 190), "orange": (250, 140, 20),
}
SHAPES = ("circle", "square", "triangle", "star", "cross")
DIGITS = tuple(str(d) for d in range(10))
WORDS = ("cat", "dog", "sun", "box", "car", "fish", "tree", "book")
KINDS = ("colour", "shape", "digit", "word")



def _choices(names: tuple[str, ...]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1]


# The question per kind: the user's text, sent before the image (see `user_content`). Each
# names its possible answers: the frozen text model copies a word of its context far more
# readily than it recalls one (a first run with open questions and 200 steps left every
# answer wrong), so the image only has to say which; a random pick is still 1/5 to 1/10.
QUESTIONS = {
    "colour": f"What colour is the shape in the image: {_choices(tuple(COLOURS))}?",
    "shape": f"What shape is in the image: {_choices(SHAPES)}?",
    "digit": f"Which digit is in the image: {_choices(DIGITS)}?",
    "word": f"Which word is written in the image: {_choices(WORDS)}?",
}

HELDOUT_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class SyntheticExample:
    kind: str
    question: str
    answer: str
    image: Image.Image  # RGB, IMAGE_SIZE x IMAGE_SIZE
    # What the image shows, by kind of question it answers: a shape image {"colour", "shape"},
    # a digit image {"digit"}, a word image {"word"}.
    attributes: tuple[tuple[str, str], ...] = ()


def _jitter(rgb: tuple[int, int, int], rng: random.Random, amount: int) -> tuple[int, ...]:
    return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in rgb)


def _background(rng: random.Random) -> tuple[int, ...]:
    """A near-white, light-gray, dark-gray or near-black background, slightly tinted: never
    one of the object colours."""
    level = rng.choice([rng.randint(215, 255), rng.randint(160, 200), rng.randint(40, 80),
                        rng.randint(0, 30)])
    return _jitter((level, level, level), rng, 12)


def _polygon(shape: str, cx: float, cy: float, r: float, turn: float) -> list[tuple[float, float]]:
    if shape == "square":
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "triangle":
        return [(cx + r * math.sin(turn + k * 2 * math.pi / 3),
                 cy - r * math.cos(turn + k * 2 * math.pi / 3)) for k in range(3)]
    if shape == "star":
        return [(cx + (r if k % 2 == 0 else 0.42 * r) * math.sin(turn + k * math.pi / 5),
                 cy - (r if k % 2 == 0 else 0.42 * r) * math.cos(turn + k * math.pi / 5))
                for k in range(10)]
    if shape == "cross":
        a = r / 3
        return [(cx - a, cy - r), (cx + a, cy - r), (cx + a, cy - a), (cx + r, cy - a),
                (cx + r, cy + a), (cx + a, cy + a), (cx + a, cy + r), (cx - a, cy + r),
                (cx - a, cy + a), (cx - r, cy + a), (cx - r, cy - a), (cx - a, cy - a)]
    raise ValueError(shape)


def draw_shape(shape: str, colour: str, rng: random.Random) -> Image.Image:
    """One filled shape of `colour` at a random size and place (wholly inside the image);
    triangles and stars turned a little."""
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), _background(rng))
    d = ImageDraw.Draw(img)
    r = rng.uniform(13, 32)
    cx, cy = rng.uniform(r + 2, IMAGE_SIZE - r - 2), rng.uniform(r + 2, IMAGE_SIZE - r - 2)
    fill = _jitter(COLOURS[colour], rng, 25)
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        d.polygon(_polygon(shape, cx, cy, r, rng.uniform(-0.25, 0.25)), fill=fill)
    return img


def draw_text(value: str, rng: random.Random) -> Image.Image:
    """`value` (a digit or a word) in a random object colour, size and place."""
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), _background(rng))
    d = ImageDraw.Draw(img)
    size = rng.randint(40, 62) if len(value) == 1 else rng.randint(24, 30 if len(value) == 3 else 24)
    font = ImageFont.load_default(size=size)
    left, top, right, bottom = d.textbbox((0, 0), value, font=font)
    w, h = right - left, bottom - top
    x = rng.uniform(2, max(2.0, IMAGE_SIZE - w - 2)) - left
    y = rng.uniform(2, max(2.0, IMAGE_SIZE - h - 2)) - top
    d.text((x, y), value, font=font, fill=_jitter(COLOURS[rng.choice(list(COLOURS))], rng, 25))
    return img


def example(kind: str, rng: random.Random) -> SyntheticExample:
    if kind in ("colour", "shape"):
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        img = draw_shape(shape, colour, rng)
        answer = colour if kind == "colour" else shape
        attributes = (("colour", colour), ("shape", shape))
    elif kind in ("digit", "word"):
        answer = rng.choice(DIGITS if kind == "digit" else WORDS)
        img = draw_text(answer, rng)
        attributes = ((kind, answer),)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return SyntheticExample(kind, QUESTIONS[kind], answer, img, attributes)


def examples(seed: int, count: int, kinds: tuple[str, ...] = KINDS) -> list[SyntheticExample]:
    """`count` examples cycling through `kinds`, drawn from `seed`'s stream."""
    rng = random.Random(seed)
    return [example(kinds[i % len(kinds)], rng) for i in range(count)]


def heldout_examples(seed: int, per_kind: int,
                     kinds: tuple[str, ...] = KINDS) -> list[SyntheticExample]:
    """The held-out split: `per_kind` examples of each kind from the held-out seed's stream."""
    return examples(seed + HELDOUT_SEED_OFFSET, per_kind * len(kinds), kinds)


def png_data_url(img: Image.Image) -> str:
    """The image as an OpenAI `image_url` data URL (lossless PNG)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def user_content(ex: SyntheticExample, url: str) -> list[dict[str, object]]:
    """The user message's content in the OpenAI shape: the question, then the image.

    Question first: the text model is causal and frozen, so the image's positions can read
    the question (and carry what it asks about to the answer), and the image sits right
    before the answer; the training prompts, the evaluation and the demo all use this order."""
    return [{"type": "text", "text": ex.question},
            {"type": "image_url", "image_url": {"url": url}}]
