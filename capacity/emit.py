"""Write a Ray Serve config and a Ray cluster-launcher config for one planned layout.

Both are plain YAML. They are checked offline with Ray's own validators (imported lazily, so the
rest of the planner never needs Ray): `ray.serve.schema.ServeDeploySchema` for the Serve file and
the cluster launcher's `prepare_config` + `validate_config` (ray/autoscaler/ray-schema.json).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from capacity.config import Layout, Speculation
from capacity.errors import CapacityError
from capacity.model import ModelDescriptor
from capacity.ray_env import sglang_ray_env

SERVE_IMPORT_PATH = "serve_app.app:build_app"
# The replica actor itself only coordinates; rank workers take the GPUs of its bundles.
CPUS_PER_GPU = 8
HEAD_CPUS = 8
AUTH_MODES = ("token", "disabled")
# Where `ray up` syncs the checkout it runs from (as deployments/generate.py's cluster files).
PROJECT_DIR = "~/kimi-dspark-serve"


@dataclass(frozen=True)
class EmitResult:
    serve_path: Path
    cluster_path: Path
    serve_config: dict[str, Any]
    cluster_config: dict[str, Any]


def serve_config(
    model: ModelDescriptor,
    model_ref: str,
    layout: Layout,
    context_length: int,
    max_running_requests: int,
    replicas: int = 1,
    draft: ModelDescriptor | None = None,
    draft_ref: str | None = None,
    speculation: Speculation | None = None,
    planner_refs: tuple[str, str | None] | None = None,
) -> dict[str, Any]:
    """The Serve application: one target deployment whose replica owns one placement group
    (one bundle per node); the builder's `args` carry the app's config tree."""
    gpn = layout.gpus_per_node
    kv_dtype = "fp8_e4m3" if layout.kv_dtype.value == "fp8" else "auto"
    # The Serve app's config tree (serve_app/config.py: AppConfig): capacity/ never imports
    # the app, so the shape is written here and a test validates it with AppConfig.
    sglang: dict[str, Any] = {
        "context_length": context_length,
        "mem_fraction_static": layout.mem_fraction,
        "kv_cache_dtype": kv_dtype,
        "max_running_requests": max_running_requests,
        # What the app's start-up check sizes (a packaged name or a config.json path), since
        # the checkpoints may not be on the machine that runs `serve run`.
        "planner_model": planner_refs[0] if planner_refs else model_ref,
        "speculative_algorithm": None,
    }
    models: dict[str, Any] = {"target": model_ref, "tokenizer": model_ref,
                              "served_model_name": model.name.lower()}
    if draft is not None:
        spec = speculation or Speculation()
        models["draft"] = draft_ref or draft.name
        sglang["speculative_algorithm"] = "DSPARK"
        sglang["speculative_dspark_block_size"] = spec.gamma
        sglang["planner_draft"] = (planner_refs[1] if planner_refs else None) or draft_ref \
            or draft.name
    else:
        sglang["planner_draft"] = None
    if layout.pipeline_stages > 1:
        sglang["extra_server_args"] = {"pp_size": layout.pipeline_stages}
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": 8000},
        "applications": [
            {
                "name": "kimi",
                "route_prefix": "/",
                "import_path": SERVE_IMPORT_PATH,
                "runtime_env": {
                    # SGLang's Ray backend selects its GPUs itself: Ray must not narrow the
                    # visible devices (CUDA's, and HIP's on AMD), the variables the app's
                    # SGLang start-up check requires (one table: capacity.ray_env).
                    "env_vars": sglang_ray_env(layout.gpu),
                },
                "args": {
                    "models": models,
                    "engine": {"backend": "sglang", "sglang": sglang},
                    "parallelism": {
                        "tp": layout.attention_tp * layout.attention_dp,
                        "ep": layout.expert_parallel,
                        "attention_dp": layout.attention_dp,
                        "pp": layout.pipeline_stages,
                        "nodes": layout.nodes,
                        "devices_per_node": gpn,
                    },
                    "placement": {
                        "accelerator": "GPU",
                        "gpu_type": layout.gpu,
                        "cpus_per_rank": CPUS_PER_GPU,
                        "replicas": replicas,
                    },
                },
            }
        ],
    }


def cluster_config(
    layout: Layout, replicas: int = 1, cluster_name: str = "kimi-k3", auth_mode: str = "token",
    ray_version: str = "2.60.0",
) -> dict[str, Any]:
    """An on-premise (provider: local) cluster: a GPU-free head node plus one worker per node of
    every replica. Addresses are placeholders for the rented machines."""
    if auth_mode not in AUTH_MODES:
        raise CapacityError(f"auth mode {auth_mode!r} unknown; allowed: {', '.join(AUTH_MODES)}")
    workers = layout.nodes * replicas
    env = f"RAY_AUTH_MODE={auth_mode}"
    if auth_mode == "token":
        # Every node reads the same token file, synced from the launcher machine.
        env += " RAY_AUTH_TOKEN_PATH=~/.ray/auth_token"
    return {
        "cluster_name": cluster_name,
        "max_workers": workers,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 60,
        "provider": {
            "type": "local",
            "head_ip": "HEAD_NODE_IP",
            "worker_ips": [f"WORKER_{i}_IP" for i in range(workers)],
        },
        "auth": {"ssh_user": "ubuntu", "ssh_private_key": "~/.ssh/id_ed25519"},
        # `ray up` runs from the repository root: the project is synced to every node.
        "file_mounts": {PROJECT_DIR: ".",
                        **({"~/.ray/auth_token": "~/.ray/auth_token"}
                           if auth_mode == "token" else {})},
        "rsync_exclude": [".venv", ".git", "**/__pycache__"],
        "setup_commands": [
            f"echo 'export {env}' >> ~/.bashrc",
        ],
        "head_setup_commands": _project_setup(ray_version, with_sglang=False),
        "worker_setup_commands": _project_setup(ray_version, with_sglang=True),
        "head_start_ray_commands": [
            "ray stop",
            # The head schedules nothing on GPUs: replicas' placement groups land on workers.
            f"{env} ray start --head --port=6379 --num-gpus=0 --num-cpus={HEAD_CPUS} "
            "--autoscaling-config=~/ray_bootstrap_config.yaml",
        ],
        "worker_start_ray_commands": [
            "ray stop",
            f"{env} ray start --address=$RAY_HEAD_IP:6379 --num-gpus={layout.gpus_per_node}",
        ],
    }


def _project_setup(ray_version: str, with_sglang: bool) -> list[str]:
    """Install the project (the app the Serve file imports) from the synced checkout: with the
    sglang extra on the GPU workers, CPU torch on the GPU-free head (as deployments/generate.py)."""
    commands = ["python3 -m pip install -U pip",
                f"python3 -m pip install 'ray[serve]=={ray_version}'"]
    if not with_sglang:
        # Keep pip from pulling a CUDA torch through the project's torch pin.
        commands.append("python3 -m pip install torch --index-url "
                        "https://download.pytorch.org/whl/cpu")
    extra = "[sglang]" if with_sglang else ""
    commands.append(f"cd {PROJECT_DIR} && python3 -m pip install -e '.{extra}'")
    return commands


def validate_serve_config(config: dict[str, Any]) -> None:
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as exc:
        raise CapacityError(f"emitted Serve config is invalid: {exc.errors()[0]}") from None


def validate_cluster_config(config: dict[str, Any]) -> dict[str, Any]:
    """Runs the cluster launcher's own preparation and schema validation; returns the
    prepared config (defaults filled in)."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    try:
        prepared = prepare_config(copy.deepcopy(config))
        validate_config(prepared)
    except (jsonschema.ValidationError, ValueError, RuntimeError) as exc:
        message = getattr(exc, "message", str(exc))
        raise CapacityError(f"emitted cluster config is invalid: {message}") from None
    return prepared


def emit(
    out_dir: str | Path,
    model: ModelDescriptor,
    model_ref: str,
    layout: Layout,
    context_length: int,
    max_running_requests: int,
    replicas: int = 1,
    draft: ModelDescriptor | None = None,
    draft_ref: str | None = None,
    speculation: Speculation | None = None,
    auth_mode: str = "token",
    planner_refs: tuple[str, str | None] | None = None,
) -> EmitResult:
    serve = serve_config(model, model_ref, layout, context_length, max_running_requests,
                         replicas, draft, draft_ref, speculation, planner_refs)
    cluster = cluster_config(layout, replicas, auth_mode=auth_mode)
    validate_serve_config(serve)
    validate_cluster_config(cluster)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{layout.gpu.lower()}-{layout.nodes}x{layout.gpus_per_node}"
    serve_path = out / f"serve-{stem}.yaml"
    cluster_path = out / f"cluster-{stem}.yaml"
    header = f"# Generated by kimi-capacity emit for {layout.label()}; edit values, not shape.\n"
    serve_path.write_text(header + yaml.safe_dump(serve, sort_keys=False))
    cluster_path.write_text(header + yaml.safe_dump(cluster, sort_keys=False))
    return EmitResult(serve_path, cluster_path, serve, cluster)
