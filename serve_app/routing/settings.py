"""The router's settings, and the autoscaling policy's it feeds: one definition of every
field, its default and its meaning.

The app's config tree uses RouterSettings as `router:` and AutoscalingSettings as
`placement.autoscaling:` (`serve_app.config.RouterConfig` subclasses
it, only widening `long_threshold` and `share_prefix` to a `null` default that it resolves from
the deployment); the policies, the Serve admission stage and the simulator take it as is.
Defaults: the simulator runs in docs/router.md (bench/router_sim.py on K3 + DSpark, 2 x 8 H200
replicas). No import from the config tree: this package stays pure.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RouterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Literal["kv_aware", "cache_aware", "power_of_two", "round_robin", "ray_default"] = (
        Field(default="kv_aware", description="kv_aware: this router; cache_aware/power_of_two/"
              "round_robin: the baselines (no admission); ray_default: Serve's own routing "
              "(the app does not use this package)"))
    block_size: int = Field(default=256, gt=0, description="tokens per prefix-hash block")
    long_threshold: int = Field(default=32_768, gt=0, description="prompt tokens from which a "
                                "request is in the long class")
    max_long_prefills_per_replica: int = Field(default=1, gt=0)
    long_prefill_replica_fraction: float = Field(default=0.5, gt=0, le=1, description="share "
                                                 "of replicas that may run a long prefill")
    queue_size: int = Field(default=1024, gt=0, description="requests held waiting for KV; "
                            "beyond it: 429")
    queue_timeout_s: float = Field(default=900.0, gt=0, description="longest wait; then 503")
    aging_s: float = Field(default=120.0, ge=0, description="a long request waiting this long "
                           "goes before short ones")
    cache_threshold: float = Field(default=0.5, ge=0, le=1)
    balance_abs_tokens: int = Field(default=65_536, ge=0, description="pending-prefill spread "
                                    "(tokens) beyond which load wins over affinity ...")
    balance_rel: float = Field(default=1.5, ge=1, description="... if also max > rel x min")
    index_max_entries: int = Field(default=2_000_000, gt=0, description="prefix index bound "
                                   "((block, replica) pairs, about 150 B each)")
    share_prefix: bool = Field(default=True, description="count prefix blocks shared by "
                               "in-flight requests once (an engine with a prefix cache)")
    retry_after_s: float = Field(default=2.0, gt=0)
    # Disaggregated apps (docs/disaggregation.md): a prefill replica on another node than the
    # request's decode replica must send the hand-over over the network. Priced in the unit of
    # `least_work` (prompt tokens of prefill), per prompt token moved: the hand-over's bytes per
    # token / the link's bandwidth x the prefill rate. K3 on 2 x 8 H200 (~35 KB/token of MLA
    # latents in fp8, 50 GB/s, ~8,000 prefill tokens/s): 0.006; the object store on one node:
    # free.
    handoff_cost: float = Field(default=0.01, ge=0, description="disaggregated: a prefill "
                                "replica on another node than the decode replica costs this "
                                "many tokens of prefill work per prompt token handed over")
    # Per client (API key or address; "" = no client, e.g. the simulator: unlimited).
    client_max_requests: int = Field(default=256, gt=0, description="requests one client "
                                     "(API key, else address) may have queued + in flight; "
                                     "beyond it: 429")
    client_max_kv_share: float = Field(default=0.5, gt=0, le=1, description="share of the "
                                       "fleet's KV tokens one client's in-flight requests may "
                                       "commit; its further requests wait (a client with none "
                                       "in flight is always served)")
    # SGLang router (sgl-router cache_aware) published defaults, for the baseline.
    sglang_cache_threshold: float = Field(default=0.5, ge=0, le=1)
    sglang_balance_abs_threshold: int = Field(default=32, ge=0)
    sglang_balance_rel_threshold: float = Field(default=1.0001, ge=1)
    seed: int = Field(default=0, description="power_of_two's random choices")


class AutoscalingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    """Replicas that follow load (docs/runbook.md "Autoscaling"): Ray Serve's autoscaling with
    this project's policy (serve_app/routing/autoscaling.py), fed by what the router holds:
    the replicas' reserved KV tokens and state slots against their capacity, the requests
    waiting in the admission queues and the oldest wait, and the measured time to first
    token. It scales up to hold the demand at `target_utilization` and down only when one
    replica fewer would still run under `scale_down_utilization` (the band between them, and
    the delays, keep it from flapping); a replica that leaves moves its running requests to
    the others. `kimi-capacity emit` writes these from the plan's SLA targets."""

    policy: Literal["ledger", "ray_requests"] = Field(
        default="ledger", description="ledger: this project's policy (the router's reserved "
        "KV tokens and slots, its queues, TTFT); ray_requests: Ray Serve's default policy, "
        "ongoing requests per replica against target_ongoing_requests (what the ledger "
        "policy is measured against: bench/autoscaling.py)")
    target_ongoing_requests: float | None = Field(
        default=None, gt=0, description="ray_requests: requests per replica it aims for "
        "(default: the engine's running-request bound x target_utilization)")
    min_replicas: int = Field(default=1, ge=1, description="never fewer (a K3 replica's cold "
                              "start loads its weights for minutes: no scale to zero)")
    max_replicas: int = Field(default=4, ge=1)
    initial_replicas: int | None = Field(default=None, ge=1, description="at deploy time "
                                         "(default: min_replicas)")
    target_utilization: float = Field(default=0.75, gt=0, le=1, description="the share of "
                                      "the pool's KV tokens and state slots that reserved + "
                                      "queued requests may fill before it scales up")
    scale_down_utilization: float = Field(default=0.45, gt=0, le=1, description="scale down "
                                          "only when one replica fewer would hold the demand "
                                          "under this share")
    max_queue_wait_s: float = Field(default=5.0, gt=0, description="a request waiting in an "
                                    "admission queue longer than this scales up by one")
    ttft_slo_s: float | None = Field(default=None, gt=0, description="the measured TTFT (p90 "
                                     "over the look-back) above this scales up by one; None: "
                                     "not used")
    max_step: int = Field(default=4, ge=1, description="replicas added in one decision")
    upscale_delay_s: float = Field(default=5.0, ge=0, description="Serve holds a scale-up "
                                   "decision this long before acting")
    downscale_delay_s: float = Field(default=120.0, ge=0, description="... and a scale-down "
                                     "this long (a replica is dear to start again)")
    metrics_interval_s: float = Field(default=1.0, gt=0, description="how often replicas "
                                      "report their load")
    look_back_period_s: float = Field(default=10.0, gt=0, description="the window the "
                                      "reports are averaged over")
    drain_timeout_s: float = Field(default=600.0, gt=0, description="a leaving replica's "
                                   "requests that cannot move (an engine without migration) "
                                   "finish within this (Serve's graceful_shutdown_timeout_s)")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} exceeds max_replicas="
                             f"{self.max_replicas}")
        initial = self.initial_replicas
        if initial is not None and not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(f"initial_replicas={initial} is outside [min_replicas, "
                             "max_replicas]")
        if self.scale_down_utilization >= self.target_utilization:
            raise ValueError(f"scale_down_utilization={self.scale_down_utilization} must be "
                             f"below target_utilization={self.target_utilization} (the band "
                             "between them keeps the fleet from flapping)")
        return self
