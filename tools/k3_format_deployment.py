"""Write a CPU deployment that speaks Kimi K3's chat format, for `serve run` and the Kimi
Vendor Verifier (docs/chat-format.md, "Checking against the Kimi Vendor Verifier").

    python tools/k3_format_deployment.py /tmp/k3-format
    RAY_AUTH_MODE=disabled serve run /tmp/k3-format/k3_format.yaml

What it writes under OUT:
  - `target/`: a random mini Kimi K3 (the test suite's widths; K3's vocabulary of 163,840 and its
    special ids) with a K3-style tokenizer: the public Kimi BPE (tests/data/kimi-k25-tokenizer/
    tiktoken.model) and K3's control tokens (tests/data/kimi-k3-style/tokenizer_config.json),
    and a random tiny vision tower + projector (K3's `vision_config` structure at tiny sizes,
    `vision_tower.*` / `mm_projector.*` tensors) with K3's published preprocessor_config.json,
    so an image request goes the whole way with K3's media ids (163602-163605);
  - `draft/`: a random DSpark draft for it;
  - `k3_format.yaml`: deployments/local.yaml with these folders, TP 1, K3's parameter policy
    (the server's tool strictness off, as in production), speculation at every batch size
    (the verifier's requests arrive together), and local.yaml's `grammar_budget: close` (a
    random model ends no free string: docs/constrained-decoding.md).

The embedded pair speaks XTML too (`serve run deployments/local.yaml`), but on a 4,096-id
vocabulary; this deployment checks the API's contracts at K3's own vocabulary and control ids
with random weights, the hardest case: every contract must hold whatever the model writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the random-checkpoint writers the tests use

from tiny_models import write_k3_format_pair  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--name", default="kimi-k3-format")
    args = parser.parse_args()
    paths = write_k3_format_pair(args.out)
    config = yaml.safe_load((ROOT / "deployments" / "local.yaml").read_text())
    config["http_options"]["port"] = args.port
    app = config["applications"][0]["args"]
    app["models"] = {"target": str(paths["target"].resolve()),
                     "draft": str(paths["draft"].resolve()), "served_model_name": args.name}
    app["parallelism"]["tp"] = 1
    app["engine"]["reference"]["speculation"]["max_batch_size"] = None
    app["api"] = {"parameter_policy": "k3"}
    app["ingress"]["default_max_tokens"] = 64
    out = args.out / "k3_format.yaml"
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    print(f"wrote {out}\n  RAY_AUTH_MODE=disabled serve run {out}")


if __name__ == "__main__":
    main()
