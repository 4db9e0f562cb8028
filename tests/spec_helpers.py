"""Speculative-decoding test helpers shared by the K2-layout and hybrid engine tests: test-only
proposers behind the draft interface (full, partial and zero acceptance on demand), staggered
runs, and exact target marginals for the chi-square test. `target` is anything with the
engine's target interface (KimiForCausalLM, or PagedK3 with enough state slots)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from scipy.stats import chisquare

from serve_app.config import ReferenceEngineConfig, SpeculationConfig
from serve_app.engines.reference.builder import build_engine, build_runner
from serve_app.engines.reference.engine import EngineCore, RequestOutput
from serve_app.engines.reference.model_runner import ModelRunner
from serve_app.engines.reference.sampling import SamplingParams
from serve_app.engines.reference.sequence import Sequence
from serve_app.engines.reference.spec_budget import Plan, VerifyBudget
from serve_app.models.dspark import DraftOutput
from serve_app.models.kv_cache import PagedAllocator

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, max_tokens=4, ignore_eos=True)


def detok(ids: list[int]) -> str:
    return "".join(chr(48 + i) for i in ids)



def greedy_continuation(target: Any, ids: list[int], n: int) -> list[int]:
    cache = target.new_cache(len(ids) + n + 16)
    cache.add(0)
    logits = target(torch.tensor([ids]), cache, [0], torch.tensor([len(ids)])).logits
    out = [int(logits[0, -1].argmax())]
    while len(out) < n:
        logits = target(torch.tensor([[out[-1]]]), cache, [0], torch.tensor([1])).logits
        out.append(int(logits[0, 0].argmax()))
    return out


class OracleProposer:
    """Proposes the target's own greedy continuation; `correct` decides how many positions stay
    right (the rest are replaced by wrong tokens). Deterministic: q is one-hot."""

    tap_layers: tuple[int, ...] = ()

    def __init__(self, target: Any, gamma: int,
                 correct: Callable[[], int] | None = None) -> None:
        self.target, self.gamma, self.correct = target, gamma, correct
        self.vocab = target.config.vocab_size
        # Per prompt, the target's greedy continuation so far: an answer still on it reads its
        # next drafts from there, instead of a prefill of prompt + answer every step (which
        # took most of these tests' time). An answer off it gets its own continuation.
        self.continuations: dict[tuple[int, ...], list[int]] = {}

    def continuation(self, s: Sequence) -> list[int]:
        """The target's greedy continuation of s.all_ids, gamma tokens."""
        prompt, done = tuple(s.prompt_ids), len(s.output_ids)
        known = self.continuations.get(prompt, [])
        if known[:done] != s.output_ids:
            return greedy_continuation(self.target, s.all_ids, self.gamma)
        if len(known) < done + self.gamma:
            known = greedy_continuation(self.target, list(prompt),
                                        max(done + self.gamma, 2 * len(known), 32))
            self.continuations[prompt] = known
        return known[done:done + self.gamma]

    def add(self, rid: object, cached: int = 0) -> None: ...
    def free(self, rid: object) -> None: ...
    def append(self, rids: object, taps: object) -> None: ...
    def settle(self, rids: object) -> None: ...
    def commit(self, rids: object, lengths: object) -> None: ...
    def follow_propose(self, rids: object, anchors: object) -> None: ...

    def propose(self, seqs: list[Sequence], masks: object = None) -> DraftOutput:
        rows = []
        for s in seqs:
            row = self.continuation(s)
            n = self.gamma if self.correct is None else self.correct()
            for j in range(n, self.gamma):
                row[j] = (row[j] + 1 + j) % self.vocab
            rows.append(row)
        return DraftOutput(torch.tensor(rows), None, None, torch.empty(0))


class SkewedProposer:
    """Samples drafts from a fixed, sharply peaked random distribution per position and
    returns it as q: far from the target's p, so a wrong rejection rule shows."""

    tap_layers: tuple[int, ...] = ()

    def __init__(self, vocab: int, gamma: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.q = torch.softmax(3.0 * torch.randn(gamma, vocab, generator=g), -1)
        self.gamma = gamma

    def add(self, rid: object, cached: int = 0) -> None: ...
    def free(self, rid: object) -> None: ...
    def append(self, rids: object, taps: object) -> None: ...
    def settle(self, rids: object) -> None: ...
    def commit(self, rids: object, lengths: object) -> None: ...
    def follow_propose(self, rids: object, anchors: object) -> None: ...

    def propose(self, seqs: list[Sequence], masks: object = None) -> DraftOutput:
        toks = torch.stack([torch.multinomial(self.q, 1, generator=s.generator).squeeze(-1)
                            for s in seqs])
        probs = self.q.expand(len(seqs), -1, -1)
        return DraftOutput(toks, probs, None, torch.empty(0))


class RandomWindows(VerifyBudget):
    """Windows drawn at random for each request and step (seeded; the draft run for a random
    subset, 0..its cap drafts each), from no model output at all: any window choice made
    without the target's verdict on that step must leave the output exactly the target's.
    Ragged in every batch; seeded requests too (the engine's budget would fix theirs)."""

    def __init__(self, gamma: int, seed: int = 0) -> None:
        super().__init__(gamma)
        self.rng = random.Random(seed)

    def to_draft(self, classes: object, rids: list[object], caps: object,
                 fixed: object) -> list[int]:
        return [b for b in range(len(rids)) if self.rng.random() < 0.8]

    def plan(self, classes: object, rids: object, confidence: object, caps: list[int],
             drafted: object, fixed: object) -> Plan:
        drafts = [self.rng.randint(0, max(c, 0)) for c in caps]
        for k in drafts:
            self.draft_histogram[k] += 1
        return Plan(drafts, 0.0, 0.0, "random")


def engine_with(target: Any, proposer: object | None, *, gamma: int | None = None,
                capacity: int = 4096, windows: str = "full", **kwargs: object) -> EngineCore:
    """`windows`: "full" (every request verifies gamma drafts), "adaptive" (the engine's verify
    budget) or "random" (`RandomWindows`)."""
    allocator = PagedAllocator(capacity, 16)
    runner = ModelRunner(target, proposer, allocator)  # type: ignore[arg-type]
    engine = EngineCore(runner, eos_token_ids=[target.config.eos_token_id],
                        speculation=SpeculationConfig(enabled=proposer is not None, gamma=gamma,
                                                      adaptive=windows != "full"),
                        **kwargs)  # type: ignore[arg-type]
    if windows == "random":
        engine.budget = RandomWindows(engine.gamma)
    return engine


def engine_from(pair: tuple[Path, Path], draft: bool = True, engine: dict[str, Any] | None = None,
                **spec: object) -> EngineCore:
    """The builder's engine for a checkpoint pair; `engine`: more ReferenceEngineConfig fields."""
    cfg = ReferenceEngineConfig(**{"kv_capacity_tokens": 4096, **(engine or {})},
                                speculation=SpeculationConfig(**spec))  # type: ignore[arg-type]
    return build_engine(build_runner(pair[0], pair[1] if draft else None, cfg), cfg)


def run_staggered(engine: EngineCore, prompts: list[list[int]],
                  params: SamplingParams = GREEDY) -> list[list[int]]:
    """Half the requests start at once; one more joins after every step."""
    ids: list[str] = []
    tokens: dict[str, list[int]] = {}
    queue = list(prompts)
    for p in queue[: len(queue) // 2]:
        ids.append(engine.add_request(p, params))
    queue = queue[len(queue) // 2:]
    done: set[str] = set()
    while len(done) < len(prompts):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                done.add(out.request_id)
        if queue:
            ids.append(engine.add_request(queue.pop(0), params))
    return [tokens[i] for i in ids]


def random_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab - 2) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def exact_marginals(target: Any, prompt: list[int], params: SamplingParams
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """P(2nd token) and P(3rd token) by enumerating every first and second token."""
    from serve_app.engines.reference.sampling import target_probs

    v = target.config.vocab_size

    def next_probs(seqs: list[list[int]]) -> torch.Tensor:
        cache = target.new_cache(len(seqs) * (len(seqs[0]) + 16))
        for i in range(len(seqs)):
            cache.add(i)
        n = len(seqs[0])
        logits = target(torch.tensor(seqs), cache, list(range(len(seqs))),
                        torch.full((len(seqs),), n)).logits[:, -1]
        return target_probs(logits, params)

    p1 = next_probs([prompt])[0]
    p2_given = next_probs([[*prompt, a] for a in range(v)])  # [v, v]
    p2 = p1 @ p2_given
    seqs = [[*prompt, a, b] for a in range(v) for b in range(v)]
    p3_given = next_probs(seqs).view(v, v, v)
    p3 = torch.einsum("a,ab,abc->c", p1, p2_given, p3_given)
    return p2, p3


def chi2_pvalue(samples: list[int], probs: torch.Tensor) -> float:
    n = len(samples)
    expected = (probs.double() * n).numpy()
    observed = torch.bincount(torch.tensor(samples), minlength=len(probs)).double().numpy()
    # Pool the rare outcomes so every cell expects at least 5.
    keep = expected >= 5
    exp = [*list(expected[keep]), expected[~keep].sum()]
    obs = [*list(observed[keep]), observed[~keep].sum()]
    if exp[-1] == 0:
        exp, obs = exp[:-1], obs[:-1]
    scale = sum(obs) / sum(exp)  # float rounding of the exact probabilities
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


# Samples that show a wrong rejection rule (at a rejection, resample from p rather than from
# normalize(max(p - q, 0))): the 2nd token's chi-square p-value must fall below 1e-6. Measured
# over disjoint slices of 3,000 seeded samples, the largest p-value at 1,000 samples was 1.3e-8
# (the K2 layout), at 1,500 2.3e-21 (K2), 3.9e-37 (K3), 4.1e-28 (K3 under a grammar). The exact
# rule's tests keep 3,000: there the power to find a small bias is what matters.
WRONG_RULE_SAMPLES = 1500


def sample_many(engine: EngineCore, prompt: list[int], params: SamplingParams, n: int
                ) -> list[list[int]]:
    outs: list[RequestOutput] = []
    for chunk in range(0, n, 500):
        plist = [SamplingParams(**{**params.__dict__, "seed": chunk + i}) for i in range(500)]
        outs += engine.generate([prompt] * 500, plist)
    return [o.token_ids for o in outs]


def prefill_for_handoff(engine: EngineCore, prompt: list[int], params: SamplingParams) -> str:
    """Add `prompt` as a hand-off request and step until it is prefilled (nothing streams
    from the prefill side meanwhile); its request id, ready for `engine.export`."""
    rid = engine.add_request(prompt, params, hand_off=True)
    while True:
        outs = [o for o in engine.step() if o.request_id == rid]
        assert all(not o.token_ids for o in outs)
        if any(o.prefilled for o in outs):
            return rid


def _tensor_parallel_worker(rank: int, world: int, port: int, paths: tuple[Path, Path | None],
                            engine_cfg: ReferenceEngineConfig, tokenizer_dir: Path | None,
                            job: Callable[..., Any], job_args: tuple, results: Any,
                            received: Any, host_memory: bool) -> None:
    from serve_app.engines.reference.builder import init_tensor_parallel, release_tensor_parallel
    from serve_app.tokenizer import load_tokenizer, stop_token_ids

    torch.set_num_threads(1)
    group = init_tensor_parallel(f"tcp://127.0.0.1:{port}", rank, world, "gloo",
                                 host_memory=host_memory)
    runner = build_runner(paths[0], paths[1], engine_cfg, rank, world, group)
    if rank == 0:
        if tokenizer_dir is None:
            engine = build_engine(runner, engine_cfg)
        else:
            tokenizer = load_tokenizer(tokenizer_dir)
            engine = build_engine(runner, engine_cfg, stop_token_ids(tokenizer),
                                  tokenizer.decode, tokenizer=tokenizer)
        result = job(engine, *job_args)
        runner.shutdown()
        results.put(result)
        # Tensors in the result travel in this process's shared memory: stay until owned.
        received.wait(timeout=300)
        del engine
    else:
        runner.follow()
    del runner, group
    release_tensor_parallel()


def rank_processes() -> Any:
    """Where tests start rank processes: a fork server that imports torch and the engine once
    per test process, each rank a fork of it, instead of a fresh interpreter per rank (~3 CPU-s
    of imports each, on a 2-core machine). Not a fork of the test process: it may hold threads
    (Ray's, torch's)."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "serve_app.engines.reference.builder", "spec_helpers"])
    return ctx


def run_ranks(fn: Callable[..., None], args: tuple, nprocs: int = 2) -> None:
    """`fn(rank, *args)` in `nprocs` rank processes forked from `rank_processes`' server, until
    all return (torch.multiprocessing's start_processes: its mp.spawn always spawns, whatever
    its start_method says)."""
    import torch.multiprocessing as mp

    rank_processes()  # the server's preloaded imports
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def run_tensor_parallel(paths: tuple[Path, Path | None], engine_cfg: ReferenceEngineConfig,
                        world: int, job: Callable[..., Any], job_args: tuple = (),
                        tokenizer_dir: Path | None = None,
                        own: Callable[[Any], Any] = lambda result: result,
                        host_memory: bool = True) -> Any:
    """`job(engine, *job_args)` on rank 0 of an engine at TP `world` in rank processes, as a
    served replica runs it (the other ranks follow; their collectives through shared memory,
    or gloo's with `host_memory` false: builder.init_tensor_parallel); its result, passed
    through `own` (copy any tensors in it: they live in the worker's shared memory until
    `own` returns). `job` must be importable (a module-level function): it is pickled."""
    from serve_app.netutil import free_port

    ctx = rank_processes()
    results, received = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_tensor_parallel_worker,
                         args=(r, world, port, paths, engine_cfg, tokenizer_dir, job, job_args,
                               results, received, host_memory)) for r in range(world)]
    for proc in procs:
        proc.start()
    result = own(results.get(timeout=600))
    received.set()
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    return result


def _generate_each(engine: EngineCore, requests: list[tuple[list[int], SamplingParams]]
                   ) -> list[RequestOutput]:
    return [engine.generate([ids], params)[0] for ids, params in requests]


def generate_tensor_parallel(paths: tuple[Path, Path | None], engine_cfg: ReferenceEngineConfig,
                             tokenizer_dir: Path, requests: list[tuple[list[int], SamplingParams]],
                             world: int) -> list[RequestOutput]:
    """Each (prompt ids, params) of `requests` in turn, by an engine at TP `world` in rank
    processes, as a served replica runs it. Seeded sampling is exact only at the same
    TP: between TP sizes the float sums differ in their last bits, and an inverse-CDF draw
    that lands between two ids' cumulative probabilities picks the neighbour."""
    return run_tensor_parallel(paths, engine_cfg, world, _generate_each, (requests,),
                               tokenizer_dir)
