"""The planner's input tree (pydantic v2), validated once where input enters."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from capacity.errors import CapacityError
from capacity.formats import KvDtype, WeightFormat

# SGLang's published K3 recipe on H200 runs with --mem-fraction-static 0.85.
DEFAULT_MEM_FRACTION = 0.85
# Mean DSpark acceptance length (bonus included) over the draft card's 10 benchmarks (dspark.md).
DEFAULT_ACCEPTANCE_LENGTH = 3.45
DEFAULT_GAMMA = 7

M = TypeVar("M", bound=BaseModel)


class Layout(BaseModel):
    """One engine replica: GPUs, how they are split, and how weights and KV are stored.

    attention_tp x attention_dp x pipeline_stages must equal nodes x gpus_per_node; the
    stage's GPUs form one expert-parallel group of `expert_parallel` ranks (with MoE tensor
    parallelism of stage_gpus / expert_parallel inside it).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: str = Field(min_length=1)
    gpus_per_node: int = Field(gt=0)
    nodes: int = Field(default=1, gt=0)
    attention_tp: int = Field(gt=0)
    attention_dp: int = Field(default=1, gt=0)
    expert_parallel: int = Field(gt=0)
    pipeline_stages: int = Field(default=1, gt=0)
    weight_format: WeightFormat | None = Field(
        default=None, description="None: the checkpoint's own format"
    )
    kv_dtype: KvDtype = KvDtype.BF16
    mem_fraction: float = Field(default=DEFAULT_MEM_FRACTION, gt=0, le=0.98)

    @model_validator(mode="after")
    def _consistent(self) -> Layout:
        total = self.nodes * self.gpus_per_node
        used = self.attention_tp * self.attention_dp * self.pipeline_stages
        if used != total:
            raise ValueError(
                f"attention_tp ({self.attention_tp}) x attention_dp ({self.attention_dp}) x "
                f"pipeline_stages ({self.pipeline_stages}) = {used} must equal nodes "
                f"({self.nodes}) x gpus_per_node ({self.gpus_per_node}) = {total}"
            )
        if self.stage_gpus % self.expert_parallel:
            raise ValueError(
                f"expert_parallel ({self.expert_parallel}) must divide the GPUs of one pipeline "
                f"stage ({self.stage_gpus})"
            )
        return self

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def stage_gpus(self) -> int:
        return self.attention_tp * self.attention_dp

    @property
    def moe_tp(self) -> int:
        return self.stage_gpus // self.expert_parallel

    def label(self) -> str:
        parts = [f"{self.nodes}x{self.gpus_per_node} {self.gpu}", f"TP{self.attention_tp}"]
        if self.attention_dp > 1:
            parts.append(f"DP{self.attention_dp}")
        parts.append(f"EP{self.expert_parallel}")
        if self.pipeline_stages > 1:
            parts.append(f"PP{self.pipeline_stages}")
        return " ".join(parts)


class Speculation(BaseModel):
    """Speculative decoding with a draft: gamma drafts verified in a window of gamma + 1."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gamma: int = Field(default=DEFAULT_GAMMA, gt=0)
    acceptance_length: float = Field(default=DEFAULT_ACCEPTANCE_LENGTH, ge=1.0)

    @model_validator(mode="after")
    def _acceptance_in_window(self) -> Speculation:
        if self.acceptance_length > self.gamma + 1:
            raise ValueError(
                f"acceptance_length ({self.acceptance_length}) cannot exceed gamma + 1 "
                f"({self.gamma + 1})"
            )
        return self

    @classmethod
    def for_draft(cls, draft: Any) -> Speculation:
        """The draft's own block size as gamma (DSpark's default window), the default
        acceptance length."""
        return cls(gamma=draft.draft.block_size if draft.draft else DEFAULT_GAMMA)


class Workload(BaseModel):
    """What each request holds: its context length, and engine knobs that size per-request
    memory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    context_length: int = Field(gt=0)
    kda_state_slots: int = Field(
        default=1, gt=0, description="KDA states kept per request (prefix-cache slots)"
    )
    prefill_chunk_tokens: int = Field(default=8192, gt=0)


def validated(model: type[M], **values: object) -> M:
    """Builds a config model, turning pydantic's error into one line naming the field."""
    try:
        return model(**values)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        prefix = f"{model.__name__.lower()}.{where}: " if where else f"{model.__name__.lower()}: "
        raise CapacityError(prefix + message) from None
