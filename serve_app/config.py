"""The one config tree of the Serve app, validated once at the edge (the builder's argument).

Deployment files (`deployments/*.yaml`) differ only in values. Paths may name a committed asset
as `embedded:NAME` (a folder under `serve_app/assets/`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from capacity.config import Parallelism
from capacity.sglang_recipe import SGLANG_OPTIONAL as _SGO
from capacity.sglang_recipe import SGLANG_SECTION as _SG
from serve_app.models.config_files import read_config_json
from serve_app.models.dspark_config import DSparkConfig, pair_context
from serve_app.models.k3_config import K3Config
from serve_app.models.kimi_config import KimiConfig
from serve_app.models.target_config import load_target_config
from serve_app.observability.tracing import TracingConfig
from serve_app.protocol.grammar import ToolStrictLevel
from serve_app.routing.settings import AutoscalingSettings, RouterSettings
from serve_app.vision import ImagePolicy, MediaConfig

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


class ParallelismConfig(Parallelism):
    """`parallelism`: how one replica's ranks are laid out. The planner's own layout model
    (capacity.config.Parallelism: the same fields, the same rules, the one expert-parallel
    rule); the reference engine creates exactly `tp` ranks (it has no pipeline stages)."""

    _field_prefix: ClassVar[str] = "parallelism."

    @model_validator(mode="before")
    @classmethod
    def _derived(cls, data: Any) -> Any:
        if isinstance(data, dict) and "devices_per_node" in data:
            raise ValueError("parallelism.devices_per_node is not a field: it follows from "
                             "parallelism.tp x parallelism.pp / parallelism.nodes; remove it")
        return data


class PlacementConfig(_Strict):
    accelerator: Literal["GPU", "CPU"] = "GPU"
    strategy: Literal["auto", "STRICT_PACK", "STRICT_SPREAD", "PACK", "SPREAD"] = Field(
        default="auto", description="auto: STRICT_PACK on one node, STRICT_SPREAD across nodes")
    cpus_per_rank: float = Field(default=1.0, gt=0, description="CPU reserved per rank worker; "
                                 "keep small on small machines")
    replicas: int = Field(default=1, ge=1, description="target replicas (engines); with "
                          "`autoscaling`, Serve's to change within its bounds")
    autoscaling: AutoscalingSettings | None = Field(default=None, description="replicas that "
                                                  "follow load; None: `replicas`, fixed")
    gpu_type: str | None = Field(default=None, description="GPU model of the nodes (a row of "
                                 "capacity/data/gpus.csv, e.g. H200, B300, MI355X, MI300X); "
                                 "the SGLang backend checks that the weights fit it")


class IngressConfig(_Strict):
    """The OpenAI edge: limits every request meets before it is tokenized, and who may call."""

    default_max_tokens: int = Field(default=256, gt=0)
    max_tokens_limit: int = Field(default=8192, gt=0)
    max_ongoing_requests: int = Field(default=256, gt=0)
    ingress_cpus: float = Field(default=0.1, ge=0)
    max_body_bytes: int | None = Field(default=None, gt=0, description="larger request bodies "
                                       "get 413; default: 16 bytes per token of the context "
                                       "length + 64 KiB (JSON-escaped text or token ids), "
                                       "+ 64 MiB when the model takes images")
    api_keys: list[str] = Field(default_factory=list, description="bearer keys accepted "
                                "(empty, and no keys in api_keys_env: no authentication); "
                                "prefer api_keys_env, files in a repo leak")
    api_keys_env: str | None = Field(default="KIMI_DSPARK_API_KEYS", description="environment "
                                     "variable of the ingress process holding comma-separated "
                                     "keys, added to api_keys")
    expose_docs: bool = Field(default=False, description="serve /docs and /openapi.json "
                              "(behind the key when keys are set)")
    tokenizer_threads: int = Field(default=2, gt=0, description="threads that tokenize off the "
                                   "event loop")
    health_cache_s: float = Field(default=1.0, ge=0, description="GET /health reuses a target "
                                  "replica's answer for this long")
    health_timeout_s: float = Field(default=3.0, gt=0, description="GET /health is 503 when no "
                                    "target replica answers within this")
    retry_after_s: int = Field(default=5, gt=0, description="Retry-After of 503 answers")
    sse_keepalive_s: float | None = Field(default=15.0, gt=0, description=(
        "a streamed answer that has sent nothing for this long gets an SSE comment line, "
        "which clients skip and read timeouts (the client's, a proxy's) count as traffic: a "
        "typed tool argument that no grammar holds to JSON is sent whole once it closes, and "
        "may take minutes; null: none"))
    replicas: int = Field(default=1, ge=1, description="ingress replicas (each runs its own "
                          "router admission stage, a hint; the target replicas' own ledgers "
                          "decide, so several never over-commit one: docs/router.md)")

    @model_validator(mode="after")
    def _keys(self) -> IngressConfig:
        bad = [i for i, k in enumerate(self.api_keys) if len(k) < 8 or k != k.strip()]
        if bad:
            raise ValueError(f"ingress.api_keys{bad}: keys need at least 8 characters and no "
                             "surrounding whitespace")
        return self


class ApiConfig(_Strict):
    """How the served model's API behaves beyond OpenAI's shapes."""

    parameter_policy: Literal["k3", "open"] = Field(
        default="open", description="k3: Kimi K3's sampling contract (temperature in [0, 1], "
        "default 1.0 thinking / 0.6 not; top_p 0.95, unset or 1.0 taken as 0.95; other values "
        "a 400), as Moonshot verifies vendors; open: any value OpenAI allows")
    tool_strict_level: ToolStrictLevel = Field(
        default="off", description="the server's tool strictness, SGLang's "
        "SGLANG_TOOL_STRICT_LEVEL 0/1/2 for K3: off: a call's arguments are constrained only for "
        "tools declared `strict: true` (OpenAI's contract), the structure of calls under "
        "tool_choice auto only when a strict tool is declared; function: the structure of "
        "calls under auto is constrained for every tools request; parameter: as function, and "
        "every declared tool is treated as strict (its arguments validate against its "
        "parameters wherever a call is constrained)")


class SGLangSettings(_Strict):
    """SGLang 0.5.23 server arguments that are not derived from elsewhere in the tree.

    Model paths come from `models`, tp/ep/attention-DP/nnodes from `parallelism`; the one
    mapping to SGLang's argument names is `serve_app.engines.sglang.args.sglang_server_args`.
    Every default is `capacity.sglang_recipe`'s (the published K3 + DSpark recipe on 2 x 8
    H200, else SGLang's own default from its flag table), which the planner writes into the
    files it emits.
    """

    context_length: int = Field(default=_SG["context_length"], gt=0)
    mem_fraction_static: float = Field(default=_SG["mem_fraction_static"], gt=0, lt=1)
    kv_cache_dtype: Literal["auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = (
        _SG["kv_cache_dtype"])
    chunked_prefill_size: int = Field(default=_SG["chunked_prefill_size"],
                                      description="-1 disables chunked prefill")
    # The planner sizes it (capacity.memory.running_fit): every running request holds
    # fixed-size KDA states (radix-cache slots + one per verified draft position), which leave
    # the KV pool room for one full-context request.
    max_running_requests: int = Field(default=_SG["max_running_requests"], gt=0)
    # KDA state slots (SGLang's mamba pool). Unset, SGLang 0.5.23 gives the states
    # mamba_full_memory_ratio / (1 + ratio) (0.9 / 1.9: about half) of the memory left after
    # the weights, and the MLA KV only the rest; the planner sets it to what the running
    # requests need (max_running_requests x 5 slots with extra_buffer).
    max_mamba_cache_size: int | None = Field(default=_SG["max_mamba_cache_size"], gt=0)
    mamba_ssm_dtype: Literal["float32", "bfloat16", "float16"] | None = _SG["mamba_ssm_dtype"]
    # Prefix (radix) caching of hybrid models: extra_buffer keeps 2 ping-pong state slots per
    # request (counted by the planner); no_buffer would turn the overlap scheduler off and needs
    # page_size 1.
    mamba_radix_cache_strategy: Literal["auto", "no_buffer", "extra_buffer",
                                        "extra_buffer_lazy"] = _SG["mamba_radix_cache_strategy"]
    # SGLang's HiCache: a host (CPU RAM) tier of hicache_ratio x each device pool (MLA KV and
    # KDA state) keeping prefixes between an agent's turns (capacity.levers.choose_levers sizes
    # it from the node's host RAM). Written to the config tree only when on (the serializer
    # below).
    enable_hierarchical_cache: bool = Field(
        default=_SGO["enable_hierarchical_cache"], description=(
            "SGLang's --enable-hierarchical-cache: tier the radix cache's MLA KV and KDA states "
            "to host memory"))
    hicache_ratio: float | None = Field(
        default=_SGO["hicache_ratio"], gt=0, description=(
            "SGLang's --hicache-ratio: host pool / device pool per rank (None: SGLang sizes it "
            "to the host's memory); only with enable_hierarchical_cache"))
    speculative_algorithm: Literal["DSPARK"] | None = _SG["speculative_algorithm"]
    speculative_dspark_block_size: int = Field(default=_SG["speculative_dspark_block_size"],
                                               gt=0, description="gamma: drafts per verify "
                                               "step (window gamma + 1)")
    # How the speculative verify rolls K3's KDA states back (capacity.memory.kda_rollback_costs,
    # docs/capacity.md): off, SGLang keeps a full state per verified position (scratch); on,
    # every mamba slot carries a ring of the window's inputs and the commit replays the accepted
    # prefix (no intermediate_ssm). Written to the config tree only when on (the serializer
    # below), so that files generated for the default stay as they were.
    enable_linear_replayssm_spec: bool = Field(
        default=_SGO["enable_linear_replayssm_spec"], description=(
            "SGLang's --enable-linear-replayssm-spec: the KDA verify keeps a per-slot ring of "
            "the window's raw inputs and replays the accepted prefix at commit, instead of a "
            "full state per verified position; needs speculative_algorithm"))
    linear_replayssm_cache_len: int = Field(
        default=_SGO["linear_replayssm_cache_len"], ge=1, description=(
            "SGLang's --linear-replayssm-cache-len: the replay ring's length L per mamba slot; "
            "a power of two >= 2 x speculative_num_draft_tokens (DSPARK: block_size + 1). Only "
            "with enable_linear_replayssm_spec"))
    # SGLang's adaptive DSpark verify (capacity/dspark_verify.py, docs/speculation.md). Written
    # to the config tree only when not the default (the serializer below).
    ragged_verify_mode: Literal["static", "cap-accept", "compact"] = Field(
        default=_SGO["ragged_verify_mode"], description=(
            "SGLANG_RAGGED_VERIFY_MODE (the app's runtime_env carries it to the schedulers): "
            "static verifies every draft; compact verifies per request only the drafts the "
            "SPS cost table and the draft's confidence say pay, and none when none do; "
            "cap-accept plans the same but verifies everything (a measurement mode)"))
    speculative_dspark_sps_table_path: str | None = Field(
        default=_SGO["speculative_dspark_sps_table_path"], description=(
            "the step-cost (SPS) table the adaptive verify plans with, on the GPU nodes; made "
            "with sglang.benchmark.dspark_sps_profiler (docs/speculation.md); needed by "
            "compact and cap-accept"))
    speculative_dspark_confidence_sts_path: str | None = Field(
        default=_SGO["speculative_dspark_confidence_sts_path"], description=(
            "optional per-position temperatures calibrating the draft's confidence head "
            "(sglang.benchmark.dspark_sts_fit); adaptive modes only"))
    speculative_dspark_align_verify_tokens_to_graph_tier: bool = Field(
        default=_SGO["speculative_dspark_align_verify_tokens_to_graph_tier"], description=(
            "compact: fill each step's verify tokens up to the CUDA-graph bucket the forward "
            "is padded to anyway, with the next most confident drafts"))
    speculative_draft_attention_backend: str | None = _SG["speculative_draft_attention_backend"]
    moe_runner_backend: str | None = _SG["moe_runner_backend"]
    decode_attention_backend: str | None = _SG["decode_attention_backend"]
    trust_remote_code: bool = _SG["trust_remote_code"]
    enable_metrics: bool = _SG["enable_metrics"]
    # Packaged capacity-planner descriptors used for the start-up checks when the checkpoints
    # are not on the machine that runs `serve run` (production paths live on the GPU nodes).
    planner_model: str = _SG["planner_model"]
    planner_draft: str | None = _SG["planner_draft"]
    # SGLang's radix-cache events, followed into the router's prefix index
    # (serve_app/engines/sglang/kv_events.py, docs/prefix-cache.md): the rank-0 scheduler (on
    # the replica's node: RayEngine co-locates them) binds a loopback PUB socket the replica
    # subscribes to. Written to the config tree only when not the default (the serializer
    # below), so that files generated for the default stay as they were.
    kv_events: bool = Field(default=_SGO["kv_events"], description=(
        "publish SGLang's KV cache events (--kv-events-config, managed) and follow them into "
        "the router's prefix index; needs pyzmq and msgspec (SGLang's own dependencies)"))
    kv_events_port: int = Field(default=_SGO["kv_events_port"], ge=0, le=65535, description=(
        "loopback port of the publisher (attention-DP rank r: port + r); 0: free ports picked "
        "on the replica's node when it starts"))
    extra_server_args: dict[str, Any] = Field(default_factory=dict, description="any other "
                                              "SGLang ServerArgs field; checked against 0.5.23")

    @model_validator(mode="after")
    def _hicache(self) -> SGLangSettings:
        if self.hicache_ratio is not None and not self.enable_hierarchical_cache:
            raise ValueError("engine.sglang.hicache_ratio is used only with "
                             "engine.sglang.enable_hierarchical_cache: true")
        return self

    @model_validator(mode="after")
    def _replayssm_spec(self) -> SGLangSettings:
        """SGLang 0.5.23's own rules for the ReplaySSM verify (sglang/srt/
        arg_groups/attention_hook.py:434-525, mem_cache/memory_pool.py:818-834), checked here
        rather than when the scheduler allocates its pools."""
        ring = self.linear_replayssm_cache_len
        field = "engine.sglang.linear_replayssm_cache_len"
        if not self.enable_linear_replayssm_spec:
            if ring != _SGO["linear_replayssm_cache_len"]:
                raise ValueError(f"{field}={ring} is used only with "
                                 "engine.sglang.enable_linear_replayssm_spec: true")
            return self
        flag = "engine.sglang.enable_linear_replayssm_spec"
        if self.speculative_algorithm is None:
            raise ValueError(f"{flag}: true is the speculative verify's rollback: it needs "
                             "engine.sglang.speculative_algorithm")
        draft_tokens = self.speculative_dspark_block_size + 1  # DSPARK: gamma + 1
        if ring & (ring - 1):
            raise ValueError(f"{field}={ring} must be a power of two (SGLang's KDA ring)")
        if ring < 2 * draft_tokens:
            raise ValueError(
                f"{field}={ring} must be >= 2 x speculative_num_draft_tokens = {2 * draft_tokens} "
                f"(speculative_dspark_block_size {self.speculative_dspark_block_size} + 1; "
                "SGLang's early-flush margin)")
        extra = self.extra_server_args
        if extra.get("speculative_eagle_topk") not in (None, 1):
            raise ValueError(f"{flag} needs a linear draft chain: extra_server_args."
                             f"speculative_eagle_topk={extra['speculative_eagle_topk']!r} is a tree")
        decode = extra.get("linear_attn_decode_backend") or extra.get("linear_attn_backend",
                                                                      "triton")
        if decode == "flashkda" and not extra.get("linear_attn_decode_backend"):
            decode = "triton"  # FlashKDA is prefill-only: SGLang decodes with triton then
        if decode not in ("triton", "flashinfer"):
            raise ValueError(f"{flag} needs the triton or flashinfer linear-attn decode "
                             f"backend; extra_server_args give {decode!r}")
        if extra.get("enable_linear_replayssm"):
            raise ValueError(f"{flag} and extra_server_args.enable_linear_replayssm are mutually "
                             "exclusive (SGLang: they drive one ring two ways)")
        return self

    @model_validator(mode="after")
    def _ragged_verify(self) -> SGLangSettings:
        """SGLang 0.5.23's adaptive DSpark verify: a table where it plans (without one it
        verifies everything, silently no gain), nothing that it would ignore."""
        mode, table = self.ragged_verify_mode, self.speculative_dspark_sps_table_path
        field = "engine.sglang.ragged_verify_mode"
        if mode == "static":
            for name in ("speculative_dspark_sps_table_path",
                         "speculative_dspark_confidence_sts_path",
                         "speculative_dspark_align_verify_tokens_to_graph_tier"):
                if getattr(self, name) != _SGO[name]:
                    raise ValueError(f"engine.sglang.{name} is used only by the adaptive "
                                     f"verify: {field} static ignores it")
            return self
        if self.speculative_algorithm != "DSPARK":
            raise ValueError(f"{field}={mode!r} plans DSpark verify windows: it needs "
                             "engine.sglang.speculative_algorithm DSPARK")
        if table is None:
            raise ValueError(f"{field}={mode!r} needs engine.sglang."
                             "speculative_dspark_sps_table_path: without a table SGLang "
                             "verifies every draft (no gain); docs/speculation.md says how "
                             "to make one")
        if self.speculative_dspark_align_verify_tokens_to_graph_tier and mode != "compact":
            raise ValueError("engine.sglang.speculative_dspark_align_verify_tokens_to_graph_"
                             f"tier is a compact-verify option; {field} is {mode!r}")
        return self

    @model_serializer(mode="wrap")
    def _replayssm_only_when_on(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in ("ragged_verify_mode", "speculative_dspark_sps_table_path",
                     "speculative_dspark_confidence_sts_path",
                     "speculative_dspark_align_verify_tokens_to_graph_tier"):
            if data.get(name) == _SGO[name]:
                data.pop(name, None)
        if not self.enable_linear_replayssm_spec:
            # Off, both are at their defaults (checked above) and SGLang is not given them.
            data.pop("enable_linear_replayssm_spec", None)
            data.pop("linear_replayssm_cache_len", None)
        if not self.enable_hierarchical_cache:
            data.pop("enable_hierarchical_cache", None)
            data.pop("hicache_ratio", None)
        elif self.hicache_ratio is None:
            data.pop("hicache_ratio", None)
        if (self.kv_events, self.kv_events_port) == (_SGO["kv_events"], _SGO["kv_events_port"]):
            data.pop("kv_events", None)
            data.pop("kv_events_port", None)
        return data


class RouterConfig(RouterSettings):
    """The long-context router (docs/router.md): every field, default and description is
    `serve_app.routing.settings.RouterSettings`; two have a config-only `null` default, resolved
    from the deployment by `settings`."""

    long_threshold: int | None = Field(  # type: ignore[assignment]
        default=None, gt=0, description="prompt tokens from which a request is in the long "
        "class; default: the context length / 32 (32,768 at K3's 1,048,576)")
    share_prefix: bool | None = Field(  # type: ignore[assignment]
        default=None, description="count prefix blocks shared by in-flight requests once; "
        "default: true where the engine has a prefix cache (sglang's radix cache, or "
        "engine.reference.prefix_cache.enabled)")

    def settings(self, backend: str, context_length: int,
                 prefix_cache: bool = False) -> RouterSettings:
        """The settings the router runs with: the `null` defaults resolved (the one place).
        `prefix_cache`: whether the reference engine caches prefixes."""
        values = self.model_dump()
        if values["share_prefix"] is None:
            values["share_prefix"] = backend == "sglang" or prefix_cache
        if values["long_threshold"] is None:
            values["long_threshold"] = max(1, context_length // 32)
        if values["policy"] == "ray_default":
            values["policy"] = "kv_aware"  # unused: the ingress bypasses the router
        return RouterSettings(**values)


# A decode pool's long_threshold: no prompt is long there (`AppConfig.admission`).
NO_LONG_CLASS = 1 << 62


def prefill_cap(prefill_chunk_tokens: int, max_prefill_tokens_per_request: int | None) -> int:
    """A prompt's share of one step's prefill budget: the setting, checked, or by default a
    quarter of the budget (at least 1). The one check, for the config and the scheduler."""
    cap = max_prefill_tokens_per_request
    if cap is None:
        return max(1, prefill_chunk_tokens // 4)
    if cap < 1:
        raise ValueError(f"max_prefill_tokens_per_request={cap} must be >= 1")
    if cap > prefill_chunk_tokens:
        raise ValueError(f"max_prefill_tokens_per_request={cap} must be <= "
                         f"prefill_chunk_tokens={prefill_chunk_tokens}")
    return cap


class SpeculationConfig(BaseModel):
    """`engine.reference.speculation`, taken by EngineCore as is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    gamma: int | None = Field(default=None, ge=1, description="drafts verified per step; "
                              "default: the draft's block_size")
    adaptive: bool = Field(default=True, description=(
        "choose every step, per request, how many drafts to verify (0..gamma; 0 is a plain "
        "decode row) from the draft's confidence, measured acceptance and the engine's measured "
        "step cost, and skip the draft when no window pays (engines/reference/spec_budget.py). "
        "False: every request verifies gamma drafts (or confidence_threshold's count)"))
    cost_table: str | None = Field(default=None, description=(
        "adaptive: a JSON file holding the fitted step-cost model, read at start and rewritten "
        "as it learns, so a restarted replica plans from its last fit (one file per deployment "
        "and machine type). None: learned afresh each start"))
    confidence_threshold: float = Field(default=0.0, ge=0.0, lt=1.0, description=(
        "not adaptive: verify drafts while their cumulative acceptance estimate stays >= this; "
        "0 = all"))
    max_batch_size: int | None = Field(default=None, ge=1, description=(
        "speculate only while a decode step has at most this many requests; a larger step "
        "proposes no drafts (a plain target decode; the draft's context still follows, so "
        "speculation resumes when the batch shrinks), because there verifying drafts costs "
        "more than they save. None: always. Measure the crossover with bench/spec_decode.py "
        "--concurrency"))
    kda_rollback: Literal["scratch", "replay"] = Field(default="replay", description=(
        "how a hybrid (KDA) target keeps the state of the last accepted draft: 'replay' (the "
        "default) computes the verify window lazily, its outputs without any per-position "
        "state, and forms only the accepted position's state at commit (SGLang's "
        "--enable-linear-replayssm-spec keeps the window's inputs and replays them); "
        "'scratch' keeps the state after every verified position and copies the accepted one "
        "back (SGLang's default)"))


class PrefixCacheConfig(BaseModel):
    """`engine.reference.prefix_cache`: the radix cache over token pages
    (serve_app/engines/reference/prefix_cache.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    snapshot_interval: int = Field(default=64, gt=0, description=(
        "hybrid targets: a KDA state snapshot every this many prompt tokens (prefill chunks "
        "end on this grid), the only positions a later request can resume from; a multiple "
        "of page_size"))
    decode_snapshot_interval: int = Field(default=256, gt=0, description=(
        "hybrid targets: a KDA state snapshot every this many tokens while decoding (SGLang's "
        "mamba_track_interval), so a conversation's earlier answers are reusable too; a "
        "multiple of page_size"))
    state_snapshots: int = Field(default=32, gt=0, description=(
        "hybrid targets: KDA state slots kept for cached snapshots (each as large as a running "
        "request's state), evicted least recently used"))


class ReferenceEngineConfig(BaseModel):
    """`engine.reference`: the plain-PyTorch engine (serve_app/engines/reference), which takes
    it as it is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    kv_capacity_tokens: int = Field(default=16384, gt=0)
    page_size: int = Field(default=16, gt=0)
    max_batch_size: int = Field(default=32, gt=0)
    state_slots: int | None = Field(default=None, gt=0, description=(
        "KDA state slots of a hybrid (Kimi K3) target, one per running request, allocated up "
        "front; default max_batch_size. Ignored for a K2-layout target"))
    prefill_chunk_tokens: int = Field(default=512, gt=0)
    max_prefill_tokens_per_request: int | None = Field(default=None, gt=0, description=(
        "the most prompt tokens one request prefills in a step, so that short prompts are not "
        "queued behind a long one; default a quarter of prefill_chunk_tokens (at least 1)"))
    speculation: SpeculationConfig = SpeculationConfig()
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig()
    grammar_budget: Literal["cut", "close"] = Field(default="cut", description=(
        "a constrained answer (json_schema, json_object, a forced or strict call) that "
        "reaches max_tokens: cut: it ends where the budget does, possibly unterminated "
        "(OpenAI's behaviour); close: the end of the budget is kept for finishing it (near "
        "the end the model may open nothing new, then its closing path is forced): the "
        "answer ends complete with its own finish_reason, and the choice says "
        "grammar_closed: true when that narrowed a token's choices "
        "(docs/constrained-decoding.md). For small or untrained models, which may never end "
        "a string"))

    @model_validator(mode="after")
    def _prefill_cap_fits_the_step(self) -> ReferenceEngineConfig:
        prefill_cap(self.prefill_chunk_tokens, self.max_prefill_tokens_per_request)
        for name in ("snapshot_interval", "decode_snapshot_interval"):
            value = getattr(self.prefix_cache, name)
            if value % self.page_size:
                raise ValueError(f"prefix_cache.{name}={value} must be a multiple of "
                                 f"page_size={self.page_size}")
        return self


class EngineSettings(_Strict):
    backend: Literal["reference", "sglang"] = "reference"
    reference: ReferenceEngineConfig = ReferenceEngineConfig()
    sglang: SGLangSettings = SGLangSettings()
    max_model_len: int | None = Field(default=None, gt=0, description="context limit; default "
                                      "the smaller of the two models' maximum")
    health_check_timeout_s: float = Field(default=30.0, gt=0)
    health_check_period_s: float = Field(default=5.0, gt=0, description="how often Serve "
                                         "checks each target replica (a replica that fails "
                                         "is replaced)")
    step_watchdog_s: float = Field(default=30.0, gt=0, description="an engine step (a "
                                   "forward and its collectives) running longer than this "
                                   "fails its requests (503) and marks the replica unhealthy")
    startup_timeout_s: float = Field(default=600.0, gt=0)


class ObservabilityConfig(_Strict):
    tracing: TracingConfig = TracingConfig()
    json_logs: bool = Field(default=True, description="replica logs as JSON lines with "
                            "request_id and trace_id")


class DisaggregationSide(_Strict):
    """One side of a disaggregated app: its replicas, their layout (default: the app's
    `parallelism`) and, with SGLang, the server arguments sized for that layout in place of
    `engine.sglang`'s (the planner writes those that differ from the other side's: the
    running requests and the KDA state pool that fit this side's GPUs)."""

    replicas: int = Field(default=1, ge=1)
    autoscaling: AutoscalingSettings | None = Field(default=None, description="this side's "
                                                  "pool follows its own load")
    parallelism: ParallelismConfig | None = None
    sglang: dict[str, Any] = Field(default_factory=dict, description=(
        "engine.sglang fields for this side's servers (engine.backend sglang), e.g. "
        "max_running_requests; each checked as engine.sglang's"))


class DisaggregationConfig(_Strict):
    """Prefill/decode disaggregation (docs/disaggregation.md): prefill replicas prefill each
    request, sample its first token and hand it over (its caches, KDA state, draft context)
    to a decode replica, which streams the answer through them; each side has its own
    placement groups and tensor-parallel size."""

    enabled: bool = False
    prefill: DisaggregationSide = DisaggregationSide()
    decode: DisaggregationSide = DisaggregationSide()
    # SGLang's own disaggregation (engine.backend sglang: --disaggregation-mode per side); the
    # reference engine hands over through Ray's object store and uses none of these.
    transfer_backend: Literal["mooncake", "nixl"] = Field(
        default="mooncake", description="SGLang: the KV transfer backend "
        "(--disaggregation-transfer-backend; 0.5.23's default mooncake, or nixl). Both move "
        "K3's KDA states between different attention-TP sizes")
    bootstrap_port: int = Field(
        default=0, ge=0, le=65535, description="SGLang: the port of each prefill replica's "
        "bootstrap server (--disaggregation-bootstrap-port), which decode servers ask for "
        "the room's KV addresses; 0: a free port picked by each replica")
    ib_device: str | None = Field(
        default=None, description="SGLang: --disaggregation-ib-device (the RDMA devices, "
        "e.g. mlx5_0,mlx5_1); None: the transfer backend's own choice")


class AppConfig(_Strict):
    """Everything `build_app` needs: models, engine backend, parallelism, placement, ingress."""

    models: ModelsConfig
    engine: EngineSettings = EngineSettings()
    parallelism: ParallelismConfig = ParallelismConfig()
    placement: PlacementConfig = PlacementConfig()
    ingress: IngressConfig = IngressConfig()
    api: ApiConfig = ApiConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    router: RouterConfig = RouterConfig()
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    # The limits on the images clients send (a checkpoint without vision takes none).
    images: ImagePolicy = ImagePolicy()

    @model_validator(mode="after")
    def _consistent(self) -> AppConfig:
        p = self.parallelism
        for name in ("prefill", "decode"):
            if getattr(self.disaggregation, name).sglang:
                self._side_sglang(name)  # raises naming the side's field
        if self.disaggregation.enabled and self.placement.autoscaling is not None:
            raise ValueError("placement.autoscaling: a disaggregated app scales each pool on "
                             "its own load: set disaggregation.prefill.autoscaling and "
                             "disaggregation.decode.autoscaling instead")
        if not self.disaggregation.enabled and any(
                getattr(self.disaggregation, side).autoscaling is not None
                for side in ("prefill", "decode")):
            raise ValueError("disaggregation.*.autoscaling: for a disaggregated app "
                             "(disaggregation.enabled); use placement.autoscaling")
        if self.disaggregation.enabled and self.engine.backend == "reference":
            for name in ("prefill", "decode"):
                side = getattr(self.disaggregation, name).parallelism
                if side is not None and (side.pp != 1 or side.attention_dp != 1
                                         or side.dcp != 1):
                    raise ValueError(f"disaggregation.{name}.parallelism: the reference engine "
                                     "runs pp 1, attention_dp 1 and dcp 1")
        if self.engine.backend == "reference":
            problems = []
            if p.pp != 1:
                problems.append(f"parallelism.pp={p.pp}: the reference engine has no pipeline "
                                "parallelism (allowed: 1)")
            if p.attention_dp != 1:
                problems.append(f"parallelism.attention_dp={p.attention_dp}: the reference "
                                "engine supports only 1")
            if p.dcp != 1:
                problems.append(f"parallelism.dcp={p.dcp}: the reference engine has no decode "
                                "context parallelism (allowed: 1)")
            if self.engine.reference.device == "cuda" and self.placement.accelerator != "GPU":
                problems.append("engine.reference.device='cuda' needs placement.accelerator='GPU'")
            if problems:
                raise ValueError("; ".join(problems))
        spec = self.engine.reference.speculation
        if spec.enabled and self.models.draft is None and self.engine.backend == "reference":
            raise ValueError("engine.reference.speculation.enabled=true needs models.draft "
                             "(or set enabled: false)")
        return self

    def admission(self, role: Literal["both", "prefill", "decode"] = "both"
                  ) -> RouterSettings | None:
        """The router's admission settings for this config's target deployment (one side's,
        disaggregated: `role`); None where routing is left to Serve (`router.policy:
        ray_default`). The one place: the dispatchers' stages and the replicas' ledgers
        compute the same charge for the same request. A decode pool has no long class: its
        replicas adopt prefilled requests and run no prefill, so the long-prefill limits
        (one at a time per replica, on a share of the replicas) are the prefill pool's
        alone; on the decode pool they would hold a long prompt at the ingress while its
        decode replica only waits."""
        if self.router.policy == "ray_default":
            return None
        settings = self.router.settings(self.engine.backend, context_length(self),
                                        self.engine.reference.prefix_cache.enabled)
        if role == "decode":
            settings = settings.model_copy(update={"long_threshold": NO_LONG_CLASS})
        return settings

    def side(self, role: Literal["prefill", "decode"]) -> AppConfig:
        """The config a disaggregated side's replicas run: its replicas and parallelism in
        place of the app's. (Its autoscaling stays where it was written, under
        `disaggregation`: `autoscaling(role)`; the side's replicas validate this config
        again, and a disaggregated app refuses `placement.autoscaling`.)"""
        side = getattr(self.disaggregation, role)
        update: dict[str, Any] = {
            "parallelism": side.parallelism or self.parallelism,
            "placement": self.placement.model_copy(update={"replicas": side.replicas})}
        if side.sglang:
            update["engine"] = self.engine.model_copy(update={"sglang": self._side_sglang(role)})
        return self.model_copy(update=update)

    def autoscaling(self, role: Literal["both", "prefill", "decode"] = "both"
                    ) -> AutoscalingSettings | None:
        """The autoscaling of the target deployment of `role` (a disaggregated side's pool,
        or the aggregated app's); None: a fixed number of replicas."""
        if role == "both":
            return self.placement.autoscaling
        return getattr(self.disaggregation, role).autoscaling

    def _side_sglang(self, role: str) -> SGLangSettings:
        """engine.sglang with a side's own fields over it, validated as engine.sglang is."""
        field = f"disaggregation.{role}.sglang"
        if self.engine.backend != "sglang":
            raise ValueError(f"{field}: SGLang server arguments, for engine.backend sglang only")
        try:
            return SGLangSettings.model_validate({**self.engine.sglang.model_dump(),
                                                  **getattr(self.disaggregation, role).sglang})
        except ValidationError as exc:
            raise ValueError("; ".join(
                f"{field}.{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"
                for error in exc.errors())) from None

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


# --- what the tree's model paths say (read from config.json files, no weights) ----------------


class ConfigError(ValueError):
    pass


def model_configs(config: AppConfig) -> tuple[KimiConfig | K3Config, DSparkConfig | None]:
    """The target's (K2 or K3 layout) and the draft's config.json, each missing file named by
    its field."""
    target_path = config.models.target_path()
    if not (target_path / "config.json").exists():
        raise ConfigError(f"models.target: no config.json in {target_path}")
    target = load_target_config(target_path)
    draft_path = config.models.draft_path()
    draft = None
    if draft_path is not None:
        if not (draft_path / "config.json").exists():
            raise ConfigError(f"models.draft: no config.json in {draft_path}")
        draft = DSparkConfig.from_file(draft_path)
    return target, draft


def media_config(config: AppConfig) -> MediaConfig | None:
    """How the served model sees images: `preprocessor_config.json`'s media config, read from
    the target checkpoint folder (from the tokenizer folder where the target is not on this
    machine: SGLang's checkpoints may be on the GPU nodes only). None, the model takes no
    images, where the folder has no preprocessing config or its config.json no
    `vision_config` (a text-only checkpoint)."""
    folder = config.models.target_path()
    if not folder.is_dir():
        folder = config.models.tokenizer_path()
    media = MediaConfig.from_folder(folder)
    if media is None or not (folder / "config.json").exists():
        return media
    raw, _ = read_config_json(folder, ConfigError)
    return media if "vision_config" in raw else None


def context_length(config: AppConfig) -> int:
    """The longest prompt + completion a request may ask for: one number for the ingress's
    check, the body-size limit, the router's long/short threshold and the engine's own
    limit (`engine.max_model_len`, else the models' `pair_context`)."""
    if config.engine.max_model_len:
        return config.engine.max_model_len
    if config.engine.backend == "sglang":
        # The checkpoints may be only on the GPU nodes; SGLang enforces the same number.
        return config.engine.sglang.context_length
    target, draft = model_configs(config)
    return pair_context(target, draft, config.engine.reference.speculation.enabled)
