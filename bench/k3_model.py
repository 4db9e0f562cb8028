"""The mini Kimi K3 (KDA + MLA hybrid) vs a K2-shaped target of similar size, on CPU, in one run.

    python bench/k3_model.py                           # 512-token prompt, 5 repeats
    python bench/k3_model.py --prompt 256 --repeats 5 --json out.json

Both models have random weights (only speed and memory are measured) and run fp32, batch 1,
in the same process, variants alternating within each repeat. Reported (medians over repeats):

- prefill tokens/s of a `--prompt`-token prompt: K3 with the chunked KDA algorithm (what
  K3ForCausalLM uses for T > 1, SGLang's chunk_kda), K3 with the recurrent KDA algorithm forced
  (token-by-token recurrence inside each KDA layer), and K2 (KimiForCausalLM over a paged
  latent cache);
- 1-token decode ms after the prompt;
- 8-row verify ms after the prompt: K3 `verify` (the states after every position, as SGLang
  keeps them by default), K2 an 8-token forward (rolled back afterwards);
- per-request state: K3's KDA states are a fixed size whatever the length (conv window + SSM
  state per KDA layer); KV bytes per token (K3: its MLA layers' latent cache; K2: every layer's).
  Bytes are given at the serving dtypes (conv / KV bf16, SSM fp32, as SGLang keeps them) and
  as measured in this fp32 run.

The K2 config is tests/tiny_models.py's tiny target scaled to the mini K3's widths (hidden 256,
8 layers, vocab 4096, the same MLA sizes, 16 experts top-4, 2 shared) with the expert width
chosen to land near the mini K3's parameter count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the random-weights helper the tests use

from tiny_models import randomize  # noqa: E402

from serve_app.models.k3 import K3ForCausalLM, K3State  # noqa: E402
from serve_app.models.k3_config import K3Config, k3_parameter_count  # noqa: E402
from serve_app.models.kda import KimiDeltaAttention  # noqa: E402
from serve_app.models.kimi import KimiForCausalLM  # noqa: E402
from serve_app.models.kimi_config import KimiConfig  # noqa: E402

MINI_K3 = ROOT / "tests" / "data" / "mini-k3-config.json"
VERIFY_ROWS = 8


def k2_config(vocab_size: int, moe_intermediate_size: int = 84) -> KimiConfig:
    """A K2 / DeepseekV3-shaped target with the mini K3's widths (tests/tiny_models.py's
    approach: a raw HF config dict through KimiConfig.from_dict)."""
    raw: dict[str, Any] = {
        "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size":
        moe_intermediate_size, "num_hidden_layers": 8, "num_attention_heads": 6,
        "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "v_head_dim": 32, "n_routed_experts": 16, "n_shared_experts": 2,
        "num_experts_per_tok": 4, "first_k_dense_replace": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size, "max_position_embeddings": 4096, "rope_theta": 10000.0,
        "eos_token_id": 2, "bos_token_id": 1, "torch_dtype": "float32",
    }
    return KimiConfig.from_dict(raw, "bench K2-shaped target")


@contextmanager
def recurrent_kda(model: K3ForCausalLM) -> Iterator[None]:
    """Force every KDA layer onto the recurrent algorithm (whatever T)."""
    layers = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    for m in layers:
        def forward(x: torch.Tensor, state: Any, algorithm: str = "chunked",
                    chunk_size: int = 64, _m: KimiDeltaAttention = m) -> Any:
            return KimiDeltaAttention.forward(_m, x, state, "recurrent", chunk_size)
        m.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        for m in layers:
            del m.forward


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def k2_runner(model: KimiForCausalLM, prompt: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """K2 prefill / decode / verify closures; decode and verify roll the cache back after."""
    n = prompt.shape[1]
    cache = model.new_cache(2 * n + 2 * VERIFY_ROWS + 32)  # the committed prompt + a prefill
    rid = "r"
    cache.add(rid)
    model(prompt, cache, [rid], torch.tensor([n]))  # the committed prompt
    one = prompt[:, :1]
    window = prompt[:, :VERIFY_ROWS]

    def prefill() -> None:
        cache.add("p")
        model(prompt, cache, ["p"], torch.tensor([n]))
        cache.free("p")

    def step(ids: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            model(ids, cache, [rid], torch.tensor([ids.shape[1]]))
            cache.truncate(rid, n)
        return run

    return {"prefill": prefill, "decode": step(one), "verify": step(window)}


def state_bytes(k3: K3Config, k2: KimiConfig, state: K3State) -> dict[str, Any]:
    """K3's fixed KDA state per request and both models' KV bytes per token."""
    p, h, d, k = k3.kda_proj_size, k3.kda_num_heads, k3.kda_head_dim, k3.kda_conv_kernel
    n_kda, n_mla = len(k3.kda_layers), len(k3.mla_layers)
    conv_el, ssm_el = (k - 1) * 3 * p, h * d * d
    measured_kda = sum(s.conv.numel() * s.conv.element_size() + s.ssm.numel() *
                       s.ssm.element_size() for s in state.kda.values())
    return {
        "k3_kda_layers": n_kda, "k3_mla_layers": n_mla, "k2_layers": k2.num_hidden_layers,
        "k3_kda_state_bytes": n_kda * (2 * conv_el + 4 * ssm_el),  # conv bf16, SSM fp32
        "k3_kda_state_bytes_fp32_run": measured_kda,
        "k3_kv_bytes_per_token": 2 * n_mla * k3.mla_cache_dim,  # bf16 latent cache
        "k2_kv_bytes_per_token": 2 * k2.num_hidden_layers * k2.latent_dim,
        "k3_kv_bytes_per_token_fp32_run": 4 * n_mla * k3.mla_cache_dim,
        "k2_kv_bytes_per_token_fp32_run": 4 * k2.num_hidden_layers * k2.latent_dim,
    }


def run(prompt_len: int, repeats: int, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    k3cfg = K3Config.from_file(MINI_K3).model_copy(update={"dtype": "float32"})
    k3 = K3ForCausalLM(k3cfg).eval()
    randomize(k3, seed)
    k2cfg = k2_config(k3cfg.vocab_size)
    k2 = KimiForCausalLM(k2cfg).eval()
    randomize(k2, seed)
    g = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, k3cfg.vocab_size, (1, prompt_len), generator=g)

    with torch.no_grad():
        _, k3_state = k3(prompt)
        one, window = prompt[:, :1], prompt[:, :VERIFY_ROWS]

        def k3_recurrent_prefill() -> None:
            with recurrent_kda(k3):
                k3(prompt)

        k2_calls = k2_runner(k2, prompt)
        variants: dict[str, Callable[[], Any]] = {
            "prefill/k3_chunked": lambda: k3(prompt),
            "prefill/k3_recurrent": k3_recurrent_prefill,
            "prefill/k2": k2_calls["prefill"],
            "decode/k3": lambda: k3(one, k3_state),
            "decode/k2": k2_calls["decode"],
            "verify/k3": lambda: k3.verify(window, k3_state),
            "verify/k2": k2_calls["verify"],
        }
        for fn in variants.values():  # warm-up
            fn()
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(repeats):
            for name, fn in variants.items():
                times[name].append(timed(fn))
    med = {name: statistics.median(v) for name, v in times.items()}
    return {
        "bench": "k3_model",
        "prompt_tokens": prompt_len, "repeats": repeats, "verify_rows": VERIFY_ROWS,
        "threads": torch.get_num_threads(), "dtype": "float32", "batch": 1,
        "params": {"k3": k3_parameter_count(k3cfg),
                   "k2": sum(p.numel() for p in k2.parameters())},
        "prefill_tok_s": {v: prompt_len / med[f"prefill/{v}"]
                          for v in ("k3_chunked", "k3_recurrent", "k2")},
        "decode_ms": {m: 1e3 * med[f"decode/{m}"] for m in ("k3", "k2")},
        "verify_ms": {m: 1e3 * med[f"verify/{m}"] for m in ("k3", "k2")},
        "state": state_bytes(k3cfg, k2cfg, k3_state),
        "times_s": times,
    }


def print_table(r: dict[str, Any]) -> None:
    s = r["state"]
    print(f"\nmini K3 ({r['params']['k3'] / 1e6:.2f} M params) vs K2-shaped target "
          f"({r['params']['k2'] / 1e6:.2f} M), random weights, fp32, batch 1, "
          f"{r['threads']} threads, {r['prompt_tokens']}-token prompt, median of "
          f"{r['repeats']}")
    head = f"{'metric':<34} {'K3':>22} {'K2-shaped':>12}"
    print(head)
    print("-" * len(head))
    pf = r["prefill_tok_s"]
    print(f"{'prefill tokens/s (chunked KDA)':<34} {pf['k3_chunked']:>22.0f} {pf['k2']:>12.0f}")
    print(f"{'prefill tokens/s (recurrent KDA)':<34} {pf['k3_recurrent']:>22.0f} {'-':>12}")
    print(f"{'1-token decode ms':<34} {r['decode_ms']['k3']:>22.2f} {r['decode_ms']['k2']:>12.2f}")
    print(f"{f'{VERIFY_ROWS}-row verify ms':<34} {r['verify_ms']['k3']:>22.2f} "
          f"{r['verify_ms']['k2']:>12.2f}")
    fixed = f"{s['k3_kda_state_bytes']:,} ({s['k3_kda_layers']} KDA)"
    print(f"{'per-request fixed state bytes':<34} {fixed:>22} {0:>12}")
    print(f"{'KV bytes / token':<34} {s['k3_kv_bytes_per_token']:>14,} ({s['k3_mla_layers']} MLA) "
          f"{s['k2_kv_bytes_per_token']:>12,}")
    n = r["prompt_tokens"]
    k3_total = s["k3_kda_state_bytes"] + n * s["k3_kv_bytes_per_token"]
    print(f"{f'state bytes at {n} tokens':<34} {k3_total:>22,} "
          f"{n * s['k2_kv_bytes_per_token']:>12,}")
    print("(bytes at serving dtypes: conv/KV bf16, SSM fp32; fp32-run figures in the JSON)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (prefill)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    report = run(args.prompt, args.repeats, args.seed)
    print_table(report)
    text = json.dumps(report)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
