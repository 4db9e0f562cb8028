"""What an image costs at prefill on the embedded pair (CPU), beside text of the same length.

    python bench/vision_prefill.py                      # 3 resolutions, 5 repeats
    python bench/vision_prefill.py --sizes 56x56,112x112 --repeats 1 --json out.json

For each resolution, in one process with the variants alternating within each repeat (medians
over repeats, milliseconds):

- `preprocess`: K3's processor on a synthetic RGB image (resize, pad, patchify: vision/);
- `tower`: normalise + MoonViT-V2 + patchmergerv2 on that image's patches (the reference
  engine's tower, models/moonvit.py), giving `tokens` features;
- `text prefill`: the target's prefill of a `tokens`-long text prompt (random ids, fresh
  state): what the same number of prompt positions costs without an image;
- `image prefill`: the target's prefill of the same length with the tower's features as its
  inputs (what an image prompt's pad run costs in the text model; equal to text prefill up to
  noise: the layers do not know where their inputs came from).

The tower ms per image against the text prefill of its tokens says what share of an image
prompt's TTFT the tower is. `--target` points at another K3 checkpoint folder with a
vision_config (default: the embedded pair's target).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from serve_app.embedded import TARGET  # noqa: E402
from serve_app.models.k3 import K3State  # noqa: E402
from serve_app.models.k3_weights import load_k3  # noqa: E402
from serve_app.models.moonvit import load_k3_vision  # noqa: E402
from serve_app.vision import MediaConfig, normalise  # noqa: E402
from serve_app.vision.preprocess import preprocess  # noqa: E402


def synthetic(width: int, height: int) -> Image.Image:
    """A deterministic picture with structure (gradients and a disc), not a flat colour."""
    image = Image.new("RGB", (width, height))
    image.putdata([((x * 7) % 256, (y * 5) % 256, 255 if (x - width // 2) ** 2
                    + (y - height // 2) ** 2 < (min(width, height) // 3) ** 2 else 40)
                   for y in range(height) for x in range(width)])
    return image


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for part in text.split(","):
        w, _, h = part.strip().lower().partition("x")
        sizes.append((int(w), int(h)))
    return sizes


def run(target: Path, sizes: list[tuple[int, int]], repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = load_k3(target, dtype=torch.float32).eval()
    tower = load_k3_vision(target, dtype=torch.float32)
    media = MediaConfig.from_folder(target)
    if tower is None or media is None:
        raise SystemExit(f"{target} has no vision_config / preprocessor_config.json")
    tower.eval()
    vocab = model.config.vocab_size
    rows = []
    with torch.inference_mode():
        for width, height in sizes:
            image = synthetic(width, height)
            grid, tokens, patches = preprocess(image, media)
            ids = torch.randint(0, vocab, (1, tokens))
            samples: dict[str, list[float]] = {k: [] for k in
                                               ("preprocess", "tower", "text", "image")}
            pixels = normalise(patches, media)
            embeds = tower(pixels, [grid]).to(model.model.embed_tokens.weight.dtype)[None]
            variants: dict[str, Callable[[], Any]] = {
                "preprocess": partial(preprocess, image, media),
                "tower": partial(lambda p, g: tower(normalise(p, media), [g]), patches, grid),
                "text": partial(model.model, ids, K3State()),
                "image": partial(model.model, ids, K3State(), inputs_embeds=embeds),
            }
            for fn in variants.values():  # warm-up: first calls pay for allocation
                fn()
            for _ in range(repeats):
                for name, fn in variants.items():
                    samples[name].append(timed(fn))
            med = {k: round(statistics.median(v), 3) for k, v in samples.items()}
            rows.append({"size": f"{width}x{height}", "grid_thw": list(grid),
                         "patches": int(patches.shape[0]), "tokens": tokens,
                         "preprocess_ms": med["preprocess"], "tower_ms": med["tower"],
                         "text_prefill_ms": med["text"], "image_prefill_ms": med["image"],
                         "tower_vs_text": round(med["tower"] / med["text"], 3)})
    return {"bench": "vision_prefill", "target": str(target), "repeats": repeats,
            "threads": torch.get_num_threads(), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=TARGET)
    parser.add_argument("--sizes", default="112x112,224x224,448x336")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = run(args.target, parse_sizes(args.sizes), args.repeats)
    print(f"{'size':>9} {'tokens':>6} {'preprocess':>10} {'tower':>9} {'text prefill':>12} "
          f"{'image prefill':>13} {'tower/text':>10}")
    for r in report["rows"]:
        print(f"{r['size']:>9} {r['tokens']:>6} {r['preprocess_ms']:>8.2f}ms "
              f"{r['tower_ms']:>7.2f}ms {r['text_prefill_ms']:>10.2f}ms "
              f"{r['image_prefill_ms']:>11.2f}ms {r['tower_vs_text']:>9.2f}x")
    line = json.dumps(report, sort_keys=True)
    if args.json:
        args.json.write_text(line)
    print(line)


if __name__ == "__main__":
    main()
