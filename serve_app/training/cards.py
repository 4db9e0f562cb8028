"""Write the model cards of the embedded pair from what the trainings recorded (their metrics and
provenance) and, if given, a `bench/spec_decode.py --json` report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from serve_app.embedded import DRAFT, TARGET


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir()
               if f.is_file() and f.suffix in (".safetensors", ".json"))


def _made_by(metrics: dict[str, Any]) -> str:
    p = metrics.get("provenance") or {}
    if not p:
        return "Provenance not recorded."
    clean = {True: "clean", False: "WITH UNCOMMITTED EDITS", None: "unknown"}[
        p.get("training_code_clean")]
    return (f"Made by `{p.get('command')}` at commit `{p.get('commit')}` (training code "
            f"{clean}), Python {p.get('python')}, torch {p.get('torch')}, {p.get('cpus')} CPUs, "
            f"started {p.get('started_utc')}; wall time {metrics.get('wall_s', 0) / 60:.1f} min."
            + _evaluated_by(metrics))


def _evaluated_by(metrics: dict[str, Any]) -> str:
    """Where the engine's measurements came from a later `evaluate` run, and why."""
    e = metrics.get("evaluated_by")
    if not e:
        return ""
    why = f" ({metrics['recorded_from']})" if metrics.get("recorded_from") else ""
    return (f" Engine measurements by `{e.get('command')}` at commit `{e.get('commit')}`, "
            f"started {e.get('started_utc')}{why}.")


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def bench_lines(bench: dict[str, Any]) -> list[str]:
    """The benchmark's results as a markdown table and notes (the README quotes the same)."""
    if not bench:
        return ["Run `python bench/spec_decode.py` for speed and acceptance on this machine."]
    lines = [f"`python bench/spec_decode.py` ({bench['prompts']} held-out prompts x "
             f"{bench['max_tokens']} new tokens, batch 1, {bench['threads']} thread(s), "
             f"{bench['repeats']} repeats, target-only and speculative in one run, taking "
             "turns step by step):",
             "",
             "| sampling | target-only tok/s | speculative tok/s | speedup (median / aggregate) "
             "| accept length, code / conversations (macro) | accept length, all (macro / "
             "token-w.) | loop fraction | lossless |",
             "|---|---|---|---|---|---|---|---|"]
    for r in bench["results"]:
        lossless = {True: "identical outputs", False: "NOT identical",
                    None: "exact sampling (by construction)"}[r["lossless_identical"]]
        sets = r.get("by_prompt_set", {})
        by_set = " / ".join(_fmt(sets[k]["spec_accept_length_macro"]) if k in sets else "-"
                            for k in ("code", "conversation"))
        lines.append(
            f"| {r.get('sampling', r['temperature'])} (T {r['temperature']}, top_p "
            f"{r.get('top_p', 1.0)}) | {r['target_only_tok_s']['median']:.1f} | "
            f"{r['speculative_tok_s']['median']:.1f} | {r['speedup']['median']:.2f}x / "
            f"{r['speedup']['aggregate']:.2f}x | {by_set} | {r['spec_accept_length']['macro']:.2f}"
            f" / {r['spec_accept_length']['token_weighted']:.2f} | {r['loop_fraction']:.2f} | "
            f"{lossless} |")
    lines.append("")
    conc = bench.get("concurrency")
    if conc:
        lines += [f"Concurrent requests, c submitted at once (requests: how many ran, c at a "
                  f"time; the modes taking turns step by step), {conc['max_tokens']} tokens "
                  f"each (tokens/s, median of "
                  f"{conc['repeats']}, with the lowest and highest repeat's ratio to "
                  "target-only; the adaptive verify budget is the engine's default):", "",
                  "| sampling | c | requests | target-only | every draft verified | adaptive "
                  "budget | plain / all steps (adaptive) |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {row['sampling']} | {row['concurrency']} | {row['requests']} | "
                  f"{row['target_only_tok_s']:.1f} | "
                  f"{row['always_on_tok_s']:.1f} ({row['always_on_speedup']:.2f}x, "
                  "{:.2f}-{:.2f}) | ".format(*row["always_on_speedup_range"]) +
                  f"{row['adaptive_tok_s']:.1f} ({row['adaptive_speedup']:.2f}x, "
                  "{:.2f}-{:.2f}) | ".format(*row["adaptive_speedup_range"]) +
                  f"{row['adaptive_plain_steps']} / "
                  f"{row['adaptive_plain_steps'] + row['adaptive_speculative_steps']} |"
                  for row in conc["rows"]]
        lines.append("")
    for r in bench["results"]:
        b = r.get("speedup_bound")
        if b:
            lines.append(
                f"- T={r['temperature']}: per call, verify {b['verify_ms']:.2f} ms, draft "
                f"{b['draft_ms']:.2f} ms, commit {b['commit_ms']:.2f} ms against a "
                f"{b['decode_ms']:.2f} ms decode forward; the bound acceptance / (verify/decode "
                f"+ draft/decode) = {b['bound_verify_draft']:.2f}x, measured "
                f"{r['speedup']['aggregate']:.2f}x ({100 * r['speedup_over_bound']:.0f}%); "
                f"histogram {r['spec_correct_drafts_histogram']}.")
    return lines


def _target_card(tm: dict[str, Any], tcfg: dict[str, Any], bench: list[str],
                 data: list[str], folder: Path) -> list[str]:
    t = tcfg.get("text_config", {})
    la = t.get("linear_attn_config", {})
    p = tm.get("parameters", {})
    n = t.get("num_hidden_layers")
    return [
        f"# {TARGET.name}: a miniature Kimi K3 (KDA + MLA hybrid) for CPU demos", "",
        "Trained from scratch on CPU so that the project's demo and tests show real speculative "
        "decoding of the K3 architecture offline. It continues Python code and answers in K3's "
        "chat format (reasoning, answer, tool calls, JSON) about the standard library's "
        "functions; at ~9M parameters its answers are often wrong, and it is not a useful "
        "assistant.", "",
        "## Architecture",
        f"K3's `config.json` layout (`kimi_k3` wrapper around a `kimi_linear` text_config; "
        f"parses as `K3Config`): {n} layers, hidden {t.get('hidden_size')}; KDA (linear "
        f"attention with a per-request recurrent state, {la.get('num_heads')} heads x "
        f"{la.get('head_dim')}, short conv {la.get('short_conv_kernel_size')}, gate lower bound "
        f"{la.get('gate_lower_bound')}, full-rank output gate) on 1-based layers "
        f"{la.get('kda_layers')} and MLA with no positional encoding and a gated output on "
        f"{la.get('full_attn_layers')} (q_lora {t.get('q_lora_rank')}, kv_lora "
        f"{t.get('kv_lora_rank')}, {t.get('num_attention_heads')} heads); Attention Residuals "
        f"(blocks of {t.get('attn_res_block_size')}); a dense first layer (SiTU, intermediate "
        f"{t.get('intermediate_size')}) then latent MoE: {t.get('num_experts')} experts "
        f"(top-{t.get('num_experts_per_token')}, sigmoid noaux_tc router) of intermediate "
        f"{t.get('moe_intermediate_size')} in a {t.get('routed_expert_hidden_size')}-wide "
        f"latent, plus {t.get('num_shared_experts')} shared; vocab {t.get('vocab_size')}.",
        f"Parameters: {p.get('total', 0):,} ({p.get('active_per_token', 0):,} active per token). "
        f"Weights bf16 (KDA A_log, dt_bias, convs and the router bias fp32, as SGLang keeps "
        f"them), {_bytes(folder) / 1e6:.1f} MB.", "",
        *data, "",
        "## Training",
        _made_by(tm),
        "Next-token cross-entropy, AdamW (lr 2.5e-3, betas 0.9/0.95, wd 0.1), warm-up then cosine "
        "decay over the wall-time budget, 4 x 512-token random windows per step, DeepSeek-V3 "
        "auxiliary-loss-free expert balancing, fp32 on 2 CPU threads, seed 0.",
        f"Steps {tm.get('steps')}, {tm.get('train_tokens', 0):,} training tokens at "
        f"{tm.get('train_tokens_per_s', 0):,} tokens/s.", "",
        "## Quality",
        f"Held-out perplexity {tm.get('heldout_perplexity')} (per token, on "
        f"{tm.get('heldout_tokens', 0):,} tokens of held-out files in 512-token windows, "
        f"measured on the saved bf16 weights) after this training"
        + _after_vision(tm.get("vision")) + ". Final training loss (EMA) "
        f"{tm.get('train_loss_ema')}.", "",
        *vision_lines(tm.get("vision"), tcfg, folder),
        f"## Speculative decoding with {DRAFT.name}", *bench, "",
    ]


def vision_lines(vm: dict[str, Any] | None, cfg: dict[str, Any], folder: Path) -> list[str]:
    """The vision tower: its structure, how it was trained, and its held-out accuracy per
    question kind at K3's sampling parameters (from training_metrics.json's "vision")."""
    if not vm:
        return []
    v = cfg.get("vision_config", {})
    text = vm.get("text_model", {})  # the text model, trained in the vision stage too
    media = _load(folder / "preprocessor_config.json").get("media_proc_cfg", {})
    rows = ["| mode (sampling) | " + " | ".join(vm["heldout"]["thinking"]["accuracy_by_kind"])
            + " |", "|---|" + "---|" * len(vm["heldout"]["thinking"]["accuracy_by_kind"])]
    for mode, r in vm["heldout"].items():
        rows.append(f"| {mode} (T {r['temperature']}, top_p {r['top_p']}) | " + " | ".join(
            f"{100 * a:.0f}% of {r['questions_by_kind'][k]}"
            for k, a in r["accuracy_by_kind"].items()) + " |")
    return [
        "## Vision",
        f"A MoonViT-V2 tower and patchmergerv2 projector with K3's structure and names "
        f"(`vision_config` in config.json: patch {v.get('patch_size')}, "
        f"{v.get('vt_num_hidden_layers')} blocks of width {v.get('vt_hidden_size')} "
        f"({v.get('vt_num_attention_heads')} heads), 2D RoPE plus a "
        f"{v.get('init_pos_emb_height')}x{v.get('init_pos_emb_width')} `divided_fixed` position "
        f"table, `sd2_tpool` 2x2 merge, projector to {v.get('text_hidden_size')}; "
        f"{vm.get('parameters', 0):,} parameters, bf16, in `model-vision.safetensors`); "
        "`preprocessor_config.json` holds K3's `media_proc_cfg` keys with limits for the mini "
        f"(in_patch_limit {media.get('in_patch_limit')}, patch_limit_on_one_side "
        f"{media.get('patch_limit_on_one_side')}). The image prompt uses K3's four media tokens "
        f"(`media_placeholder_token_id` {cfg.get('media_placeholder_token_id')}).",
        "Trained by `python -m serve_app.training train-vision` (in `all`, after the draft), "
        "in two stages. " + _tower_stage(vm) + "Then "
        "together with the text model: frozen, it could not answer even with the answer "
        "written into its prompt (it was trained on code), so it learns the task too, at "
        f"{text.get('lr_scale')} x the stage's peak rate, replaying {text.get('replay')} at weight "
        f"{text.get('replay_weight')} to keep its text; the draft, "
        "trained before this stage, is unchanged (its acceptance below is measured against "
        "the target as it ships). Synthetic images drawn with Pillow (`serve_app/synthetic_images.py`: "
        "one of 5 shapes in one of 6 colours, a digit 0-9 or one of 8 short words, at random "
        f"sizes and places on varied backgrounds, {vm.get('image_size')} px = "
        f"{vm.get('tokens_per_image')} image tokens); the prompt is K3's rendering of a user "
        "message whose content is the question, then the image (the question first, so the "
        "image's positions can read it; each question names its possible answers, e.g. "
        "\"What shape is in the image: circle, square, triangle, star or cross?\"), and the "
        "loss is the text model's cross-entropy on the answer message (the answer word's "
        f"tokens, the channel tags at weight {vm.get('structure_weight')}), the image's "
        "features in place of the `<|media_pad|>` embeddings. "
        f"{vm.get('steps')} steps of {vm.get('batch')} images "
        f"({vm.get('train_images', 0):,} images, never repeated), AdamW lr "
        f"{vm.get('peak_lr')} (projector x{vm.get('projector_lr_scale')}, tower "
        f"x{vm.get('joint_tower_lr_scale', 1.0)}), the probe trained on, half the steps "
        f"thinking, half instant; the answer word's cross-entropy per token at the end (EMA, "
        f"by kind) {vm.get('answer_ce_ema_by_kind')}. " + _made_by(vm),
        f"Held-out accuracy ({vm.get('heldout_per_kind')} images per kind from another seed's "
        "stream, answered by the saved bf16 tower at K3's sampling parameters, the answer read "
        "from the response channel and compared with the word; a random guess is 1/6 for "
        "colour, 1/5 for shape, 1/10 for digit, 1/8 for word):", "", *rows, "",
        *_goal_line(vm), ]


def _tower_stage(vm: dict[str, Any]) -> str:
    """The tower's own stage (tower + a linear probe, no text model), if the run had one."""
    t = vm.get("tower_stage")
    if not t:
        return ""
    return (f"First the tower alone, with a linear probe of each image's colour, shape, digit "
            f"and word on its pooled output (training only, not saved): {t['steps']:,} steps "
            f"of {t['batch']} images of kind {', '.join(t['kinds'])} "
            f"({t['images']:,} images), AdamW lr {t['lr']}, {t['wall_s'] / 60:.1f} min; the "
            f"probe's held-out accuracy after it {t['probe_heldout_accuracy']}, after the joint "
            f"stage {vm.get('probe_heldout_accuracy_after')}. ")


def _after_vision(vm: dict[str, Any] | None) -> str:
    """The text model's held-out perplexity after the vision stage, which trains it too."""
    text = (vm or {}).get("text_model")
    if not text:
        return ""
    return (f"; {text['heldout_perplexity_after']} after the vision stage (below), which "
            "trains it too")


def _goal_line(vm: dict[str, Any]) -> list[str]:
    """Whether the held-out accuracy meets the project's goal (>= 90% for colour and shape at
    both sampling modes), said plainly either way, naming each kind below it."""
    below = {k: [f"{mode} {100 * r['accuracy_by_kind'].get(k, 0.0):.0f}%"
                 for mode, r in vm["heldout"].items()]
             for k in ("colour", "shape")
             if any(r["accuracy_by_kind"].get(k, 0.0) < 0.9 for r in vm["heldout"].values())}
    if not below:
        return ["Colour and shape meet the goal (>= 90%) at both sampling modes.", ""]
    met = [k for k in ("colour", "shape") if k not in below]
    return ["BELOW THE GOAL (>= 90% for colour and shape at both modes): "
            + "; ".join(f"{k} {', '.join(v)}" for k, v in below.items())
            + (f" ({' and '.join(met)} {'meet' if len(met) > 1 else 'meets'} it)" if met else "")
            + ". Whatever it answers, the embedded pair exercises the whole image path (tower, "
            "projector, pad splice).", ""]


def _draft_card(dm: dict[str, Any], dcfg: dict[str, Any], bench: list[str],
                data: list[str], folder: Path) -> list[str]:
    fl = dcfg.get("dflash_config", {})
    eng = dm.get("engine_heldout_greedy", {})
    return [
        f"# {DRAFT.name}: the DSpark draft of {TARGET.name}", "",
        "## Architecture",
        f"Published DSpark format (`config.json` with `dflash_config`, parses as `DSparkConfig`; "
        f"`kimi-dspark inspect` validates the tensor names): {dcfg.get('num_hidden_layers')} "
        f"Qwen3-style layer(s), hidden {dcfg.get('hidden_size')}, "
        f"{dcfg.get('num_attention_heads')} q / {dcfg.get('num_key_value_heads')} kv heads x "
        f"{dcfg.get('head_dim')}; taps target layers {fl.get('target_layer_ids')} by K3's "
        "convention (0-based layer outputs, no shift: the AttnRes mixture the next layer reads, "
        "the last layer's through the output read); block size (gamma) "
        f"{dcfg.get('block_size')}, Markov head rank {fl.get('markov_rank')}, confidence head, "
        f"MASK token id {fl.get('mask_token_id')} (a reserved control token, as K3's draft's); the target's embedding and "
        "lm_head are used, not stored.",
        f"Parameters: {dm.get('parameters', 0):,}. Weights bf16, {_bytes(folder) / 1e6:.1f} MB.",
        "",
        *data, "",
        "## Training",
        _made_by(dm),
        "After the target (and its vision stage), for the way K3 is served. Per block row k: "
        "0.1 CE(the target's argmax) + 1.8 TV(q_T, p_T) averaged over K3's two sampling modes "
        "(T 1.0 and 0.6; p_T the target's distribution truncated to its top_p 0.95 nucleus, "
        "q_T the draft's at T: 1 - TV is the engine's acceptance, DistillSpec's objective) + "
        "1.0 BCE(confidence, the row's mean acceptance over greedy and both modes), weighted by "
        "exp(-k/7); teacher-forced Markov inputs; 24 anchors per sequence, each block seeing "
        "the context strictly before its anchor. Context features and target distributions "
        "come from the shipped (bf16) target itself. Each step mixes 4 corpus windows with 12 "
        "sequences the target generated itself from training prompts (a third each greedy, K3 "
        "thinking and K3 instant; half are chat requests in K3's format), anchors mostly in the "
        "generated part: that is the text the draft meets when the engine decodes. On-policy "
        "anchors: half of each step's generated sequences carry on to the next step with their "
        "anchors where the engine's next block would start after each block (a walk through "
        "this draft's own acceptance in the sequence's mode).",
        f"Steps {dm.get('steps')}, {dm.get('generated_sequences')} generated sequences.", "",
        "## Quality",
        f"Teacher-forced agreement with the target's greedy token on held-out generations, by "
        f"block row: {dm.get('heldout_teacher_forced_agreement_by_row')}; acceptance at K3 "
        f"thinking on held-out thinking generations, by block row: "
        f"{dm.get('heldout_thinking_acceptance_by_row', 'not measured by this run')}.",
        f"Reference engine, greedy, {eng.get('prompts')} held-out prompts x "
        f"{eng.get('max_tokens')} tokens: spec_accept_length "
        f"{eng.get('spec_accept_length_macro', 0):.2f} (macro over prompts) / "
        f"{eng.get('spec_accept_length_token_weighted', 0):.2f} (token-weighted), accept rate "
        f"{eng.get('spec_accept_rate', 0):.3f}; outputs identical to target-only: "
        f"{eng.get('identical_to_target_only')}.",
        *_conversation_lines(dm), "",
        "## Speed", *bench, "",
    ]


def _conversation_lines(dm: dict[str, Any]) -> list[str]:
    """The pair on held-out K3 conversations at K3's sampling parameters (training records)."""
    lines = []
    for key, how in (("engine_heldout_conversations", "without a grammar"),
                     ("engine_heldout_conversations_grammar", "with the server's grammar")):
        c = dm.get(key)
        if c:
            lines.append(
                f"Held-out conversations at K3's sampling parameters {how} ({c['conversations']}, "
                f"up to {c['max_tokens']} tokens): {100 * c['well_formed']:.0f}% well-formed XTML "
                f"(by kind {c['well_formed_by_kind']}); tool_choice required answers calling a "
                f"declared tool with valid arguments {100 * c['tool_required_valid']:.0f}% of "
                f"{c['tool_required']}; token-weighted accept length "
                f"{c['spec_accept_length_token_weighted']:.2f}"
                + (f" (tools strict: `api.tool_strict_level: {c['tool_strict_level']}`)."
                   if c.get("tool_strict_level") else "."))
    return lines


def write_cards(assets: Path, bench: dict[str, Any] | None = None) -> None:
    """MODEL_CARD.md of both folders under `assets`."""
    target_dir, draft_dir = assets / TARGET.name, assets / DRAFT.name
    tm = _load(target_dir / "training_metrics.json")
    dm = _load(draft_dir / "training_metrics.json")
    lines = bench_lines(bench or {})
    data = [
        "## Data",
        "The Python standard library's own `.py` sources on the training machine (CPython "
        "3.11.7; `test/`, `idlelib/`, `lib2to3/`, `encodings/` and a few other folders skipped), "
        "read at training time; nothing downloaded. Files are split by a hash of their path: "
        "1 in 20 is held out (`serve_app/assets/heldout_prompts.json` is cut from those, by "
        "`python -m serve_app.training heldout`). 30% of the training tokens are conversations "
        "in Kimi K3's chat format about the training files' functions "
        "(`serve_app/training/conversations.py`), tokenized by the server's own K3 parser and "
        "renderer: think and response channels, multi-turn history, request-level and dynamic "
        "tool declarations, tool calls with typed arguments and tool results, tool_choice "
        "required, questions that need no tool, json_schema and json_object answers, thinking "
        "off. The tokenizer carries K3's control tokens (a 16-id block at the top of the "
        "vocabulary, K3's names and offsets) and no chat template.",
    ]
    (target_dir / "MODEL_CARD.md").write_text("\n".join(
        _target_card(tm, _load(target_dir / "config.json"), lines, data, target_dir)))
    (draft_dir / "MODEL_CARD.md").write_text("\n".join(
        _draft_card(dm, _load(draft_dir / "config.json"), lines, data, draft_dir)))


def write_vision_section(assets: Path) -> None:
    """The target card's Vision section from its training_metrics.json, in place: the rest of
    the card (the bench tables a `cards --bench-json` run wrote) stays as it is."""
    target_dir = assets / TARGET.name
    path = target_dir / "MODEL_CARD.md"
    if not path.exists():
        write_cards(assets)
        return
    section = vision_lines(_load(target_dir / "training_metrics.json").get("vision"),
                           _load(target_dir / "config.json"), target_dir)
    lines = path.read_text().split("\n")
    if "## Vision" in lines:
        start = lines.index("## Vision")
        end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
        lines[start:end] = section
    else:
        at = next(i for i, line in enumerate(lines)
                  if line.startswith("## Speculative decoding with"))
        lines[at:at] = section
    path.write_text("\n".join(lines))
