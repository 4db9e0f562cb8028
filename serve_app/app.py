"""`build_app(config)`: the Serve application, wired from one validated config tree.

    serve run deployments/local.yaml        # import_path: serve_app.app:build_app

Everything that can be checked without loading weights is checked here, before any replica
starts: layout vs bundles, the draft against the target (tapped layers, vocabulary, hidden
size, block size), context length against both models, tokenizer against the vocabulary.
"""

from __future__ import annotations

import json
from typing import Any

from ray import serve
from ray.serve import Application

from serve_app.chat.formats import chat_format_for
from serve_app.config import AppConfig, ConfigError, model_configs
from serve_app.models.dspark_config import check_pair, pair_context
from serve_app.protocol.generation import Role
from serve_app.serving.ingress import OpenAIIngress
from serve_app.serving.target import TargetReplica
from serve_app.tokenizer import load_tokenizer

# How often a stopping replica checks for requests still in flight (Serve's default is 2 s, and
# it waits one period before the first check): a replica with nothing in flight exits after
# 0.2 s instead of 2 s on every scale-down, redeploy and `serve.delete`; in-flight generations
# are still drained up to graceful_shutdown_timeout_s.
SHUTDOWN_POLL_S = 0.2
# How long a leaving target replica of a fixed-size deployment may take: its running requests
# move to other replicas at once (an engine that cannot move them finishes them within this).
DRAIN_TIMEOUT_S = 60.0
# How long a redeployed ingress keeps the streams it holds (longer streams are cut: a client
# retries them; an app being deleted waits at most this for its ingress).
INGRESS_DRAIN_S = 120.0


def validate(config: AppConfig) -> None:
    """Cross-checks that need the model configs (not the weights); each names the field (a
    disaggregated app's: each side's layout, prefixed by its side)."""
    if config.disaggregation.enabled:
        problems = [f"disaggregation.{role}: {p}" for role in ("prefill", "decode")
                    for p in _problems(config.side(role), role)]
    else:
        problems = _problems(config)
    if problems:
        raise ConfigError("invalid deployment config:\n  - " + "\n  - ".join(problems))


def _problems(config: AppConfig, role: Role = "both") -> list[str]:
    if config.engine.backend == "sglang":
        # The checkpoints may live only on the GPU nodes: these checks read them when present
        # and the capacity planner's packaged descriptors otherwise (serve_app.engines.sglang).
        from serve_app.engines.sglang.checks import sglang_problems

        return sglang_problems(config, role)
    target, draft = model_configs(config)
    problems = []
    if draft is not None:
        try:
            check_pair(target, draft, config.engine.reference.speculation.gamma)
        except ValueError as exc:
            problems.append(f"models.draft: {exc}")
    limit = pair_context(target, draft, config.engine.reference.speculation.enabled)
    if config.engine.max_model_len and config.engine.max_model_len > limit:
        problems.append(f"engine.max_model_len={config.engine.max_model_len} exceeds the models' "
                        f"maximum context ({limit})")
    # Each model says which sizes tensor parallelism must divide (the same check its shard
    # code runs): failing here names it before any replica loads a weight.
    tp = config.parallelism.tp
    for field, model in (("models.target", target), ("models.draft", draft)):
        if model is not None:
            try:
                model.validate_tp(tp)
            except ValueError as exc:
                problems.append(f"parallelism.tp={tp} cannot shard {field}: {exc}")
    try:
        tokenizer = load_tokenizer(config.models.tokenizer_path())
        chat_format_for(tokenizer)  # the ingress serves chats in the folder's own format
        if tokenizer.vocab_size > target.vocab_size:
            problems.append(f"models.tokenizer has {tokenizer.vocab_size} tokens, more than the "
                            f"target's vocab_size={target.vocab_size}")
    except ValueError as exc:
        problems.append(f"models.tokenizer: {exc}")
    return problems


def _router_options(config: AppConfig) -> dict[str, Any]:
    """The target deployment's request router (serve_app.routing.serve_router: it sends each
    request where the ingress's admission stage chose), unless the config asks for Serve's
    own."""
    if config.router.policy == "ray_default":
        return {}
    from ray.serve.config import RequestRouterConfig

    return {"request_router_config": RequestRouterConfig(
        request_router_class="serve_app.routing.serve_router:ChosenReplicaRouter")}


def build_app(config: AppConfig) -> Application:
    """The Serve application: OpenAI ingress -> target replicas (each on its placement group);
    disaggregated: OpenAI ingress -> decode replicas, each of which has its requests prefilled
    on the prefill replicas."""
    if not isinstance(config, AppConfig):
        config = AppConfig.model_validate(config)
    logging_config = {"encoding": "JSON" if config.observability.json_logs else "TEXT"}
    raw = json.loads(config.model_dump_json())
    validate(config)
    if not config.disaggregation.enabled:
        target = _target_deployment(config, "TargetDeployment", logging_config).bind(raw)
    else:
        # The ingress fronts the decode side, which orchestrates: each of its replicas has its
        # requests prefilled on the prefill side and adopts the hand-over (docs/disaggregation.md).
        # Validated as its replicas will validate it, so that a side's config they would
        # refuse fails here, naming its field, not in a replica's start-up loop.
        sides = {role: AppConfig.model_validate_json(config.side(role).model_dump_json())
                 for role in ("prefill", "decode")}
        prefill = _target_deployment(sides["prefill"], "PrefillDeployment", logging_config,
                                     "prefill").bind(
            json.loads(sides["prefill"].model_dump_json()), "prefill")
        target = _target_deployment(sides["decode"], "DecodeDeployment", logging_config,
                                    "decode").bind(
            json.loads(sides["decode"].model_dump_json()), "decode", prefill)
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress").options(
        num_replicas=config.ingress.replicas,
        ray_actor_options={"num_cpus": config.ingress.ingress_cpus},
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        # A redeployed ingress (new weights or config restart every deployment) keeps the
        # streams it holds until they end: they follow their requests' moves between target
        # replicas, and a client's connection is with this ingress.
        graceful_shutdown_timeout_s=INGRESS_DRAIN_S,
        logging_config=logging_config,
        max_ongoing_requests=config.ingress.max_ongoing_requests,
    )
    return ingress.bind(target, raw)


def _scaling(config: AppConfig, role: Role) -> dict[str, Any]:
    """A target deployment's size: a fixed `replicas`, or Serve's autoscaling with this
    project's policy (serve_app/routing/serve_autoscaling.py) within its autoscaling
    section's bounds (`AppConfig.autoscaling`); and how long a leaving replica may take (its
    requests that cannot move finish first)."""
    auto = config.autoscaling(role)
    if auto is None:
        return {"num_replicas": config.placement.replicas,
                "graceful_shutdown_timeout_s": DRAIN_TIMEOUT_S}
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    bounds = {"min_replicas": auto.min_replicas, "max_replicas": auto.max_replicas,
              "initial_replicas": auto.initial_replicas or auto.min_replicas,
              "upscale_delay_s": auto.upscale_delay_s,
              "downscale_delay_s": auto.downscale_delay_s,
              "metrics_interval_s": auto.metrics_interval_s,
              "look_back_period_s": auto.look_back_period_s}
    if auto.policy == "ray_requests":
        running = (config.engine.sglang.max_running_requests
                   if config.engine.backend == "sglang"
                   else config.engine.reference.max_batch_size)
        scaling = AutoscalingConfig(**bounds, target_ongoing_requests=(
            auto.target_ongoing_requests or max(1.0, running * auto.target_utilization)))
    else:
        scaling = AutoscalingConfig(**bounds, policy=AutoscalingPolicy(
            policy_function="serve_app.routing.serve_autoscaling:LedgerPolicy",
            policy_kwargs=auto.model_dump()))
    return {"num_replicas": "auto", "autoscaling_config": scaling,
            "graceful_shutdown_timeout_s": auto.drain_timeout_s}


def _target_deployment(config: AppConfig, name: str, logging_config: dict[str, Any],
                       role: Role = "both") -> Any:
    """The target deployment of `config` (one side's, when disaggregated), unbound."""
    pl = config.placement
    actor_options: dict[str, Any] = {"num_cpus": pl.cpus_per_rank}
    sglang = config.engine.backend == "sglang"
    if pl.accelerator == "GPU":
        # SGLang's scheduler actors take every GPU of the bundles (one each); its replica
        # process only tokenizes and coordinates, so it must not hold one.
        actor_options["num_gpus"] = 0 if sglang else 1
    max_ongoing = (config.engine.sglang.max_running_requests * 2 if sglang
                   else config.engine.reference.max_batch_size * 4)
    return serve.deployment(TargetReplica, name=name).options(
        **_scaling(config, role),
        ray_actor_options=actor_options,
        placement_group_bundles=config.bundles(),
        placement_group_strategy=config.strategy,
        max_ongoing_requests=max_ongoing,
        health_check_timeout_s=config.engine.health_check_timeout_s + 10,
        health_check_period_s=config.engine.health_check_period_s,
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        logging_config=logging_config,
        **_router_options(config),
    )
