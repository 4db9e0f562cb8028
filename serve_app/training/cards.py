"""Write the model cards of the embedded pair from the metrics the trainings saved (and,
if given, a `bench/spec_decode.py --json` report)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TRAIN_COMMAND = "python -m serve_app.training all --budget-minutes 55 --seed 0"


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir()
               if f.is_file() and f.suffix in (".safetensors", ".json"))


def _bench_lines(bench: dict[str, Any]) -> list[str]:
    if not bench:
        return ["Run `python bench/spec_decode.py` for speed and acceptance on this machine."]
    lines = [f"`python bench/spec_decode.py` ({bench['prompts']} held-out prompts x "
             f"{bench['max_tokens']} new tokens, batch 1, {bench['threads']} thread(s), "
             f"{bench['repeats']} repeats; medians over prompts):", "",
             "| temperature | target-only tok/s | speculative tok/s | speedup (median / aggregate) "
             "| accept length (macro / token-weighted) | accept rate | lossless |",
             "|---|---|---|---|---|---|---|"]
    for r in bench["results"]:
        lossless = {True: "identical outputs", False: "NOT identical",
                    None: "exact sampling (by construction)"}[r["lossless_identical"]]
        lines.append(
            f"| {r['temperature']} | {r['target_only_tok_s']['median']:.1f} | "
            f"{r['speculative_tok_s']['median']:.1f} | {r['speedup']['median']:.2f}x / "
            f"{r['speedup']['aggregate']:.2f}x | {r['spec_accept_length']['macro']:.2f} / "
            f"{r['spec_accept_length']['token_weighted']:.2f} | {r['spec_accept_rate']:.3f} | "
            f"{lossless} |")
    lines.append("")
    for r in bench["results"]:
        lines.append(f"- T={r['temperature']}: spec_correct_drafts_histogram "
                     f"{r['spec_correct_drafts_histogram']}")
    return lines


def write_cards(assets: Path, bench: dict[str, Any] | None = None) -> None:
    target_dir, draft_dir = assets / "kimi-mini", assets / "kimi-mini-dspark"
    tm = _load(target_dir / "training_metrics.json")
    dm = _load(draft_dir / "training_metrics.json")
    tcfg = _load(target_dir / "config.json")
    dcfg = _load(draft_dir / "config.json")
    eng = dm.get("engine_heldout_greedy", {})
    bench_lines = _bench_lines(bench or {})
    common_data = [
        "## Data",
        "The Python standard library's own `.py` sources on the training machine (CPython "
        "3.11.7; `test/`, `idlelib/`, `lib2to3/`, `encodings/` and a few other folders skipped), "
        "read at training time; nothing downloaded. Files are split by a hash of their path: "
        "1 in 20 is held out (`serve_app/assets/heldout_prompts.json` lists them). About a "
        "quarter of the training characters are chat exchanges built from the training files "
        "(user: `Write the function NAME from the MODULE module.`, assistant: its source).",
    ]
    p = tm.get("parameters", {})
    target_card = [
        "# kimi-mini: a tiny Kimi K2 / DeepseekV3-architecture target for CPU demos", "",
        "Trained from scratch on CPU so that the project's demo and tests show real speculative "
        "decoding offline. It writes Python-looking code; it is not a useful assistant.", "",
        "## Architecture",
        f"DeepseekV3 layout (`config.json` parses as `KimiConfig`): hidden {tcfg.get('hidden_size')}, "
        f"{tcfg.get('num_hidden_layers')} layers (first {tcfg.get('first_k_dense_replace')} dense, "
        f"intermediate {tcfg.get('intermediate_size')}), MLA with q_lora {tcfg.get('q_lora_rank')} / "
        f"kv_lora {tcfg.get('kv_lora_rank')}, rope {tcfg.get('qk_rope_head_dim')} / nope "
        f"{tcfg.get('qk_nope_head_dim')} / v {tcfg.get('v_head_dim')}, "
        f"{tcfg.get('num_attention_heads')} heads; MoE with {tcfg.get('n_routed_experts')} "
        f"routed experts (top-{tcfg.get('num_experts_per_tok')}, sigmoid, noaux_tc bias) + "
        f"{tcfg.get('n_shared_experts')} shared, moe_intermediate "
        f"{tcfg.get('moe_intermediate_size')}; vocab {tcfg.get('vocab_size')}.",
        f"Parameters: {p.get('total', 0):,} ({p.get('active_per_token', 0):,} active per token). "
        f"Weights bf16 (router bias fp32), {_bytes(target_dir) / 1e6:.1f} MB.", "",
        *common_data, "",
        "## Training",
        f"`{TRAIN_COMMAND}` (or `python -m serve_app.training train-target --budget-minutes 34`): "
        "next-token cross-entropy, AdamW (lr 3e-3, betas 0.9/0.95, wd 0.1), warm-up then cosine "
        "decay over the wall-time budget, 8 x 512-token random windows per step, DeepSeek-V3 "
        "auxiliary-loss-free expert balancing, 2 CPU threads, seed 0.",
        f"Steps {tm.get('steps')}, {tm.get('train_tokens', 0):,} training tokens, wall time "
        f"{tm.get('wall_s', 0) / 60:.1f} min.", "",
        "## Quality",
        f"Held-out perplexity {tm.get('heldout_perplexity')} (per token, on "
        f"{tm.get('heldout_tokens', 0):,} tokens of held-out files, measured on the saved bf16 "
        f"weights). Final training loss (EMA) {tm.get('train_loss_ema')}.", "",
        "## Speculative decoding with kimi-mini-dspark", *bench_lines, "",
    ]
    draft_card = [
        "# kimi-mini-dspark: the DSpark draft of kimi-mini", "",
        "## Architecture",
        f"Published DSpark format (`config.json` with `dflash_config`, parses as `DSparkConfig`; "
        f"`kimi-dspark inspect` validates the tensor names): {dcfg.get('num_hidden_layers')} "
        f"Qwen3-style layers, hidden {dcfg.get('hidden_size')}, "
        f"{dcfg.get('num_attention_heads')} q / {dcfg.get('num_key_value_heads')} kv heads x "
        f"{dcfg.get('head_dim')}, taps target layers "
        f"{dcfg.get('dflash_config', {}).get('target_layer_ids')}, block size (gamma) "
        f"{dcfg.get('block_size')}, Markov head rank {dcfg.get('dflash_config', {}).get('markov_rank')}, "
        f"confidence head, MASK token id {dcfg.get('dflash_config', {}).get('mask_token_id')} "
        "(`<|mask|>`); the target's embedding and lm_head are used, not stored.",
        f"Parameters: {dm.get('parameters', 0):,}. Weights bf16, {_bytes(draft_dir) / 1e6:.1f} MB.", "",
        *common_data, "",
        "## Training",
        f"`{TRAIN_COMMAND}` (or `python -m serve_app.training train-draft --budget-minutes 21`), "
        "after the target. The DSpark objective (SpecForge defaults): per block row k, "
        "0.1 CE + 0.9 L1(p_draft, p_target) + 1.0 BCE(confidence, 1 - L1/2), weighted by "
        "exp(-k/7); teacher-forced Markov inputs; 24 random anchors per sequence, each block "
        "seeing the context strictly before its anchor. Context features and target "
        "distributions come from the shipped (bf16) target itself. Each step mixes 4 corpus "
        "windows with 12 sequences the target generated itself from training prompts (two "
        "thirds greedy, one third at temperature 0.7; a quarter are chat requests), anchors "
        "mostly in the generated part: that is the text the draft meets when the engine decodes.",
        f"Steps {dm.get('steps')}, {dm.get('generated_sequences')} generated sequences, wall "
        f"time {dm.get('wall_s', 0) / 60:.1f} min.", "",
        "## Quality",
        f"Teacher-forced agreement with the target's greedy token on held-out generations, by "
        f"block row: {dm.get('heldout_teacher_forced_agreement_by_row')}.",
        f"Reference engine, greedy, {eng.get('prompts')} held-out prompts x "
        f"{eng.get('max_tokens')} tokens: spec_accept_length "
        f"{eng.get('spec_accept_length_macro', 0):.2f} (macro over prompts) / "
        f"{eng.get('spec_accept_length_token_weighted', 0):.2f} (token-weighted), accept rate "
        f"{eng.get('spec_accept_rate', 0):.3f}, histogram "
        f"{eng.get('spec_correct_drafts_histogram')}; outputs identical to target-only: "
        f"{eng.get('identical_to_target_only')}.", "",
        "## Speed", *bench_lines, "",
    ]
    (target_dir / "MODEL_CARD.md").write_text("\n".join(target_card))
    (draft_dir / "MODEL_CARD.md").write_text("\n".join(draft_card))
