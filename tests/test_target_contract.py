"""The target/cache contract (serve_app/models/target.py): both targets implement it, with the
contract's signatures, and the engine's spine asks no family questions."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_k3_config, write_random_k3_pair, write_tiny_pair

from serve_app.config import ReferenceEngineConfig
from serve_app.engines.reference.builder import build_runner
from serve_app.models import target as contract

ROOT = Path(__file__).resolve().parent.parent
SPINE = [ROOT / "serve_app/engines/reference" / f for f in
         ("engine.py", "scheduler.py", "model_runner.py")]


@pytest.fixture(scope="module")
def runners(tmp_path_factory: pytest.TempPathFactory) -> dict:
    config = ReferenceEngineConfig(kv_capacity_tokens=512, max_batch_size=4,
                                   prefix_cache={"enabled": True})
    k2 = write_tiny_pair(tmp_path_factory.mktemp("k2"))
    k3 = write_random_k3_pair(tmp_path_factory.mktemp("k3"), tiny_k3_config(256))
    return {"k2": build_runner(k2[0], k2[1], config), "k3": build_runner(k3[0], k3[1], config)}


def public_signature(obj: object, name: str) -> list[tuple[str, object]]:
    params = inspect.signature(getattr(obj, name)).parameters.values()
    return [(p.name, p.default) for p in params if p.name != "self"]


@pytest.mark.parametrize("family", ["k2", "k3"])
def test_both_targets_and_their_caches_implement_the_contract(runners: dict,
                                                              family: str) -> None:
    runner = runners[family]
    target, cache = runner.target, runner.cache
    assert isinstance(target, contract.Target)
    assert isinstance(cache, contract.TargetCache)
    assert isinstance(runner.proposer, contract.WindowedState)
    methods = {contract.Target: ("__call__", "new_cache"),
               contract.TargetCache: ("add", "commit", "free", "length")}
    for protocol, obj in ((contract.Target, target), (contract.TargetCache, cache)):
        for name in methods[protocol]:
            # nn.Module's __call__ runs `forward` (the K2 target); PagedK3 defines __call__.
            own = "forward" if name == "__call__" and hasattr(type(obj), "forward") else name
            got = public_signature(type(obj), own)
            assert got == public_signature(protocol, name), (family, protocol.__name__, name)
    config = target.config
    assert isinstance(config.vocab_size, int) and config.max_position_embeddings > 0
    runner.add("probe")
    out = target(torch.tensor([[1, 2, 3]]), cache, ["probe"], torch.tensor([3]))
    runner.free("probe")
    assert isinstance(out, contract.TargetOutput)
    assert out.logits.shape == (1, 3, config.vocab_size) and out.logits.dtype == torch.float32


@pytest.mark.parametrize("family", ["k2", "k3"])
def test_last_only_gives_each_rows_last_new_token_logits(runners: dict, family: str) -> None:
    """Rows of 3, 5 and 0 new tokens (right-padded): `last_only` returns [B, 1, vocab], each
    row's logits at its last new token, as the whole forward computes them (the same dot
    products in a smaller matrix product: fp32's rounding apart, torch's default tolerance)."""
    runner = runners[family]
    target, cache = runner.target, runner.cache
    ids = torch.tensor([[5, 6, 7, 0, 0], [1, 2, 3, 4, 9], [0, 0, 0, 0, 0]])
    num_new = torch.tensor([3, 5, 0])
    outs = []
    for last_only in (False, True):
        for r in ("a", "b", "c"):
            runner.add(r)
        outs.append(target(ids, cache, ["a", "b", "c"], num_new, last_only=last_only).logits)
        for r in ("a", "b", "c"):
            runner.free(r)
    full, last = outs
    assert last.shape == (3, 1, target.config.vocab_size)
    torch.testing.assert_close(last[:2, 0], full[[0, 1], [2, 4]])


def test_only_a_target_with_per_request_state_offers_checkpoints(runners: dict) -> None:
    k2, k3 = runners["k2"].cache, runners["k3"].cache
    assert k2.state_slots is None and k2.checkpoints is None
    assert k3.state_slots == 4 and isinstance(k3.checkpoints, contract.StateCheckpoints)
    # The prefix cache learns the family from the cache alone.
    assert runners["k2"].prefix.states is None and runners["k3"].prefix.states is k3


def spine_names(path: Path) -> set[str]:
    """Every name and attribute the module's code uses, and what it imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("path", SPINE, ids=lambda p: p.name)
def test_the_engine_spine_has_no_family_branch(path: Path) -> None:
    names = spine_names(path)
    family_types = {"HybridCache", "PagedKVCache", "PagedK3", "KimiForCausalLM",
                    "K3ForCausalLM", "KDAStatePool"}
    family_modules = {"serve_app.models.k3_paged", "serve_app.models.kimi",
                      "serve_app.models.k3", "serve_app.models.kda"}
    assert not names & family_types, names & family_types
    assert not names & family_modules, names & family_modules
    assert not {n for n in names if "hybrid" in n.lower()}
    text = path.read_text()
    for probe in ("getattr(self.cache", "getattr(runner", "getattr(self.target"):
        assert probe not in text, probe
