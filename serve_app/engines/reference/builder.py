"""Build the reference engine on one rank from checkpoint folders and typed settings."""

from __future__ import annotations

import functools
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from capacity.families import describe_model
from serve_app.config import ReferenceEngineConfig
from serve_app.engines.reference.collectives import TorchGroup, host_collectives
from serve_app.engines.reference.engine import EngineCore
from serve_app.engines.reference.images import PromptImages
from serve_app.engines.reference.model_runner import ModelRunner
from serve_app.engines.reference.proposer import DSparkProposer
from serve_app.engines.reference.sequence import Detokenize
from serve_app.engines.reference.tensor_parallel import shard_dspark
from serve_app.grammar.closing import ClosingPaths
from serve_app.grammar.compiler import GrammarCompiler, ll_tokenizer
from serve_app.models.dspark import load_dspark
from serve_app.models.dspark_config import check_pair, pair_context
from serve_app.models.k3_paged import PagedK3
from serve_app.models.k3_weights import load_k3
from serve_app.models.kimi import KimiForCausalLM
from serve_app.models.kimi_weights import load_kimi
from serve_app.models.kv_cache import PagedAllocator
from serve_app.models.layers import column_major_linears
from serve_app.models.moonvit import load_k3_vision
from serve_app.models.target import Collectives, TPContext
from serve_app.models.target_config import is_hybrid
from serve_app.tokenizer import Tokenizer
from serve_app.vision import MediaConfig, normalise

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_joined: list[Collectives] = []  # this process's group, closed by release_tensor_parallel


def init_tensor_parallel(
    rendezvous: str, tp_rank: int, tp_size: int, backend: str | None = None,
    timeout_s: float = 300.0, host_memory: bool = True,
) -> Collectives:
    """Join a TP group at `rendezvous` (tcp://host:port): NCCL on CUDA; on CPU gloo, whose
    collectives go through shared memory when every rank is on this host (`host_memory`:
    collectives.HostGroup, ~20x cheaper per collective than gloo's loopback TCP)."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=rendezvous, rank=tp_rank,
                                world_size=tp_size, timeout=timedelta(seconds=timeout_s))
    group: Collectives = TorchGroup(dist.group.WORLD)
    if backend == "gloo" and host_memory:
        group = host_collectives(group)
    _joined.append(group)
    return group


def release_tensor_parallel() -> None:
    """Leave the TP group for a process that exits on its own (Ray kills its rank actors).

    Callers drop the modules and runners that hold the group first: a gloo group whose last
    reference dies during interpreter exit aborts the process ("terminate called without an
    active exception"), which made a 2-core CI run fail one time in ten."""
    gc.collect()
    while _joined:
        _joined.pop().close()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def load_target(
    target_path: str | os.PathLike[str], config: ReferenceEngineConfig,
    device: torch.device | str, tp_rank: int, tp_size: int, group: Collectives | None,
) -> KimiForCausalLM | PagedK3:
    """The target, by its config.json: K2 layout (MLA + MoE), or the K3 hybrid with its KDA
    state slots and the configured rollback strategy."""
    dtype = DTYPES[config.dtype]
    if not is_hybrid(target_path):
        return load_kimi(target_path, dtype=dtype, device=device, tp_rank=tp_rank,
                         tp_size=tp_size, group=group)
    model = load_k3(target_path, dtype=dtype, device=device,
                    tp=TPContext(tp_rank, tp_size, group))
    # One source of truth for what a request's state costs: the pool's slot must be what the
    # capacity planner computes for the same config.json (conv in the weights' dtype, SSM fp32).
    planned = describe_model(target_path).kda_state_bytes(
        conv_bytes=dtype.itemsize, ssm_bytes=4, attention_tp=tp_size)
    snapshots = config.prefix_cache.state_snapshots if config.prefix_cache.enabled else 0
    return PagedK3(model.eval(), config.state_slots or config.max_batch_size,
                   config.speculation.kda_rollback, planned_slot_bytes=planned,
                   snapshot_slots=snapshots)


def load_prompt_images(target_path: str | os.PathLike[str], dtype: torch.dtype,
                       device: torch.device | str) -> PromptImages | None:
    """The target's vision tower and projector, when its config.json has a vision_config
    (None: a text model, which refuses images), normalising the patches by the folder's
    preprocessor_config.json as K3's processor does. Every tensor-parallel rank loads all of
    it (docs/hybrid-engine.md, "Images")."""
    tower = load_k3_vision(target_path, dtype=dtype, device=device)
    if tower is None:
        return None
    media = MediaConfig.from_folder(target_path)
    if media is None:
        raise ValueError(f"{target_path}: config.json has a vision_config but the folder has no "
                         "preprocessor_config.json (its image mean and std)")
    return PromptImages(tower, functools.partial(normalise, media=media), torch.device(device),
                        dtype)


def build_runner(
    target_path: str | os.PathLike[str],
    draft_path: str | os.PathLike[str] | None,
    config: ReferenceEngineConfig,
    tp_rank: int = 0,
    tp_size: int = 1,
    group: Collectives | None = None,
) -> ModelRunner:
    """Load this rank's shards of the target and the draft, on the same device."""
    device: torch.device | str = config.device
    if config.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = DTYPES[config.dtype]
    target = load_target(target_path, config, device, tp_rank, tp_size, group)
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu:
        column_major_linears(target.model if isinstance(target, PagedK3) else target)
    images = load_prompt_images(target_path, dtype, device) if is_hybrid(target_path) else None
    allocator = PagedAllocator(config.kv_capacity_tokens, config.page_size)
    proposer = None
    if draft_path is not None:
        draft = load_dspark(draft_path, dtype=dtype, device=device)
        check_pair(target.config, draft.config, config.speculation.gamma)
        draft = shard_dspark(draft, tp_rank, tp_size, group)
        if on_cpu:
            column_major_linears(draft)
        proposer = DSparkProposer(draft, target.embed_weight, target.lm_head_weight, allocator)
    return ModelRunner(target, proposer, allocator, tp_rank, tp_size, group,
                       prefix_cache=config.prefix_cache if config.prefix_cache.enabled else None,
                       images=images)


def build_engine(
    runner: ModelRunner,
    config: ReferenceEngineConfig,
    eos_token_ids: list[int] | None = None,
    detokenize: Detokenize | None = None,
    tokenizer: Tokenizer | None = None,
    max_model_len: int | None = None,
) -> EngineCore:
    """Rank 0's engine around its runner. With the model's `tokenizer`, the engine compiles
    and enforces requests' output grammars (serve_app/grammar). `max_model_len`: the
    deployment's context length (config.context_length); None: the pair's own."""
    target_cfg = runner.target.config
    proposer = runner.proposer
    draft_cfg = proposer.draft.config if isinstance(proposer, DSparkProposer) else None
    config_eos = getattr(target_cfg, "eos_token_id", None)
    eos = eos_token_ids if eos_token_ids is not None else (
        [] if config_eos is None else list(config_eos) if isinstance(config_eos, list)
        else [config_eos])
    return EngineCore(
        runner,
        eos_token_ids=eos,
        detokenize=detokenize,
        max_batch_size=config.max_batch_size,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
        max_prefill_tokens_per_request=config.max_prefill_tokens_per_request,
        speculation=config.speculation,
        max_model_len=max_model_len or pair_context(target_cfg, draft_cfg,
                                                    config.speculation.enabled),
        grammar=GrammarCompiler(ll_tokenizer(tokenizer, target_cfg.vocab_size, eos))
        if tokenizer is not None else None,
        grammar_closing=ClosingPaths.for_tokenizer(tokenizer, target_cfg.vocab_size, eos)
        if tokenizer is not None and config.grammar_budget == "close" else None,
    )
