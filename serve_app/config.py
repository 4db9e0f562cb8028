"""The one config tree of the Serve app, validated once at the edge (the builder's argument).

Deployment files (`deployments/*.yaml`) differ only in values. Paths may name a committed asset
as `embedded:NAME` (a folder under `serve_app/assets/`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve_app.engines.reference.builder import ReferenceEngineConfig

ASSETS = Path(__file__).parent / "assets"


def resolve_path(value: str) -> Path:
    """`embedded:NAME` -> the committed asset folder; anything else is a filesystem path."""
    if value.startswith("embedded:"):
        return ASSETS / value.removeprefix("embedded:")
    return Path(value).expanduser()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelsConfig(_Strict):
    target: str = Field(description="target checkpoint folder (HF DeepseekV3/K2 or K3 layout)")
    draft: str | None = Field(default=None, description="DSpark checkpoint folder; none = no draft")
    tokenizer: str | None = Field(default=None, description="folder with tokenizer.json; "
                                  "default: the target folder")
    served_model_name: str = "kimi-dspark"

    def target_path(self) -> Path:
        return resolve_path(self.target)

    def draft_path(self) -> Path | None:
        return resolve_path(self.draft) if self.draft else None

    def tokenizer_path(self) -> Path:
        return resolve_path(self.tokenizer or self.target)


class ParallelismConfig(_Strict):
    tp: int = Field(default=1, ge=1, description="tensor-parallel ranks per replica")
    pp: int = Field(default=1, ge=1, description="pipeline stages (reference engine: 1)")
    ep: int = Field(default=1, ge=1, description="expert-parallel size (SGLang)")
    attention_dp: int = Field(default=1, ge=1, description="attention data parallel (SGLang)")
    nodes: int = Field(default=1, ge=1, description="nodes per replica (one bundle each)")
    devices_per_node: int = Field(default=1, ge=1, description="GPUs (or CPU rank slots) used "
                                  "on each node")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @model_validator(mode="after")
    def _layout(self) -> ParallelismConfig:
        if self.tp * self.pp != self.world_size:
            raise ValueError(
                f"parallelism.tp ({self.tp}) x parallelism.pp ({self.pp}) = {self.tp * self.pp} "
                f"must equal the devices in the bundles: parallelism.nodes ({self.nodes}) x "
                f"parallelism.devices_per_node ({self.devices_per_node}) = {self.world_size}"
            )
        if self.ep > self.tp * self.pp:
            raise ValueError(f"parallelism.ep ({self.ep}) cannot exceed the {self.world_size} "
                             "devices of a replica")
        return self


class PlacementConfig(_Strict):
    accelerator: Literal["GPU", "CPU"] = "GPU"
    strategy: Literal["auto", "STRICT_PACK", "STRICT_SPREAD", "PACK", "SPREAD"] = Field(
        default="auto", description="auto: STRICT_PACK on one node, STRICT_SPREAD across nodes")
    cpus_per_rank: float = Field(default=1.0, gt=0, description="CPU reserved per rank worker; "
                                 "keep small on small machines")
    replicas: int = Field(default=1, ge=1, description="target replicas (engines)")


class IngressConfig(_Strict):
    default_max_tokens: int = Field(default=256, gt=0)
    max_tokens_limit: int = Field(default=8192, gt=0)
    max_ongoing_requests: int = Field(default=256, gt=0)
    ingress_cpus: float = Field(default=0.1, ge=0)


class EngineSettings(_Strict):
    backend: Literal["reference", "sglang"] = "reference"
    reference: ReferenceEngineConfig = ReferenceEngineConfig()
    max_model_len: int | None = Field(default=None, gt=0, description="context limit; default "
                                      "the smaller of the two models' maximum")
    health_check_timeout_s: float = Field(default=30.0, gt=0)
    startup_timeout_s: float = Field(default=600.0, gt=0)


class AppConfig(_Strict):
    """Everything `build_app` needs: models, engine backend, parallelism, placement, ingress."""

    models: ModelsConfig
    engine: EngineSettings = EngineSettings()
    parallelism: ParallelismConfig = ParallelismConfig()
    placement: PlacementConfig = PlacementConfig()
    ingress: IngressConfig = IngressConfig()

    @model_validator(mode="after")
    def _consistent(self) -> AppConfig:
        p = self.parallelism
        if self.engine.backend == "reference":
            problems = []
            if p.pp != 1:
                problems.append(f"parallelism.pp={p.pp}: the reference engine has no pipeline "
                                "parallelism (allowed: 1)")
            if p.attention_dp != 1:
                problems.append(f"parallelism.attention_dp={p.attention_dp}: the reference "
                                "engine supports only 1")
            if self.engine.reference.device == "cuda" and self.placement.accelerator != "GPU":
                problems.append("engine.reference.device='cuda' needs placement.accelerator='GPU'")
            if problems:
                raise ValueError("; ".join(problems))
        spec = self.engine.reference.speculation
        if spec.enabled and self.models.draft is None and self.engine.backend == "reference":
            raise ValueError("engine.reference.speculation.enabled=true needs models.draft "
                             "(or set enabled: false)")
        return self

    # --- placement ------------------------------------------------------------------------------

    @property
    def strategy(self) -> str:
        if self.placement.strategy != "auto":
            return self.placement.strategy
        return "STRICT_PACK" if self.parallelism.nodes == 1 else "STRICT_SPREAD"

    def bundles(self) -> list[dict[str, float]]:
        """One bundle per node. The replica process is rank 0, so it takes one rank's share of
        bundle 0."""
        p, pl = self.parallelism, self.placement
        bundle: dict[str, float] = {"CPU": pl.cpus_per_rank * p.devices_per_node}
        if pl.accelerator == "GPU":
            bundle["GPU"] = float(p.devices_per_node)
        return [dict(bundle) for _ in range(p.nodes)]
