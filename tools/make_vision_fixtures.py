"""Write tests/data/vision/k3_processor.json: what K3's own image processor makes of each
synthetic image in tests/vision_images.py (sizes, pads, grid, tokens, and sha256 of its uint8
patches and of its normalised float32 pixel values), for tests/test_vision_preprocess.py.

    python tools/make_vision_fixtures.py /tmp/k3ref

where /tmp/k3ref holds saved copies of the checkpoint's `kimi_k3_vision_processing.py` and
`media_utils.py`. The copies this fixture was made from were read from
vllm-project/llm-compressor at commit b6dd6de836d311942386af95d2d2c1c9b613ac04,
src/llmcompressor/modeling/kimi_k3/ (identical to 47f71bb6763f, "feat: add Kimi-K3 model
definition"; their header: differences from huggingface.co/moonshotai/Kimi-K3 are formatting
only). The reference code is executed from that folder, never copied into the repository.

The processor imports three names from transformers (a base class, a dict-like result, an enum).
When transformers is not installed, minimal stand-ins are registered for them: they hold data and
do nothing else, so every line that computes pixels is the checkpoint's own.

Inputs: RGB and RGBA cases go to the processor as they are (our decoder produces those modes).
L, LA and small palette images go in their own modes, as a client's PNG would open, to show
that converting them first (as serve_app/vision/decode.py does) changes nothing. The resized
palette case would differ (Pillow resizes "P" with NEAREST); there are none here: decode.py
documents that choice.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the synthetic images the tests rebuild

from vision_images import CASES, synthetic_image  # noqa: E402

OUT = ROOT / "tests" / "data" / "vision" / "k3_processor.json"
CONFIG = ROOT / "tests" / "data" / "vision" / "preprocessor_config.json"
SOURCE = ("vllm-project/llm-compressor@b6dd6de836d311942386af95d2d2c1c9b613ac04:"
          "src/llmcompressor/modeling/kimi_k3/")


def _stand_in_transformers() -> None:
    try:
        import transformers  # noqa: F401
        return
    except ImportError:
        pass

    class BaseImageProcessor:
        def __init__(self, **kwargs: object) -> None:
            pass

    class BatchFeature(dict):
        def __init__(self, data: dict | None = None, tensor_type: object = None) -> None:
            super().__init__(data or {})

    root = types.ModuleType("transformers")
    utils = types.ModuleType("transformers.utils")
    processing = types.ModuleType("transformers.image_processing_utils")
    processing.BaseImageProcessor = BaseImageProcessor
    processing.BatchFeature = BatchFeature
    utils.TensorType = type("TensorType", (), {})
    sys.modules.update({"transformers": root, "transformers.utils": utils,
                        "transformers.image_processing_utils": processing})


def _load_reference(folder: Path) -> types.ModuleType:
    """Import the saved files as a package `k3ref` (the processor imports `.media_utils`)."""
    package = types.ModuleType("k3ref")
    package.__path__ = [str(folder)]
    sys.modules["k3ref"] = package
    for name in ("media_utils", "kimi_k3_vision_processing"):
        spec = importlib.util.spec_from_file_location(f"k3ref.{name}", folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"k3ref.{name}"] = module
        spec.loader.exec_module(module)
    return sys.modules["k3ref.kimi_k3_vision_processing"]


def _sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", type=Path, help="folder with the saved processor files")
    args = parser.parse_args()
    _stand_in_transformers()
    reference = _load_reference(args.reference)
    media_utils = sys.modules["k3ref.media_utils"]
    cfg = json.loads(CONFIG.read_text())["media_proc_cfg"]
    processor = reference.KimiK3VisionProcessor(media_proc_cfg=cfg)
    cases = []
    for case in CASES:
        image = synthetic_image(case)
        resize = processor.get_resize_config({"type": "image", "image": image})
        padded = processor.resize_image(image, resize["new_width"], resize["new_height"],
                                        resize["pad_width"], resize["pad_height"])
        patches = media_utils.navit_patchify(padded[None], cfg["patch_size"])["pixel_values"]
        out = processor.preprocess([{"type": "image", "image": image}])
        pixel_values = np.asarray(out["pixel_values"])
        assert pixel_values.dtype == np.float32
        cases.append({
            "name": case.name,
            "new_width": resize["new_width"],
            "new_height": resize["new_height"],
            "pad_width": resize["pad_width"],
            "pad_height": resize["pad_height"],
            "num_tokens": resize["num_tokens"],
            "grid_thw": [int(v) for v in np.asarray(out["grid_thws"])[0]],
            "patches_shape": list(patches.shape),
            "patches_sha256": _sha256(patches.astype(np.uint8)),
            "pixel_values_sha256": _sha256(pixel_values),
        })
        print(case.name, cases[-1]["new_width"], cases[-1]["new_height"],
              cases[-1]["grid_thw"], cases[-1]["num_tokens"])
    OUT.write_text(json.dumps({"source": SOURCE, "cases": cases}, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
