"""Writes every production deployment file from the one description below.

    python deployments/generate.py          # (re)write the files
    python deployments/generate.py --check  # exit 1 if any file differs from what it would write

Outputs (all generated; edit this file, not them):
- deployments/kimi_dspark.yaml             K3 + DSpark, 2 x 8 H200, TP16/EP16, FP8 KV (published recipe)
- deployments/variants/kimi_dspark_*.yaml  8 x B300, 8 x MI355X (TP8); 6 x 8 MI300X (TP12 x DP4)
- cluster/aws-p5-h100.yaml, cluster/aws-p5e-h200.yaml, cluster/gcp-a3-h100.yaml,
  cluster/onprem-amd.yaml                  Ray cluster-launcher configs (GPU-free head)
- cluster/kuberay/rayservice.yaml          KubeRay RayService embedding deployments/kimi_dspark.yaml

Why generated rather than `--override`s: a Serve file must be complete for `serve deploy` and
KubeRay (which take no overrides), the variants differ in a handful of values that are easiest
to review side by side here, and each output is validated with the app's config tree before it
is written. Every file is built by capacity/emit.py, the one writer that `kimi-capacity emit`
uses too: a variant here is the same description (GPU, nodes, KV dtype, context) that the
command in its file's header takes, and both write the same bytes. The planner derives every
SGLang value (max_running_requests and the KDA state pool from its memory model, the KV dtype
refused when one full-context request does not fit, the kernel choices per GPU, and SGLang
0.5.23's K3 levers: extra_buffer_lazy, decode context parallelism, the HiCache host tier and
EPLB, each chosen by capacity.levers.choose_levers with its reason in the file's header, and
the MI355X memory fraction and prefill chunk known to fit, capacity.emit.KNOWN_FIT); the start-up
rules (NOSET variables, project install, CPUs per rank, GPU-free head, RAY_AUTH_MODE) are
capacity's too.

Every file is sized with the weights SGLang 0.5.23 really holds on its GPU (capacity/
sglang_k3_paths.py, the table `plan` prices with). MI300X (gfx942) has no MXFP4 MoE path for K3
in SGLang 0.5.23: AITER's MXFP4 SiTU kernels are gfx95x-only and without SGLANG_USE_AITER the
Triton runner upcasts the experts to BF16 at load (srt/layers/quantization/mxfp4.py:1115-1135),
about 4x their bytes. The 2 x 8 MI300X variant shipped before was sized for MXFP4 experts and
would not load (BF16 experts need about 350 GB per GPU at TP16). Its replacement is the smallest
MI300X fleet the planner finds that holds the BF16 experts, the DSpark draft and one 1M-token
request: 6 nodes (5 give 40 GPUs, and no tensor-parallel size over them divides K3's 96 heads),
at the cheapest 6-node layout of `kimi-capacity plan --context 1M --draft kimi-k3-dspark --gpus
MI300X`, TP12 x attention DP4 over EP48 (four full-context requests at once where TP48 holds
one). It misses the 1M latency target's TTFT (about 370 s against 120 s, no published SGLang K3
run on gfx942 to check it): it is the AMD on-premise fleet that runs today, not a recommendation
over MI355X (1 x 8, MXFP4 experts).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from capacity import emit  # noqa: E402
from capacity.emit import ServeDescription  # noqa: E402
from capacity.families import describe_model  # noqa: E402
from capacity.formats import KvDtype  # noqa: E402
from capacity.tables import load_gpus  # noqa: E402
from serve_app.config import AppConfig  # noqa: E402

TOOL = "deployments/generate.py"
# Checkpoints on every GPU node (a shared filesystem or a copy per node); the ingress also
# reads the tokenizer from here, wherever Serve places it.
TARGET = "/models/Kimi-K3"
DRAFT = "/models/Kimi-K3-DSpark"
MODEL, DRAFT_MODEL = "kimi-k3", "kimi-k3-dspark"
CONTEXT = 1_048_576  # K3's full context: every shipped file serves it


@dataclass(frozen=True)
class Variant:
    """One production layout: where its Serve file goes and what the planner is given (GPU,
    nodes, KV dtype); K3 + DSpark with TP = EP = every GPU at the full context."""

    file: str
    gpu: str
    nodes: int
    kv: KvDtype = KvDtype.BF16
    attention_dp: int = 1

    @property
    def description(self) -> ServeDescription:
        gpu = load_gpus()[self.gpu]
        return emit.describe_layout(
            describe_model(MODEL), TARGET, emit.plain_layout(gpu, self.nodes, self.kv, self.attention_dp),
            CONTEXT, gpu, draft=describe_model(DRAFT_MODEL), draft_ref=DRAFT,
            planner_refs=(MODEL, DRAFT_MODEL), levers=True)


VARIANTS = (
    # SGLang cookbook's K3 recipe hardware. FP8 KV: with BF16 one 1M-token request
    # does not fit beside the weights (the file's header has the numbers).
    Variant("deployments/kimi_dspark.yaml", "H200", 2, KvDtype.FP8),
    Variant("deployments/variants/kimi_dspark_b300.yaml", "B300", 1),
    Variant("deployments/variants/kimi_dspark_mi355x.yaml", "MI355X", 1),
    # 192 GB GPUs holding BF16 experts (SGLang 0.5.23's only K3 path on gfx942): 6 nodes, the
    # planner's cheapest 6-node layout (see the module docstring).
    Variant("deployments/variants/kimi_dspark_mi300x.yaml", "MI300X", 6, attention_dp=4),
)
PRODUCTION = VARIANTS[0]
MI300X = VARIANTS[3]


def checked(desc: ServeDescription) -> ServeDescription:
    """The description, validated with the app's config tree: its engine.sglang section is
    every SGLangSettings value in the app's order (capacity writes it without importing the
    app), so the file shows every server value."""
    config = AppConfig.model_validate(emit.app_args(desc))
    app_section = config.engine.sglang.model_dump(mode="json")
    if list(app_section.items()) != list(desc.sglang.items()):
        raise SystemExit(f"capacity.emit's engine.sglang section for {desc.stem} is not the "
                         f"app's SGLangSettings: {desc.sglang} != {app_section}")
    return desc


def cluster_files() -> dict[str, tuple[str, dict[str, Any]]]:
    # K3 needs 1.56 TB of weights as MXFP4 experts: H100 (80 GB) needs 4 nodes (TP32), H200 2
    # nodes; MI300X holds the experts as BF16 (see the module docstring): its variant's nodes.
    amd_workers = MI300X.description.worker_nodes
    return {
        "cluster/aws-p5-h100.yaml": ("AWS p5.48xlarge, 8 x H100 per node; K3 needs 4 nodes",
                                     emit.aws_config("kimi-k3-p5", "p5.48xlarge", 4)),
        "cluster/aws-p5e-h200.yaml": ("AWS p5e.48xlarge, 8 x H200 per node, for "
                                      "deployments/kimi_dspark.yaml",
                                      emit.aws_config("kimi-k3-p5e", "p5e.48xlarge", 2)),
        "cluster/gcp-a3-h100.yaml": ("GCP a3-highgpu-8g, 8 x H100 per node; K3 needs 4 nodes",
                                     emit.gcp_config("kimi-k3-a3", "a3-highgpu-8g", 4)),
        "cluster/onprem-amd.yaml": (f"on-premise MI300X ({amd_workers} workers) or MI355X "
                                    "(keep 1 worker)",
                                    emit.onprem_config("kimi-k3-amd", amd_workers)),
    }


def render() -> dict[str, str]:
    """Every generated file: path relative to the repository root -> exact text."""
    out: dict[str, str] = {}
    for variant in VARIANTS:
        out[variant.file] = emit.render_serve(checked(variant.description))
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
