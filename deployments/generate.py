"""Writes every production deployment file from the one description below.

    python deployments/generate.py          # (re)write the files
    python deployments/generate.py --check  # exit 1 if any file differs from what it would write

Outputs (all generated; edit this file, not them):
- deployments/kimi_dspark.yaml             K3 + DSpark, 2 x 8 H200, TP16/EP16 (published recipe)
- deployments/variants/kimi_dspark_*.yaml  8 x B300, 8 x MI355X (TP8); 2 x 8 MI300X (TP16)
- cluster/aws-p5-h100.yaml, cluster/aws-p5e-h200.yaml, cluster/gcp-a3-h100.yaml,
  cluster/onprem-amd.yaml                  Ray cluster-launcher configs (GPU-free head)
- cluster/kuberay/rayservice.yaml          KubeRay RayService embedding deployments/kimi_dspark.yaml

Why generated rather than `--override`s: a Serve file must be complete for `serve deploy` and
KubeRay (which take no overrides), the variants differ in a handful of values that are easiest
to review side by side here, and each output is validated with the app's config tree before it
is written. The files themselves are built by capacity/emit.py, the one writer that
`kimi-capacity emit` uses too (start-up rules: NOSET variables, project install, CPUs per rank,
GPU-free head, RAY_AUTH_MODE); this file only describes the variants. Values shared by every
variant are the defaults of `SGLangSettings` in `serve_app/config.py` (context length, block
size, mem_fraction_static, max_running_requests).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from capacity import emit  # noqa: E402
from capacity.emit import ServeDescription  # noqa: E402
from serve_app.config import AppConfig  # noqa: E402

TOOL = "deployments/generate.py"
# Checkpoints on every GPU node (a shared filesystem or a copy per node); the ingress also
# reads the tokenizer from here, wherever Serve places it.
TARGET = "/models/Kimi-K3"
DRAFT = "/models/Kimi-K3-DSpark"


@dataclass(frozen=True)
class Variant:
    """One production layout: where its Serve file goes, what it is, and its description (GPUs,
    nodes, and the SGLang settings that differ per GPU)."""

    file: str
    note: str
    description: ServeDescription


def k3_dspark(gpu: str, nodes: int, gpus_per_node: int, sglang: dict[str, Any]
              ) -> ServeDescription:
    """K3 + DSpark with TP = EP = every GPU."""
    return ServeDescription(gpu=gpu, nodes=nodes, gpus_per_node=gpus_per_node, target=TARGET,
                            draft=DRAFT, sglang=sglang)


VARIANTS = (
    # Published K3 recipe on H200 (kimi-k3-serving.md): --tp 16 --ep-size 16
    # --moe-runner-backend marlin --decode-attention-backend flashmla --mem-fraction-static 0.85.
    # The DSpark draft is dense GQA; on Hopper SGLang would resolve its backend to the prefill
    # backend (fa3); named here so the file says what runs.
    Variant("deployments/kimi_dspark.yaml",
            "K3 + DSpark on 2 x 8 H200, TP16 / EP16 (published H200 recipe)",
            k3_dspark("H200", 2, 8, {"moe_runner_backend": "marlin",
                                     "decode_attention_backend": "flashmla",
                                     "speculative_draft_attention_backend": "fa3"})),
    # Validated layout; SGLang's K3 hook picks trtllm_mha for the DSPARK draft on SM100.
    Variant("deployments/variants/kimi_dspark_b300.yaml", "K3 + DSpark on 8 x B300, TP8 / EP8",
            k3_dspark("B300", 1, 8, {"speculative_draft_attention_backend": "trtllm_mha"})),
    # FlashInfer is CUDA-only: SGLang falls back to triton for the draft on ROCm.
    Variant("deployments/variants/kimi_dspark_mi355x.yaml",
            "K3 + DSpark on 8 x MI355X, TP8 / EP8",
            k3_dspark("MI355X", 1, 8, {"speculative_draft_attention_backend": "triton"})),
    Variant("deployments/variants/kimi_dspark_mi300x.yaml",
            "K3 + DSpark on 2 x 8 MI300X, TP16 / EP16 (192 GB GPUs: 8 cannot hold the weights)",
            k3_dspark("MI300X", 2, 8, {"speculative_draft_attention_backend": "triton"})),
)
PRODUCTION = VARIANTS[0]


def completed(desc: ServeDescription) -> ServeDescription:
    """The description validated with the app's config tree, its sglang section written out in
    full (every SGLangSettings value) so the file shows every server value."""
    config = AppConfig.model_validate(emit.app_args(desc))
    return dataclasses.replace(desc, sglang=config.engine.sglang.model_dump(mode="json"))


def cluster_files() -> dict[str, tuple[str, dict[str, Any]]]:
    # K3 needs 1.56 TB of weights: H100 (80 GB) needs 4 nodes (TP32), H200 2 nodes, MI300X 2.
    return {
        "cluster/aws-p5-h100.yaml": ("AWS p5.48xlarge, 8 x H100 per node; K3 needs 4 nodes",
                                     emit.aws_config("kimi-k3-p5", "p5.48xlarge", 4)),
        "cluster/aws-p5e-h200.yaml": ("AWS p5e.48xlarge, 8 x H200 per node, for "
                                      "deployments/kimi_dspark.yaml",
                                      emit.aws_config("kimi-k3-p5e", "p5e.48xlarge", 2)),
        "cluster/gcp-a3-h100.yaml": ("GCP a3-highgpu-8g, 8 x H100 per node; K3 needs 4 nodes",
                                     emit.gcp_config("kimi-k3-a3", "a3-highgpu-8g", 4)),
        "cluster/onprem-amd.yaml": ("on-premise MI300X (2 workers) or MI355X (keep 1 worker)",
                                    emit.onprem_config("kimi-k3-amd", 2)),
    }


def render() -> dict[str, str]:
    """Every generated file: path relative to the repository root -> exact text."""
    out: dict[str, str] = {}
    for variant in VARIANTS:
        out[variant.file] = emit.render(emit.serve_file_config(completed(variant.description)),
                                        variant.note, TOOL)
    for path, (what, config) in cluster_files().items():
        out[path] = emit.render(config, what, TOOL)
    out["cluster/kuberay/rayservice.yaml"] = emit.render(
        emit.rayservice(out[PRODUCTION.file], PRODUCTION.description),
        "KubeRay RayService; serveConfigV2 = " + PRODUCTION.file, TOOL)
    return out


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for rel, text in render().items():
        path = ROOT / rel
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(rel)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {rel}")
    if stale:
        print("out of date (run python deployments/generate.py): " + ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
