"""Tiny random target + DSpark draft checkpoints, written with the real tensor names."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from serve_app.models.dspark import DSparkDraft, save_dspark
from serve_app.models.dspark_config import DSparkConfig
from serve_app.models.kimi import KimiForCausalLM
from serve_app.models.kimi_config import KimiConfig
from serve_app.models.kimi_weights import save_kimi
from serve_app.protocol.grammar import GrammarSpec, ToolSpec


def tiny_target_config(vocab_size: int = 64, **overrides: Any) -> KimiConfig:
    raw: dict[str, Any] = {
        "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_hidden_layers": 4, "num_attention_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 8,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 2, "topk_group": 1,
        "rms_norm_eps": 1e-6, "vocab_size": vocab_size, "max_position_embeddings": 2048,
        "rope_theta": 10000.0, "eos_token_id": vocab_size - 2, "bos_token_id": 0,
        "torch_dtype": "float32",
    }
    raw.update(overrides)
    return KimiConfig.from_dict(raw, "tiny target")


def tiny_draft_config(target: KimiConfig, block_size: int = 7, **overrides: Any) -> DSparkConfig:
    raw: dict[str, Any] = {
        "hidden_size": target.hidden_size, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "vocab_size": target.vocab_size, "max_position_embeddings": 2048,
        "block_size": block_size, "num_target_layers": target.num_hidden_layers,
        "rms_norm_eps": 1e-6, "dtype": "float32",
        "dflash_config": {"target_layer_ids": [0, 2, 3], "mask_token_id": target.vocab_size - 1,
                          "markov_rank": 4},
    }
    raw.update(overrides)
    return DSparkConfig.from_dict(raw, "tiny draft")


def _spread(model: torch.nn.Module, scale: float) -> None:
    """Random weights with enough spread that greedy decoding is not one repeated token."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif "e_score_correction_bias" in name:
                p.normal_(0, 0.1)
            else:
                p.normal_(0, scale / max(1, p.shape[-1]) ** 0.5)


def write_tiny_pair(folder: Path, seed: int = 0, vocab_size: int = 64,
                    block_size: int = 7) -> tuple[Path, Path]:
    torch.manual_seed(seed)
    tcfg = tiny_target_config(vocab_size)
    target = KimiForCausalLM(tcfg)
    _spread(target, 1.5)
    draft = DSparkDraft(tiny_draft_config(tcfg, block_size))
    _spread(draft, 1.0)
    save_kimi(target, folder / "target")
    save_dspark(draft, folder / "draft")
    return folder / "target", folder / "draft"


SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
                  "<|mask|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tiny_tokenizer(folder: Path, vocab_size: int = 320) -> int:
    """A byte-level BPE tokenizer trained on a few lines, with the chat special tokens.
    Returns its vocabulary size."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["def hello(name):\n    return 'hello ' + name\n", "The quick brown fox jumps.",
            "import os\nprint(os.getcwd())\n"] * 20
    tok.train_from_iterator(text, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "mask_token": "<|mask|>",
        "pad_token": "<|pad|>", "chat_template": CHAT_TEMPLATE}))
    return tok.get_vocab_size(with_added_tokens=True)


def write_tiny_serving_pair(folder: Path, seed: int = 0) -> dict[str, Path]:
    """Tiny random target + draft whose vocabulary is a real tokenizer's, for the Serve app.
    The tokenizer lives in the target folder, as in a Hugging Face checkpoint."""
    vocab = write_tiny_tokenizer(folder / "target")
    from serve_app.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder / "target")
    torch.manual_seed(seed)
    tcfg = tiny_target_config(vocab, eos_token_id=tokenizer.eos_token_id)
    target = KimiForCausalLM(tcfg)
    _spread(target, 1.5)
    draft = DSparkDraft(tiny_draft_config(tcfg, dflash_config={
        "target_layer_ids": [0, 2, 3], "mask_token_id": tokenizer.mask_token_id,
        "markov_rank": 4}))
    _spread(draft, 1.0)
    save_kimi(target, folder / "target")
    save_dspark(draft, folder / "draft")
    return {"target": folder / "target", "draft": folder / "draft"}


# One local Ray cluster and Serve instance for every module in this pytest process whose apps
# prove nothing about start-up: each module deploys its app(s) on it and deletes them after, so
# it pays for Ray's and Serve's start once, not once per module. Started on first use; stopped by
# a module that needs a cluster of its own (`own_cluster`) and at the end of the session.
_SHARED: dict[str, int] = {}
shared_serve_calls = 0  # conftest checks which modules use the shared cluster
# Workers export their metrics every 2 s instead of Ray's 10 s, so that a test reading the
# metrics endpoint waits for one export, not for up to ten seconds.
FAST_METRICS = {"metrics_report_interval_ms": 2000}
TESTS = Path(__file__).parent


def shared_serve() -> dict[str, int]:
    """The shared cluster's ports: {"http": Serve's, "metrics": Ray's metrics export}. Its
    workers can import the test helpers (a test's own deployment classes live there)."""
    import ray

    from serve_app.netutil import free_port

    global shared_serve_calls
    shared_serve_calls += 1
    if not _SHARED:
        if ray.is_initialized():  # a module's own cluster, left behind: not ours to share
            stop_ray()
        metrics = free_port()
        http = _start_local_serve(_metrics_export_port=metrics,
                                  runtime_env={"env_vars": {"PYTHONPATH": str(TESTS)}})
        _SHARED.update(http=http, metrics=metrics)
    return _SHARED


def _start_local_serve(**init: Any) -> int:
    """A local Ray cluster of the tests' shape (`init`: more ray.init arguments) and Serve on
    it, listening on a free port: returns that port."""
    import ray
    from ray import serve

    from serve_app.netutil import free_port

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             _system_config=FAST_METRICS, **init)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


def wait_for(check: Callable[[], Any], timeout: float, interval: float = 0.2) -> Any:
    """Call `check` until it returns something true (returned) or `timeout` seconds pass (its
    last value returned): for a served app's state that changes on its own time."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    return value


def stop_ray() -> None:
    """Shut Serve and Ray down, the shared cluster or a module's own (where none runs,
    without importing Serve)."""
    import ray

    _SHARED.clear()
    if not ray.is_initialized():
        return
    from ray import serve

    try:
        serve.shutdown()
    except Exception:  # the cluster is already broken; shutting Ray down is what matters
        pass
    finally:
        ray.shutdown()


def delete_apps() -> None:
    """Delete every app on the shared cluster (a module's own, or what a fixture that failed
    half-way left)."""
    from ray import serve

    for name in serve.status().applications:
        serve.delete(name)


@contextmanager
def served(config: Any) -> Iterator[int]:
    """`config` (an AppConfig) served as the app "kimi" at "/" on the shared cluster: yields
    the HTTP port; the app is deleted afterwards, whatever happened."""
    from ray import serve

    from serve_app.app import build_app

    port = shared_serve()["http"]
    try:
        serve.run(build_app(config), name="kimi", route_prefix="/")
        yield port
    finally:
        serve.delete("kimi")


@contextmanager
def own_cluster(metrics_port: int | None = None) -> Iterator[int]:
    """A local Ray cluster and Serve of this module's own (for what the shared one cannot
    show: process environment set before Ray starts, a fresh metrics registry): yields the
    HTTP port; Ray is shut down afterwards."""
    stop_ray()
    extra = {"_metrics_export_port": metrics_port} if metrics_port is not None else {}
    try:
        yield _start_local_serve(**extra)
    finally:
        stop_ray()


@contextmanager
def traced_cluster(metrics_port: int | None = None) -> Iterator[int]:
    """`own_cluster` whose every process (the proxy too: set before Ray starts) exports every
    span to the in-cluster collector (serve_app.observability.tracing.collector_actor)."""
    from serve_app.observability.tracing import TracingConfig, tracing_env

    env = tracing_env(TracingConfig(exporter="collector", sampling_ratio=1.0))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with own_cluster(metrics_port) as http_port:
            yield http_port
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def reaches(spans: list[dict[str, Any]], name: str, ancestor: str) -> bool:
    """Does the chain of parents from the span called `name` reach span id `ancestor`?"""
    by_id = {s["span_id"]: s for s in spans}
    span = next((s for s in spans if s["name"] == name), None)
    while span is not None:
        if span["parent_span_id"] == ancestor:
            return True
        span = by_id.get(span["parent_span_id"])
    return False


def trace_spans(trace_id: str, names: set[str], timeout: float = 30.0,
              chain: tuple[str, str] | None = None) -> list[dict[str, Any]]:
    """The trace's spans once `names` are all in and, with `chain` = (span name, ancestor span
    id), once that span's parents reach the ancestor: each process (the proxy, the replicas)
    exports its spans in its own batches, so the links can arrive after the rest."""
    import ray

    from serve_app.observability.tracing import collector_actor

    collector = collector_actor()
    spans: list[dict[str, Any]] = []

    def complete() -> bool:
        nonlocal spans
        spans = [s for s in ray.get(collector.get.remote()) if s["trace_id"] == trace_id]
        return names <= {s["name"] for s in spans} and (chain is None or reaches(spans, *chain))

    wait_for(complete, timeout, interval=0.5)
    return spans  # on a timeout, what had arrived: the caller's asserts name what is missing


@contextmanager
def fake_gpu_cluster(nodes: int, cpus_per_node: int, gpus_per_node: int,
                     head_cpus: int = 1) -> Iterator[tuple[Any, set[str]]]:
    """A multi-node Ray cluster on this machine (ray.cluster_utils, fake GPUs), connected:
    yields (the cluster, the worker nodes' ids); the head holds no GPU, as in production."""
    import ray
    from ray.cluster_utils import Cluster

    stop_ray()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "num_gpus": 0})
    workers = [cluster.add_node(num_cpus=cpus_per_node, num_gpus=gpus_per_node)
               for _ in range(nodes)]
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster, {n.node_id for n in workers}
    finally:
        stop_ray()
        cluster.shutdown()


def _stop_leftovers(session: str) -> None:
    """Stop the processes still running for a Ray session that has shut down (their command
    lines name its folder): the nodes the fake multi-node provider started outlive the
    cluster (the raylets of the last nodes, which ignore SIGTERM without their GCS, then
    their log monitors: found alive an hour later)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return
    folder = session.encode()
    for entry in proc.iterdir():
        try:
            if entry.name.isdigit() and folder in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:  # gone meanwhile, or not ours
            pass


@contextmanager
def fake_autoscaling_cluster(node_cpus: float, node_gpus: int, max_nodes: int,
                             head_cpus: int = 2) -> Iterator[Callable[[], set[str]]]:
    """A Ray cluster whose GPU nodes Ray's own autoscaler starts and stops (its fake
    multi-node provider: each node a raylet on this machine, fake GPUs), connected: a
    GPU-free head and a worker type of `node_cpus` CPUs and `node_gpus` GPUs, 0 to
    `max_nodes` of them, idle ones removed after 6 s. Yields a function: the GPU nodes alive
    now (their ids)."""
    import tempfile

    import ray
    from ray.cluster_utils import Cluster

    from serve_app.netutil import free_port

    stop_ray()
    port = free_port()
    ip = ray._private.services.get_node_ip_address()
    config = {
        "cluster_name": "fake", "max_workers": max_nodes,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True,
                     "gcs_address": f"{ip}:{port}"},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": head_cpus, "GPU": 0}, "node_config": {},
                                 "max_workers": 0},
            "gpu_node": {"resources": {"CPU": node_cpus, "GPU": node_gpus}, "node_config": {},
                         "min_workers": 0, "max_workers": max_nodes}},
        "head_node_type": "ray.head.default", "auth": {}, "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1, "docker": {}, "file_mounts": {},
        "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        **{k: [] for k in ("initialization_commands", "setup_commands", "head_setup_commands",
                           "worker_setup_commands", "head_start_ray_commands",
                           "worker_start_ray_commands", "rsync_exclude", "rsync_filter")}}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(config, f)
    # The provider refuses to run without it; the autoscaler (a process the head starts)
    # inherits both, and looks every second.
    saved = {k: os.environ.get(k) for k in ("RAY_FAKE_CLUSTER", "AUTOSCALER_UPDATE_INTERVAL_S")}
    os.environ.update({"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"})
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": head_cpus, "num_gpus": 0, "gcs_server_port": port,
        "autoscaling_config": f.name})
    ray.init(address=cluster.address, log_to_driver=False)
    session = ray._private.worker._global_node.get_session_dir_path()

    def gpu_nodes() -> set[str]:
        return {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")}

    try:
        yield gpu_nodes
    finally:
        stop_ray()
        cluster.shutdown()
        _stop_leftovers(session)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        os.unlink(f.name)


def deploy_declared(config: Any, target_replicas: int | None = None) -> None:
    """`config` deployed as the app "kimi" as an operator's config file deploys it (`serve
    deploy`: Serve's declarative API): `target_replicas` in its `deployments:` section scales
    the target deployment in place (a lightweight update); a change of the app's arguments
    restarts every replica, rolling. Returns at once."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    app: dict[str, Any] = {"name": "kimi", "route_prefix": "/",
                           "import_path": "serve_app.app:build_app",
                           "args": json.loads(config.model_dump_json())}
    if target_replicas is not None:
        app["deployments"] = [{"name": "TargetDeployment", "num_replicas": target_replicas}]
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": [app]}))


MINI_K3_CONFIG = Path(__file__).parent / "data" / "mini-k3-config.json"


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights scaled so that logits are not degenerate: N(0, 0.25 / fan_in) matrices,
    norms near 1, a small router bias. KDA's A_log and dt_bias keep the module's own (seeded)
    initialisation."""
    import math

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def random_k3(config: Any = None, seed: int = 0) -> Any:
    """A K3ForCausalLM (the mini config by default) with `randomize`d weights."""
    from serve_app.models.k3 import K3ForCausalLM
    from serve_app.models.k3_config import K3Config

    torch.manual_seed(seed)
    model = K3ForCausalLM(config or K3Config.from_file(MINI_K3_CONFIG)).eval()
    randomize(model, seed)
    return model


def mini_k3_config(**text_overrides: Any) -> Any:
    """The mini K3 config (tests/data/mini-k3-config.json) with text_config fields replaced; the
    wrapper's special token ids follow the text model's, and the media placeholder is the last
    id of the vocabulary."""
    import json

    from serve_app.models.k3_config import K3Config

    raw = json.loads(MINI_K3_CONFIG.read_text())
    text = raw["text_config"]
    text.update(text_overrides)
    raw.update({k: text[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    raw["media_placeholder_token_id"] = text["vocab_size"] - 1
    return K3Config.from_dict(raw, "mini K3")


def tiny_k3_config(vocab_size: int = 256, **overrides: Any) -> Any:
    """The mini K3's layout (8 layers: KDA except layers 3 and 7, AttnRes blocks of 3, dense
    layer 0 then latent MoE) at test-suite widths, so engine tests run in seconds."""
    return mini_k3_config(**{
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 32,
        "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
        "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 16,
        "routed_expert_hidden_size": 32, "num_shared_experts": 1,
        "bos_token_id": 1, "eos_token_id": vocab_size - 2, "pad_token_id": 0,
        "linear_attn_config": {**_mini_text()["linear_attn_config"], "num_heads": 2,
                               "head_dim": 16},
        **overrides,
    })


def _mini_text() -> dict[str, Any]:
    import json

    return json.loads(MINI_K3_CONFIG.read_text())["text_config"]


def k3_draft_config(target: Any, block_size: int = 7, mask_token_id: int | None = None,
                    **overrides: Any) -> DSparkConfig:
    """A small DSpark draft for a K3-layout target, tapping it as K3's draft does: the outputs
    (0-based, no shift) of MLA layers and one KDA layer, the last layer's via the output read."""
    n = target.num_hidden_layers
    raw: dict[str, Any] = {
        "hidden_size": target.hidden_size, "intermediate_size": 2 * target.hidden_size,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": target.vocab_size, "max_position_embeddings": 4096,
        "block_size": block_size, "num_target_layers": n, "rms_norm_eps": 1e-5,
        "dtype": "float32",
        "dflash_config": {
            "target_layer_ids": sorted({*target.mla_layers, 1, n - 1}),
            "mask_token_id": target.vocab_size - 1 if mask_token_id is None else mask_token_id,
            "markov_rank": 8},
    }
    raw.update(overrides)
    return DSparkConfig.from_dict(raw, "K3 draft")


def write_random_k3_pair(folder: Path, config: Any = None, seed: int = 0,
                         block_size: int = 7, mask_token_id: int | None = None
                         ) -> tuple[Path, Path]:
    """A random K3-layout target (the mini config by default) and its DSpark draft, saved as
    the engine loads them (K3's config.json layout and names; the published DSpark format)."""
    from serve_app.models.k3_weights import save_k3

    target = random_k3(config, seed)
    torch.manual_seed(seed + 1)
    draft = DSparkDraft(k3_draft_config(target.config, block_size, mask_token_id))
    _spread(draft, 1.0)
    save_k3(target, folder / "target")
    save_dspark(draft, folder / "draft")
    return folder / "target", folder / "draft"


def write_k3_serving_pair(folder: Path, seed: int = 0, tiny: bool = False) -> dict[str, Path]:
    """The random miniature K3 pair (the mini config, or with `tiny` tiny_k3_config's widths;
    its vocabulary a real tokenizer's) for the Serve app; the tokenizer lives in the target
    folder."""
    vocab = write_tiny_tokenizer(folder / "target")
    from serve_app.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder / "target")
    make = tiny_k3_config if tiny else mini_k3_config
    config = make(vocab_size=vocab, eos_token_id=tokenizer.eos_token_id,
                  bos_token_id=tokenizer.bos_token_id, pad_token_id=0)
    target, draft = write_random_k3_pair(folder, config, seed,
                                         mask_token_id=tokenizer.mask_token_id)
    return {"target": target, "draft": draft}


DATA = Path(__file__).parent / "data"
# A K3-style tokenizer folder: the public Kimi BPE (the K2.5 fixture's tiktoken.model, K3's
# vocabulary) with K3's control tokens (tests/data/kimi-k3-style/tokenizer_config.json).
K3_STYLE_TOKENIZER = (DATA / "kimi-k25-tokenizer" / "tiktoken.model",
                      DATA / "kimi-k3-style" / "tokenizer_config.json")
K3_EOS, K3_BOS, K3_PAD, K3_MASK = 163586, 163584, 163839, 163824  # kimi-k3(-dspark) config.json


# KVV's tool_call_json_schema cases (tests/data/kvv).
WALLE_CASES = DATA / "kvv" / "walle_validator_cases" / "validator_cases"


def kvv_walle_tool(case: Any, thinking: bool = False) -> tuple[GrammarSpec, dict[str, Any]]:
    """A forced call of KVV's strict tool for a walle case (thinking off by default, as KVV
    sends it), and the tool's parameters, wrapped as KVV's validator.py wraps them: the case
    schema is the `value` property, its `$defs` and `$id` move to the root, and a `#`
    reference to the case's root points at a definition of it."""
    schema = dict(case.get("schema", case))
    defs = dict(schema.pop("$defs", {}))
    id_ = schema.pop("$id", None)
    value: Any = schema
    if '"$ref": "#"' in json.dumps(schema):
        defs["__case_schema"] = json.loads(
            json.dumps(schema).replace('"$ref": "#"', '"$ref": "#/$defs/__case_schema"'))
        value = {"$ref": "#/$defs/__case_schema"}
    params = {"type": "object", "required": ["value"], "additionalProperties": False,
              "properties": {"value": value}, **({"$defs": defs} if defs else {}),
              **({"$id": id_} if id_ is not None else {})}
    tool = ToolSpec("kvv_walle_case", params, strict=True)
    return GrammarSpec("tool_call", "tool_choice", tools=(tool,), chat_format="k3",
                       thinking=thinking), params


def write_k3_style_tokenizer(folder: Path) -> Path:
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    for source in K3_STYLE_TOKENIZER:
        shutil.copyfile(source, folder / source.name)
    return folder


# A random mini `vision_config`: K3's structure (MoonViT-V2, divided_fixed positions, sd2_tpool
# 2x2 merge, patchmergerv2), tiny sizes (K3: 27 layers, hidden 1024, 16 heads, 64x64 table).
MINI_VISION = {"patch_size": 14, "init_pos_emb_height": 4, "init_pos_emb_width": 4,
               "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed",
               "vt_hidden_size": 32, "vt_num_hidden_layers": 2, "vt_num_attention_heads": 2,
               "qkv_hidden_size": 32, "vt_intermediate_size": 64, "merge_type": "sd2_tpool",
               "merge_kernel_size": [2, 2], "mm_projector_type": "patchmergerv2",
               "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5}


def write_random_vision(target: Path, seed: int = 0) -> Path:
    """A random tiny tower + projector (MINI_VISION, projecting to the target's hidden size)
    saved into the K3 target folder `target` (config.json's vision_config, the
    `vision_tower.*` / `mm_projector.*` tensors), with K3's published preprocessor_config.json
    (tests/data/vision). The folder then loads with load_k3 and load_k3_vision."""
    import json
    import math
    import shutil

    from serve_app.models.moonvit import K3Vision, VisionConfig, save_k3_vision

    hidden = json.loads((target / "config.json").read_text())["text_config"]["hidden_size"]
    torch.manual_seed(seed + 7)
    tower = K3Vision(VisionConfig.from_dict({**MINI_VISION, "text_hidden_size": hidden}))
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
            else:
                p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1] if p.dim() > 1 else 1))
    save_k3_vision(tower, target)
    shutil.copy(DATA / "vision" / "preprocessor_config.json", target)
    return target


def write_k3_format_pair(folder: Path, seed: int = 0, tiny: bool = True) -> dict[str, Path]:
    """A random mini K3 pair in K3's chat format: K3's vocabulary (163,840) and special ids,
    the K3-style tokenizer in the target folder, and a random tiny vision tower
    (`write_random_vision`: images reach the tower with K3's real media ids); `tiny` at the
    test widths (the embedding and head are most of its ~21 M parameters)."""
    make = tiny_k3_config if tiny else mini_k3_config
    config = make(vocab_size=163_840, eos_token_id=K3_EOS, bos_token_id=K3_BOS,
                  pad_token_id=K3_PAD)
    target, draft = write_random_k3_pair(folder, config, seed, mask_token_id=K3_MASK)
    write_k3_style_tokenizer(target)
    write_random_vision(target, seed)
    return {"target": target, "draft": draft}
