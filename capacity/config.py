"""The planner's input tree (pydantic v2), validated once where input enters."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from capacity.errors import CapacityError
from capacity.formats import KvDtype, WeightFormat

# SGLang's published K3 recipe on H200 runs with --mem-fraction-static 0.85.
DEFAULT_MEM_FRACTION = 0.85
# Mean DSpark acceptance length (bonus included) over the 10 benchmarks of the draft's model card
# (RadixArk/Kimi-K3-DSpark).
DEFAULT_ACCEPTANCE_LENGTH = 3.45
DEFAULT_GAMMA = 7

M = TypeVar("M", bound=BaseModel)


class Parallelism(BaseModel):
    """How one replica's ranks are laid out, in SGLang's terms: the one layout model of the
    planner (`Layout`) and the app's config tree (`parallelism`, serve_app.config).

    `tp` x `pp` ranks (SGLang's tp_size x pp_size) spread evenly over `nodes`, so the devices
    used per node follow from them. Attention runs `tp / attention_dp`-way tensor parallel in
    `attention_dp` groups; the MoE layers of a stage's `tp` ranks form one expert-parallel group
    of `ep` ranks, with MoE tensor parallelism `tp / ep` inside it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tp: int = Field(default=1, ge=1, description="tensor-parallel ranks per pipeline stage")
    pp: int = Field(default=1, ge=1, description="pipeline stages (reference engine: 1)")
    ep: int = Field(default=1, ge=1, description="expert-parallel size (divides tp)")
    attention_dp: int = Field(default=1, ge=1, description="attention data parallel (divides "
                              "tp)")
    nodes: int = Field(default=1, ge=1, description="nodes per replica (one bundle each)")
    dcp: int = Field(default=1, ge=1, description="decode context parallel size (SGLang's "
                     "dcp_size, divides the attention TP): each rank of a DCP group holds "
                     "1/dcp of every request's MLA KV")

    # How errors name the fields: the app's config tree says "parallelism.tp".
    _field_prefix: ClassVar[str] = ""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def devices_per_node(self) -> int:
        """GPUs (or CPU rank slots) used on each node."""
        return self.world_size // self.nodes

    @property
    def attention_tp(self) -> int:
        return self.tp // self.attention_dp

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    @model_validator(mode="after")
    def _layout(self) -> Parallelism:
        f = self._field_prefix
        if self.world_size % self.nodes:
            raise ValueError(
                f"{f}tp ({self.tp}) x {f}pp ({self.pp}) = {self.world_size} ranks must split "
                f"evenly over {f}nodes ({self.nodes})")
        if self.tp % self.attention_dp:
            raise ValueError(f"{f}attention_dp ({self.attention_dp}) must divide {f}tp "
                             f"({self.tp})")
        if self.attention_tp % self.dcp:
            raise ValueError(f"{f}dcp ({self.dcp}) must divide the attention TP "
                             f"({f}tp / {f}attention_dp = {self.attention_tp}): SGLang forms "
                             "decode context parallel groups of consecutive TP ranks")
        # The one expert-parallel rule (SGLang's: ep_size divides tp_size).
        if self.tp % self.ep:
            raise ValueError(f"{f}ep ({self.ep}) must divide {f}tp, the ranks of a stage "
                             f"({self.tp})")
        return self


# SGLang 0.5.23's hybrid radix-cache strategies the planner sizes (--mamba-radix-cache-strategy;
# `auto` resolves to extra_buffer for K3): see capacity.memory.mamba_slots_per_request.
MAMBA_STRATEGIES = ("extra_buffer", "extra_buffer_lazy")
DEFAULT_MAMBA_STRATEGY = "extra_buffer"


class Layout(Parallelism):
    """One engine replica: its parallelism (the app's field names), its GPUs, how weights
    and KV are stored, and the SGLang memory levers that change what a GPU (or its host)
    holds: the KDA state slots per request (`mamba_strategy`), the HiCache host tier
    (`hicache_ratio`, 0: off) and EPLB's redundant experts (`redundant_experts`)."""

    gpu: str = Field(min_length=1)
    weight_format: WeightFormat | None = Field(
        default=None, description="None: the checkpoint's own format"
    )
    kv_dtype: KvDtype = KvDtype.BF16
    mem_fraction: float = Field(default=DEFAULT_MEM_FRACTION, gt=0, le=0.98)
    mamba_strategy: Literal["extra_buffer", "extra_buffer_lazy"] = DEFAULT_MAMBA_STRATEGY
    hicache_ratio: float = Field(default=0.0, ge=0, description="SGLang's --hicache-ratio: "
                                 "host pool / device pool per rank; 0: HiCache off")
    redundant_experts: int = Field(default=0, ge=0, description="SGLang's "
                                   "--ep-num-redundant-experts (EPLB)")

    @property
    def gpus_per_node(self) -> int:
        return self.devices_per_node

    @property
    def total_gpus(self) -> int:
        return self.world_size

    def label(self) -> str:
        parts = [f"{self.nodes}x{self.gpus_per_node} {self.gpu}", f"TP{self.attention_tp}"]
        if self.attention_dp > 1:
            parts.append(f"DP{self.attention_dp}")
        parts.append(f"EP{self.ep}")
        if self.pp > 1:
            parts.append(f"PP{self.pp}")
        if self.dcp > 1:
            parts.append(f"DCP{self.dcp}")
        return " ".join(parts)

    def levers_label(self) -> str:
        """The non-default memory levers, short ('' when none)."""
        parts = []
        if self.mamba_strategy == "extra_buffer_lazy":
            parts.append("lazy")
        if self.hicache_ratio:
            parts.append(f"HiCache {self.hicache_ratio:g}x")
        if self.redundant_experts:
            parts.append(f"EPLB +{self.redundant_experts}")
        return ", ".join(parts)


class Speculation(BaseModel):
    """Speculative decoding with a draft: gamma drafts verified in a window of gamma + 1."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gamma: int = Field(default=DEFAULT_GAMMA, gt=0)
    acceptance_length: float = Field(default=DEFAULT_ACCEPTANCE_LENGTH, ge=1.0)
    # True: acceptance_length is the verify-all value of a workload and SGLang's adaptive
    # verify trims it (and the verified width) as the batch grows (capacity.acceptance);
    # False: every step verifies gamma + 1 positions and accepts acceptance_length.
    adaptive_verify: bool = False

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
        acceptance length (the default workload's, capacity/data/dspark_acceptance.csv), trimmed
        by SGLang's adaptive verify where the layout verifies adaptively: what `kimi-capacity`
        assumes when no --workload or --acceptance is given."""
        return cls(gamma=draft.draft.block_size if draft.draft else DEFAULT_GAMMA,
                   adaptive_verify=True)


# Pillow's Image.MAX_IMAGE_PIXELS: above it Pillow warns of a decompression bomb (and refuses
# at twice it), so no server decodes a larger image; the planner refuses to price one.
MAX_IMAGE_PIXELS = 89_478_485
DEFAULT_IMAGE_SIZE = (1024, 1024)


class Images(BaseModel):
    """The images each request carries: how many, and their size as uploaded (all alike)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    per_request: int = Field(default=0, ge=0, description="images per request")
    width: int = Field(default=DEFAULT_IMAGE_SIZE[0], gt=0, description="pixels")
    height: int = Field(default=DEFAULT_IMAGE_SIZE[1], gt=0, description="pixels")

    @model_validator(mode="after")
    def _decodable(self) -> Images:
        pixels = self.width * self.height
        if pixels > MAX_IMAGE_PIXELS:
            raise ValueError(
                f"a {self.width}x{self.height} image is {pixels:,} pixels, above "
                f"{MAX_IMAGE_PIXELS:,} (Pillow's decompression-bomb limit; no server decodes it)")
        return self

    @property
    def label(self) -> str:
        return f"{self.per_request} x {self.width}x{self.height}"


class Workload(BaseModel):
    """What each request holds: its context length (image tokens included), its images, and
    engine knobs that size per-request memory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    context_length: int = Field(gt=0)
    images: Images = Field(default_factory=Images)
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
