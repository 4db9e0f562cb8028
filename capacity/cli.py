"""`kimi-capacity`: size Kimi K3 + DSpark fleets from config.json files and data tables."""

from __future__ import annotations

import csv
import json
import re
import sys
from collections.abc import Callable, Sequence
from datetime import date
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from capacity.acceptance import (
    DEFAULT_WORKLOAD,
    adaptive_acceptance,
    verify_width,
    workload_acceptance,
)
from capacity.calibration import calibration_summary, evaluate, fit
from capacity.config import DEFAULT_IMAGE_SIZE, Images, Layout, Speculation, Workload, validated
from capacity.disagg import ModeRow, Targets, compare
from capacity.errors import CapacityError
from capacity.families import describe_model
from capacity.formats import KvDtype, WeightFormat, parse_kv_dtype, parse_weight_format
from capacity.memory import (
    DEFAULT_KDA_ROLLBACK,
    DEFAULT_REPLAY_RING_LEN,
    KDA_ROLLBACKS,
    MAMBA_SLOTS_PER_RUNNING_REQUEST,
    RunningFit,
    check_context,
    check_kda_rollback,
    max_running_requests,
    memory_per_gpu,
    running_fit,
)
from capacity.model import Component, ModelDescriptor
from capacity.planner import (
    DEFAULT_MAX_NODES,
    PlanResult,
    explain_infeasible,
    plan,
)
from capacity.sglang_k3_paths import NotServable, k3_paths_for, runnable_path, served_layout
from capacity.sglang_recipe import TRANSFER_BACKENDS
from capacity.tables import (
    GpuSpec,
    PriceRow,
    check_price_gpus,
    gpu_spec,
    load_gpus,
    load_prices,
)
from capacity.targets import default_targets, with_overrides
from capacity.timing import DEFAULT_CONSTANTS, decode_rate, prefill_seconds, vision_seconds
from capacity.vision import activation_peak, largest_image, prompt_tokens, request_images

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Capacity planner for Kimi K3 (+ DSpark draft) on AMD and NVIDIA GPUs.",
)
out = Console()
err = Console(stderr=True)


@app.callback()
def _consoles_for_this_command() -> None:
    """Build the consoles when a command runs: a Console reads COLUMNS once, when it is made, so
    consoles made at import keep the width of whatever environment imported the module."""
    global out, err
    out = Console()
    err = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])


def _user_errors(func: F) -> F:
    """Bad input ends the command with one line and exit status 2, never a traceback."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except CapacityError as exc:
            err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def parse_tokens(text: str) -> int:
    """'131072', '128K' or '1M' (binary multiples, as context lengths are quoted)."""
    value = text.strip().upper()
    scale = 1
    if value.endswith("K"):
        scale, value = 1024, value[:-1]
    elif value.endswith("M"):
        scale, value = 1024 * 1024, value[:-1]
    try:
        tokens = int(float(value) * scale)
    except ValueError:
        raise CapacityError(f"length {text!r} is not a number (e.g. 131072, 128K, 1M)") from None
    if tokens <= 0:
        raise CapacityError(f"length must be positive, got {text!r}")
    return tokens


def _split(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def _formats(text: str) -> list[WeightFormat | None]:
    return [None if f.lower() == "native" else parse_weight_format(f) for f in _split(text)]


def _kv_dtypes(text: str) -> list[KvDtype]:
    return [parse_kv_dtype(k) for k in _split(text)]


def _tables(gpus_file: Path | None, prices_file: Path | None) -> tuple[dict[str, GpuSpec],
                                                                       list[PriceRow]]:
    gpus = load_gpus(gpus_file)
    prices = load_prices(prices_file)
    check_price_gpus(prices, gpus, str(prices_file or "prices.csv"))
    return gpus, prices


def _price_age_line(rows: list[PriceRow], today: date | None = None) -> str:
    if not rows:
        return "prices: none used"
    ages = sorted(r.age_days(today) for r in rows)
    dates = sorted(r.date_read for r in rows)
    return (f"prices read {dates[0]} to {dates[-1]} ({ages[0]} to {ages[-1]} days old on "
            f"{(today or date.today()).isoformat()}); replace them with --prices FILE")


def _draft_and_spec(draft: str | None, acceptance: float | None, gamma: int | None,
                    workload: str | None = None
                    ) -> tuple[ModelDescriptor | None, Speculation | None]:
    """The draft and how it speculates: `--acceptance` pins the acceptance length at every
    batch; otherwise `--workload`'s published acceptance (default: the card's mean) with SGLang's
    adaptive verify trimming it as the batch grows (capacity.acceptance)."""
    if not draft:
        if workload is not None:
            workload_acceptance(workload)  # an unknown name is still one error line
        return None, None
    descriptor = describe_model(draft)
    if not descriptor.is_draft:
        raise CapacityError(f"--draft {draft!r} is not a DSpark draft config ({descriptor.family})")
    block = gamma or (descriptor.draft.block_size if descriptor.draft else 7)
    if acceptance is not None:
        return descriptor, validated(Speculation, gamma=block, acceptance_length=acceptance)
    row = workload_acceptance(workload or DEFAULT_WORKLOAD)
    # The table's values are for gamma 7; a shorter --gamma can accept at most gamma + 1.
    return descriptor, validated(Speculation, gamma=block, acceptance_length=min(
        row.acceptance_length, block + 1), adaptive_verify=True)


def _speculation_line(spec: Speculation, workload: str | None, batch: int,
                      gpu: GpuSpec) -> str:
    """What the plan assumed of the draft: the acceptance, its source, and at the top row's
    batch what the adaptive verify makes of it."""
    if not spec.adaptive_verify:
        return (f"speculation: gamma {spec.gamma}, acceptance {spec.acceptance_length} at every "
                "batch (--acceptance)")
    row = workload_acceptance(workload or DEFAULT_WORKLOAD)
    line = (f"speculation: gamma {spec.gamma}; workload {row.workload} ({row.task}): acceptance "
            f"{row.acceptance_length} with every draft verified ({row.source}, {row.date}; "
            f"T {row.temperature})")
    if gpu.vendor.upper() == "AMD":
        return line + "; verified statically on ROCm (no adaptive trim)"
    accepted = adaptive_acceptance(spec.acceptance_length, batch)
    width = verify_width(spec.acceptance_length, accepted, spec.gamma + 1)
    return line + (f"; adaptive verify at {batch} running: {accepted:.2f} accepted of "
                   f"{width:.1f} verified positions")


ModelOpt = Annotated[str, typer.Option("--model", "-m",
                                       help="config.json path or kimi-k3 / kimi-k2")]
DraftOpt = Annotated[str | None, typer.Option("--draft", "-d",
                                              help="draft config.json path or kimi-k3-dspark")]
ContextOpt = Annotated[str, typer.Option("--context", "-c", help="tokens per request: 131072, 128K, 1M")]
PricesOpt = Annotated[Path | None, typer.Option("--prices", help="price CSV (default: packaged)")]
GpusOpt = Annotated[Path | None, typer.Option("--gpu-table", help="GPU spec CSV (default: packaged)")]
AcceptOpt = Annotated[float | None, typer.Option(
    "--acceptance", help="draft acceptance length at every batch (overrides --workload)")]
WorkloadOpt = Annotated[str | None, typer.Option(
    "--workload", help="published DSpark acceptance to plan with: chat, code, agent, reasoning "
    "(also creative, long-context, mean; default mean), trimmed with batch by SGLang's adaptive "
    "verify (capacity/data/dspark_acceptance.csv)")]
GammaOpt = Annotated[int | None, typer.Option("--gamma", help="drafts per step (default: block_size)")]
RollbackOpt = Annotated[str, typer.Option(
    "--kda-rollback", help="how the speculative verify rolls the KDA state back: scratch "
    "(SGLang's default, a full state per verified position) or replay "
    "(--enable-linear-replayssm-spec, a ring of the window's inputs per state slot)")]
RingLenOpt = Annotated[int, typer.Option(
    "--replay-ring-len", help="replay's ring length (SGLang's --linear-replayssm-cache-len)")]
ImagesOpt = Annotated[int, typer.Option(
    "--images-per-request", help="images each request carries; their tokens join the prompt "
    "after --context's text tokens, the vision tower's time joins TTFT")]
ImageSizeOpt = Annotated[str, typer.Option(
    "--image-size", help="WIDTHxHEIGHT of each image as uploaded, e.g. 1024x768 (K3's resize "
    "and patch limits then give its tokens)")]
DEFAULT_IMAGE_SIZE_TEXT = "x".join(str(n) for n in DEFAULT_IMAGE_SIZE)
_IMAGE_SIZE = re.compile(r"\s*(\d+)\s*[xX]\s*(\d+)\s*")


def parse_images(count: int, size: str) -> Images:
    """`--images-per-request N --image-size WxH` -> Images, one line naming the option on bad
    input."""
    if count < 0:
        raise CapacityError(f"--images-per-request must be 0 or more, got {count}")
    match = _IMAGE_SIZE.fullmatch(size)
    if match is None:
        raise CapacityError(f"--image-size {size!r}: WIDTHxHEIGHT in pixels, e.g. 1024x768")
    width, height = int(match[1]), int(match[2])
    if width <= 0 or height <= 0:
        raise CapacityError(f"--image-size {size!r}: width and height must be at least 1 pixel")
    try:
        return validated(Images, per_request=count, width=width, height=height)
    except CapacityError as exc:
        raise CapacityError(f"--image-size {size!r}: {str(exc).split(': ', 1)[-1]}") from None


def _vision_data(target: ModelDescriptor, layout: Layout, gpu: GpuSpec, images: Images,
                 text_tokens: int) -> dict[str, Any] | None:
    """What the vision tower costs on one layout: its weights and activation peak per GPU, and
    the time of one image and of a request's images (None: the model has no tower)."""
    vision = target.vision
    if vision is None or target.media is None:
        return None
    largest = largest_image(target.media)
    peak_patches, peak_bytes = activation_peak(target, images, layout.attention_tp)
    data: dict[str, Any] = {
        "tower_params": vision.tower_params, "projector_params": vision.projector_params,
        "dtype": "bf16", "sharding": "replicated on every GPU",
        "weights_gb_per_gpu": (vision.tower_bytes + vision.projector_bytes) / 1e9,
        "largest_image": {"size": largest.label, "patches": largest.patches,
                          "tokens": largest.tokens},
        "activation_patches": peak_patches, "activation_gb": peak_bytes / 1e9,
        "images_per_request": images.per_request,
    }
    grid = request_images(target, images)
    if grid is not None:
        time = vision_seconds(target, layout, gpu, images)
        data.update({
            "image_size": grid.label, "resized": f"{grid.new_width}x{grid.new_height}",
            "patches_per_image": grid.patches, "tokens_per_image": grid.tokens,
            "text_tokens": text_tokens,
            "prompt_tokens": prompt_tokens(target, text_tokens, images),
            "ms_per_image": time.per_image_s * 1e3, "request_ms": time.request_s * 1e3,
            "images_on_busiest_rank": time.images_on_busiest_rank,
        })
    return data


def _vision_line(data: dict[str, Any], gpu: str) -> str:
    line = (f"vision tower + projector: {data['tower_params']:,} + {data['projector_params']:,} "
            f"params, {data['weights_gb_per_gpu']:.3f} GB BF16 {data['sharding']}; activation "
            f"peak {data['activation_gb']:.2f} GB ({data['activation_patches']:,} patches; "
            f"largest image {data['largest_image']['size']} = "
            f"{data['largest_image']['tokens']:,} tokens)")
    if "tokens_per_image" not in data:
        return line
    return line + (
        f"; each {data['image_size']} image -> {data['resized']}, {data['patches_per_image']:,} "
        f"patches, {data['tokens_per_image']:,} tokens, {data['ms_per_image']:.1f} ms on one "
        f"{gpu}; prompt {data['text_tokens']:,} text + {data['images_per_request']} x "
        f"{data['tokens_per_image']:,} image tokens = {data['prompt_tokens']:,}, its images "
        f"{data['request_ms']:.1f} ms ({data['images_on_busiest_rank']} on the busiest rank)")


def _check_rollback(strategy: str, spec: Speculation | None, ring_len: int) -> None:
    if strategy not in KDA_ROLLBACKS:
        raise CapacityError(f"--kda-rollback must be one of {', '.join(KDA_ROLLBACKS)}, got "
                            f"{strategy!r}")
    if strategy == "replay" and spec is None:
        raise CapacityError("--kda-rollback replay rolls back a speculative verify: it needs "
                            "--draft")
    check_kda_rollback(strategy, spec.gamma + 1 if spec else 0, ring_len)


def _rollback_data(fit: RunningFit) -> dict[str, Any] | None:
    costs = fit.rollback
    if costs is None or costs.draft_tokens == 0:
        return None
    running = fit.running_per_rank
    return {
        "strategy": costs.strategy, "draft_tokens": costs.draft_tokens,
        "ring_len": costs.ring_len if costs.strategy == "replay" else None,
        "running_per_gpu": running,
        "verify_ssm_mb_per_request": costs.per_request_ssm_bytes / 1e6,
        "verify_conv_mb_per_request": costs.per_request_conv_bytes / 1e6,
        "ring_mb_per_state_slot": costs.per_slot_ring_bytes / 1e6,
        "rollback_gb_per_gpu": costs.rollback_bytes(running) / 1e9,
        "kda_states_gb_per_gpu": fit.state_bytes / 1e9,
        "kv_room_gb_per_gpu": fit.kv_room_bytes / 1e9,
        "full_context_requests": fit.full_context_requests,
    }


def _rollback_line(fit: RunningFit) -> str | None:
    """One line: what the KDA rollback strategy costs per GPU at the running requests and what
    it leaves for KV."""
    data = _rollback_data(fit)
    if data is None:
        return None
    costs = fit.rollback
    assert costs is not None
    if costs.strategy == "replay":
        how = (f"replay (--enable-linear-replayssm-spec, ring of {costs.ring_len}): "
               f"{data['verify_conv_mb_per_request']:.1f} MB of conv windows per running request "
               f"+ a {data['ring_mb_per_state_slot']:.1f} MB ring on each of its "
               f"{costs.mamba_slots_per_request} state slots")
    else:
        how = (f"scratch (SGLang's default, {costs.draft_tokens} states per request): "
               f"{costs.per_request_bytes / 1e6:.1f} MB per running request")
    return (f"KDA rollback {how}, {data['rollback_gb_per_gpu']:.2f} GB per GPU at "
            f"{data['running_per_gpu']} running (+ padding); KDA states in all "
            f"{data['kda_states_gb_per_gpu']:.2f} GB, leaving {data['kv_room_gb_per_gpu']:.2f} GB "
            f"of KV: {fit.full_context_requests} full-context ({fit.context_length:,}-token) "
            "requests")


@app.command("model")
@_user_errors
def model_cmd(
    path: Annotated[str, typer.Argument(help="config.json, its folder, or a packaged name")],
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Parameter and byte counts per component for every weight format."""
    descriptor = describe_model(path)
    formats: list[WeightFormat] = list(WeightFormat)
    params = descriptor.params_by_component
    per_format = {f: descriptor.bytes_by_component(f) for f in formats}
    native = descriptor.bytes_by_component()
    if as_json:
        print(json.dumps({
            "name": descriptor.name, "family": descriptor.family.value,
            "native_format": descriptor.native_format.value,
            "total_params": descriptor.total_params, "active_params": descriptor.active_params,
            "params": {c.value: n for c, n in params.items()},
            "bytes": {f.value: {c.value: b for c, b in per_format[f].items()} for f in formats}
            | {"native": {c.value: b for c, b in native.items()}},
            "mla_kv_bytes_per_token_bf16": descriptor.kv_bytes_per_token(),
            "kda_state_bytes_per_request": descriptor.kda_state_bytes(),
            "gqa_kv_bytes_per_token_bf16": descriptor.gqa_kv_bytes_per_token(),
        }, indent=2))
        return
    table = Table(title=f"{descriptor.name} ({descriptor.family.value}, native "
                        f"{descriptor.native_format.value})")
    table.add_column("component")
    table.add_column("params", justify="right")
    table.add_column("native GB", justify="right")
    for f in formats:
        table.add_column(f"{f.value} GB", justify="right")
    for comp in Component:
        if comp not in params:
            continue
        table.add_row(comp.value, f"{params[comp]:,}", f"{native[comp] / 1e9:.2f}",
                      *[f"{per_format[f][comp] / 1e9:.2f}" for f in formats])
    table.add_row("total", f"{descriptor.total_params:,}",
                  f"{sum(native.values()) / 1e9:.2f}",
                  *[f"{sum(per_format[f].values()) / 1e9:.2f}" for f in formats], style="bold")
    out.print(table)
    out.print(f"active params per token: {descriptor.active_params:,}")
    if descriptor.mla:
        kv = descriptor.kv_bytes_per_token()
        out.print(f"MLA latent KV: {kv:,} B/token in BF16 over {descriptor.mla_layers} MLA layers "
                  f"({kv * 1_048_576 / 1e9:.1f} GB per 1M-token request, on every attention-TP "
                  "rank)")
    if descriptor.kda:
        out.print(f"KDA state: {descriptor.kda_state_bytes():,} B per request over "
                  f"{descriptor.kda_layers} KDA layers (constant in context)")
    if descriptor.gqa:
        out.print(f"GQA KV: {descriptor.gqa_kv_bytes_per_token():,} B/token in BF16 "
                  f"({descriptor.gqa.kv_heads} KV heads x {descriptor.gqa.head_dim})")
    if descriptor.ignore_patterns:
        out.print("kept in BF16 by the quantization config: " + ", ".join(descriptor.ignore_patterns))


def _plan_rows_table(rows: list[dict[str, Any]], title: str) -> Table:
    """`plan`'s rows; `P` marks the cost/latency Pareto front ($/Mtok vs tok/s per user, over
    every feasible row), `levers` the SGLang K3 levers a row runs with, `missed` (rows that
    miss the latency targets) which target."""
    table = Table(title=title)
    missed = any(r.get("missed") for r in rows)
    cols = ["#", "P", "GPU", "layout", "levers", "weights/KV", "SGLang path", "GPUs", "nodes",
            "GB/GPU w+free", "max req", "run", "tok/s user", "tok/s total", "TTFT s", "$/h",
            "$/Mtok", "price"]
    if missed:
        cols.append("missed")
    for col in cols:
        table.add_column(col, justify="left" if col in ("GPU", "layout", "price", "levers",
                                                         "SGLang path", "missed") else "right")
    for i, r in enumerate(rows, start=1):
        table.add_row(
            str(i), "*" if r.get("pareto") else "",
            r["gpu"] + ("" if r["k3_anchor"] else NO_ANCHOR_MARK),
            r["layout"] + (f" x{r['replicas']}" if r["replicas"] > 1 else ""),
            r.get("levers", "") + (f" ({r['host_sessions']} parked)"
                                   if r.get("host_sessions") else ""),
            f"{r['weights']}/{r['kv_dtype']}", r["sglang_path"] or "-", str(r["gpus"]),
            str(r["nodes"]), f"{r['weights_gb_per_gpu']:.0f}+{r['free_gb_per_gpu']:.0f}",
            str(r["max_concurrent_per_replica"]), str(r["concurrency_per_replica"]),
            f"{r['tokens_s_per_user']:.0f}", f"{r['tokens_s_total']:.0f}", f"{r['prefill_s']:.1f}",
            "-" if r["usd_per_hour"] is None else f"{r['usd_per_hour']:.2f}",
            "-" if r["usd_per_million_tokens"] is None else f"{r['usd_per_million_tokens']:.2f}",
            "-" if r["provider"] is None else f"{r['provider']} {r['price_date']}",
            *([r.get("missed", "")] if missed else []),
        )
    return table


def _plan_dicts(result: PlanResult, shown: list[Any]) -> list[dict[str, Any]]:
    """Rows as dicts with their rank among all rows and their Pareto mark."""
    front = result.latency_front()
    index = {id(r): i for i, r in enumerate(result.rows)}
    return [{**r.as_dict(), "rank": index[id(r)] + 1, "pareto": index[id(r)] in front}
            for r in shown]


NO_ANCHOR_MARK = " \u2020"  # a dagger: no published K3 measurement on this GPU type


def _sglang_path_line(target: ModelDescriptor, layout: Layout, gpu: GpuSpec) -> str | None:
    """`explain`: what SGLang 0.5.23 runs K3 with on this GPU, and whether the layout's weight
    format is what it holds in HBM (the planner's `plan` prices the runnable one itself)."""
    try:
        path = runnable_path(target, gpu.gpu)
    except NotServable as refused:
        return refused.reason
    if path is None:
        return None
    line = f"SGLang 0.5.23 runs K3 on {gpu.gpu} as {path.label} ({path.decided_by})"
    if path.experts_in_memory == "bf16" and layout.weight_format is None:
        line += ("; it holds the experts as BF16, so this native-format layout understates "
                 "their memory: rerun with --weights bf16")
    return line


def _plan_notes(rows: list[dict[str, Any]], target: ModelDescriptor,
                planned: Sequence[str] = ()) -> list[str]:
    """Under a plan table: the K3 anchor marker's meaning and, per GPU type shown or
    `planned`, the path SGLang 0.5.23 runs K3 with and the source lines that decide it (a GPU
    with no path is among the plan's rejected ones, with its reason)."""
    lines = []
    if any(not r["k3_anchor"] for r in rows):
        lines.append(f"{NO_ANCHOR_MARK.strip()} no published K3 measurement on this GPU type "
                     "(kimi-capacity calibrate): its rows are roofline extrapolations")
    seen: set[str] = set()
    for r in rows:
        if r["sglang_path"] and r["gpu"] not in seen:
            seen.add(r["gpu"])
            lines.append(f"{r['gpu']}: SGLang 0.5.23 runs K3 as {r['sglang_path']} "
                         f"({r['sglang_path_source']})")
    paths = k3_paths_for(target, None) or {}
    for gpu in planned:
        path = paths.get(gpu.upper())
        if gpu.upper() not in {g.upper() for g in seen} and path is not None and path.runnable:
            lines.append(f"{gpu}: SGLang 0.5.23 runs K3 as {path.label} ({path.decided_by}); "
                         "none of its rows is shown (--per-gpu N shows N per GPU)")
    return lines


def _markdown(rows: list[dict[str, Any]], title: str) -> str:
    """`plan --markdown`: the rows with their levers, their Pareto mark (P) and, for rows that
    miss the latency targets, which target."""
    missed = any(r.get("missed") for r in rows)
    lines = [
        f"**{title}**",
        "",
        "| # | P | layout | levers | weights/KV | GPUs | weights + free GB/GPU | max req | "
        "tok/s per user | tok/s total | TTFT s | $/h | $/M tok | price (date) |"
        + (" missed |" if missed else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if missed else ""),
    ]
    for i, r in enumerate(rows, start=1):
        cost = "-" if r["usd_per_hour"] is None else f"{r['usd_per_hour']:.2f}"
        per_m = "-" if r["usd_per_million_tokens"] is None else f"{r['usd_per_million_tokens']:.2f}"
        price = "-" if r["provider"] is None else f"{r['provider']} ({r['price_date']})"
        lines.append(
            f"| {i} | {'*' if r.get('pareto') else ''} | {r['layout']}"
            f"{'' if r['k3_anchor'] else NO_ANCHOR_MARK} | {r.get('levers', '')} | "
            f"{r['weights']}/{r['kv_dtype']} | {r['gpus']} | "
            f"{r['weights_gb_per_gpu']:.0f} + {r['free_gb_per_gpu']:.0f} | "
            f"{r['max_concurrent_per_replica']} | {r['tokens_s_per_user']:.0f} | "
            f"{r['tokens_s_total']:.0f} | {r['prefill_s']:.1f} | {cost} | {per_m} | {price} |"
            + (f" {r.get('missed', '')} |" if missed else "")
        )
    return "\n".join(lines)


@app.command("plan")
@_user_errors
def plan_cmd(
    model: ModelOpt = "kimi-k3",
    draft: DraftOpt = None,
    context: ContextOpt = "128K",
    concurrency: Annotated[int | None, typer.Option(help="concurrent requests to serve")] = None,
    target_tps: Annotated[float | None, typer.Option("--target-tps",
                                                     help="total output tokens/s to serve")] = None,
    min_user_tps: Annotated[float | None, typer.Option("--min-user-tps",
                                                       help="per-user tokens/s floor")] = None,
    gpus: Annotated[str | None, typer.Option(help="allowed GPU types, e.g. MI300X,H100,H200")] = None,
    weights: Annotated[str, typer.Option(help="native,bf16,fp8,mxfp4,int4,nvfp4")] = "native",
    kv: Annotated[str, typer.Option(help="KV dtypes: bf16,fp8")] = "bf16",
    max_nodes: Annotated[int, typer.Option(help="largest replica in nodes")] = DEFAULT_MAX_NODES,
    mem_fraction: Annotated[float | None, typer.Option(help="engine static memory share")] = None,
    acceptance: AcceptOpt = None,
    workload_name: WorkloadOpt = None,
    gamma: GammaOpt = None,
    prices: PricesOpt = None,
    gpu_table: GpusOpt = None,
    top: Annotated[int, typer.Option(help="rows to show")] = 10,
    per_gpu: Annotated[int | None, typer.Option(help="at most this many rows per GPU type")] = None,
    kda_rollback: RollbackOpt = DEFAULT_KDA_ROLLBACK,
    replay_ring_len: RingLenOpt = DEFAULT_REPLAY_RING_LEN,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="print a markdown table")] = False,
    csv_path: Annotated[Path | None, typer.Option("--csv", help="write all rows to CSV")] = None,
    plot_path: Annotated[Path | None, typer.Option("--plot", help="write a Pareto PNG")] = None,
    disagg: Annotated[bool, typer.Option(
        "--disagg", help="rank aggregated and prefill/decode-disaggregated fleets together, "
        "at the --ttft and --itl targets (capacity/disagg.py)")] = False,
    output_tokens: Annotated[int, typer.Option(
        help="--disagg: answer tokens per request; the prompt is the rest of --context")] = 4096,
    ttft: Annotated[float | None, typer.Option(
        "--ttft", help="time to first token target, seconds (plan: overrides the context "
        "class's default; --disagg: a hard bound)")] = None,
    itl: Annotated[float | None, typer.Option(
        "--itl", help="--disagg: inter-token latency target, milliseconds")] = None,
    images_per_request: ImagesOpt = 0,
    image_size: ImageSizeOpt = DEFAULT_IMAGE_SIZE_TEXT,
    no_targets: Annotated[bool, typer.Option(
        "--no-targets", help="rank without the default latency targets of the context class "
        "(capacity/targets.py)")] = False,
    levers: Annotated[bool, typer.Option(
        "--levers/--no-levers", help="search SGLang 0.5.23's K3 levers: decode context "
        "parallelism, extra_buffer_lazy state slots, the HiCache host tier")] = True,
) -> None:
    """Rank feasible fleets: cheapest per million output tokens first, those that meet the
    latency targets (the context class's defaults, or --ttft / --min-user-tps) apart from
    those that miss them; `P` marks the cost/latency Pareto front."""
    images = parse_images(images_per_request, image_size)
    if top <= 0:
        raise CapacityError(f"--top must be positive, got {top}")
    if mem_fraction is not None and not 0 < mem_fraction <= 0.98:
        raise CapacityError(f"--mem-fraction must be in (0, 0.98], got {mem_fraction}")
    target = describe_model(model)
    draft_model, spec = _draft_and_spec(draft, acceptance, gamma, workload_name)
    _check_rollback(kda_rollback, spec, replay_ring_len)
    gpu_specs, price_rows = _tables(gpu_table, prices)
    allowed = _split(gpus) or None
    for name in allowed or []:
        gpu_spec(gpu_specs, name)
    # The GPUs this plan prices, each named under the table with its SGLang path.
    planned = [gpu_spec(gpu_specs, name).gpu for name in allowed] if allowed else []
    if disagg:
        if images.per_request:
            raise CapacityError("--disagg does not price images yet: plan them without "
                                "--disagg")
        _plan_modes(target, draft_model, spec, gpu_specs, price_rows, allowed,
                    Targets(parse_tokens(context) - output_tokens, output_tokens, ttft,
                            None if itl is None else itl / 1e3),
                    _formats(weights), _kv_dtypes(kv), max_nodes, kda_rollback, top, per_gpu,
                    as_json, (model, draft, context))
        return
    targets = None
    if not no_targets:
        targets = with_overrides(default_targets(parse_tokens(context)), ttft, min_user_tps)
    result = plan(
        target, gpu_specs, price_rows, parse_tokens(context), draft_model,
        allowed_gpus=allowed, concurrency=concurrency, target_tokens_s=target_tps,
        min_user_tokens_s=min_user_tps if no_targets else None,
        weight_formats=_formats(weights),
        kv_dtypes=_kv_dtypes(kv), max_nodes=max_nodes, mem_fraction=mem_fraction,
        speculation=spec, kda_rollback=kda_rollback, ring_len=replay_ring_len, images=images,
        targets=targets, levers=levers,
    )
    if not result.rows:
        raise CapacityError(explain_infeasible(result, max_nodes))
    meeting = result.meeting()
    shown = result.top(top, per_gpu, meeting)
    missed_rows = result.top(top, per_gpu, result.missing()) if targets is not None else []
    dicts = _plan_dicts(result, shown)
    missed_dicts = _plan_dicts(result, missed_rows)
    # The tower on each GPU type shown (the best row of each): the same on every layout of a
    # GPU, bar the activation peak when a request's images pack onto fewer ranks.
    vision_rows: dict[str, dict[str, Any]] = {}
    for row in shown if images.per_request else []:
        if row.layout.gpu not in vision_rows:
            data = _vision_data(target, row.layout, gpu_spec(gpu_specs, row.layout.gpu), images,
                                result.text_tokens or 0)
            if data is not None:
                vision_rows[row.layout.gpu] = data
    used_prices = [r.price for r in shown + missed_rows if r.price]
    if csv_path:
        all_rows = [r.as_dict() for r in result.rows]
        with csv_path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(all_rows[0]))
            writer.writeheader()
            writer.writerows(all_rows)
    if plot_path:
        from capacity.plot import pareto_plot

        pareto_plot(result, plot_path)
    if as_json:
        print(json.dumps({
            "model": result.model, "draft": result.draft,
            "context_length": result.context_length, "layouts_evaluated": result.evaluated,
            "feasible": len(result.rows), "prices": _price_age_line(used_prices),
            **({"speculation": {
                "gamma": spec.gamma, "acceptance_length": spec.acceptance_length,
                "adaptive_verify": spec.adaptive_verify,
                "workload": (workload_acceptance(workload_name or DEFAULT_WORKLOAD).model_dump()
                             if spec.adaptive_verify else None),
            }} if spec else {}),
            **({"text_tokens": result.text_tokens, "images": vision_rows} if vision_rows
               else {}),
            "targets": None if targets is None else {
                "context_class": targets.context_class, "ttft_s": targets.ttft_s,
                "min_user_tokens_s": targets.min_user_tokens_s},
            "meeting_targets": len(meeting),
            "rows": dicts,
            "missing_targets": missed_dicts,
        }, indent=2))
        return
    what = target.name + (f" + {draft_model.name}" if draft_model else "")
    if markdown:
        goal_md = "" if targets is None else f" ({targets.context_class}: {targets.label()})"
        if dicts:
            print(_markdown(dicts, f"{what}, {result.context_length:,}-token context{goal_md}"))
        if missed_dicts:
            print("\n" + _markdown(missed_dicts, "missing the targets"))
        print(f"\n{_price_age_line(used_prices)}")
        for note in _plan_notes(dicts + missed_dicts, target, planned):
            print(f"\n{note}")
        return
    goal = "" if targets is None else f", {targets.context_class} targets: {targets.label()}"
    if dicts:
        out.print(_plan_rows_table(dicts, f"{what} at {result.context_length:,} tokens{goal} "
                                          f"({len(meeting)} of {len(result.rows)} fitting layouts "
                                          f"meet them; {result.evaluated} tried)"))
    else:
        out.print(f"no layout meets {targets.label() if targets else 'the targets'}: the rows "
                  "below miss them", highlight=False)
    if missed_dicts:
        out.print(_plan_rows_table(missed_dicts, f"missing the targets ({targets.label() if targets else ''}"
                                                 f"): {len(result.rows) - len(meeting)} layouts"))
    out.print("P: on the cost/latency Pareto front (no fitting layout is as cheap, as quick to "
              "first token and as fast per user, and better at one). levers: SGLang 0.5.23's K3 "
              "levers the row runs with (lazy: extra_buffer_lazy; DCPn in the layout; HiCache "
              "r x: the host tier, with the full-context sessions it parks per replica); "
              "--no-levers plans without them", highlight=False)
    out.print(_price_age_line(used_prices))
    for note in _plan_notes(dicts + missed_dicts, target, planned):
        out.print(note, soft_wrap=True, highlight=False)
    for gpu, data in vision_rows.items():
        out.print(f"{gpu}: {_vision_line(data, gpu)}", soft_wrap=True, highlight=False)
    if vision_rows:
        out.print("TTFT includes the vision tower; the context is text + image tokens",
                  highlight=False)
    if workload_name and not spec:
        out.print(f"workload {workload_name}: no --draft, so plain decode (the workload sets "
                  "only the draft's acceptance)", soft_wrap=True, highlight=False)
    if spec:
        top_row = (shown or missed_rows)[0]
        out.print(_speculation_line(spec, workload_name, top_row.concurrency_per_replica,
                                    gpu_spec(gpu_specs, top_row.layout.gpu))
                  + "; tok/s are steady decode at full context; TTFT is one prompt alone",
                  soft_wrap=True, highlight=False)
        line = _rollback_line(running_fit(
            target, top_row.layout, gpu_spec(gpu_specs, top_row.layout.gpu),
            result.context_length, draft_model, spec, running=top_row.concurrency_per_replica,
            kda_rollback=kda_rollback, ring_len=replay_ring_len))
        if line:
            out.print(f"#1 {top_row.layout.label()}: {line}", soft_wrap=True, highlight=False)
    if result.rejected:
        for gpu, why in sorted(result.rejected.items()):
            what_failed = "" if why.startswith("not servable") else "no layout fits: "
            out.print(f"[dim]{gpu}: {what_failed}{why}[/dim]", soft_wrap=True, highlight=False)


def _plan_modes(target: ModelDescriptor, draft: ModelDescriptor | None,
                spec: Speculation | None, gpu_specs: dict[str, GpuSpec],
                price_rows: list[PriceRow], allowed: list[str] | None, targets: Targets,
                weights: list[WeightFormat | None], kv: list[KvDtype], max_nodes: int,
                kda_rollback: str, top: int, per_gpu: int | None, as_json: bool,
                emit_refs: tuple[str, str | None, str]) -> None:
    """`plan --disagg`: the best aggregated and disaggregated fleets side by side, each with
    the `kimi-capacity emit` command that writes it (`emit_refs`: the --model, --draft and
    --context given)."""
    from capacity.emit import fleet_command

    def command(row: ModeRow) -> str:
        model_arg, draft_arg, context = emit_refs
        if row.mode == "agg":
            return fleet_command(row.decode, context, model_arg, draft_arg, kda_rollback,
                                 replicas=row.decode_replicas)
        return fleet_command(row.decode, context, model_arg, draft_arg, kda_rollback,
                             pd=(row.prefill_replicas, row.decode_replicas), prefill=row.prefill)

    if targets.input_tokens <= 0:
        raise CapacityError(f"--output-tokens {targets.output_tokens} leaves no prompt in "
                            "--context")
    rows = compare(target, gpu_specs, price_rows, targets, draft, allowed_gpus=allowed,
                   weight_formats=weights, kv_dtypes=kv, max_nodes=max_nodes,
                   speculation=spec, kda_rollback=kda_rollback)
    what = (f"{target.name}" + (f" + {draft.name}" if draft else "")
            + f", {targets.input_tokens:,}-token prompts, {targets.output_tokens:,}-token answers"
            + (f", TTFT <= {targets.ttft_s} s" if targets.ttft_s is not None else "")
            + (f", ITL <= {1e3 * targets.itl_s:g} ms" if targets.itl_s is not None else ""))
    if not rows:
        raise CapacityError(f"no aggregated or disaggregated fleet of up to {max_nodes}-node "
                            f"replicas meets {what}")
    # The best of each mode always shows, then the rest by cost.
    shown: list[ModeRow] = []
    seen: dict[tuple[str, str], int] = {}
    for mode in ("agg", "disagg"):
        shown += [r for r in rows if r.mode == mode][:1]
    for row in rows:
        key = (row.decode.gpu, row.mode)
        if row not in shown and len(shown) < top and (per_gpu is None
                                                       or seen.get(key, 0) < per_gpu):
            shown.append(row)
        seen[key] = seen.get(key, 0) + 1
    shown.sort(key=rows.index)
    dicts = [{**r.as_dict(), "emit": command(r)} for r in shown]
    used = [r.price for r in shown if r.price]
    if as_json:
        print(json.dumps({"targets": vars(targets), "rows": dicts, "feasible": len(rows),
                          "prices": _price_age_line(used)}, indent=2))
        return
    table = Table(title=f"{what} ({len(rows)} fleets meet it)")
    for col in ("#", "mode", "prefill x replicas (batch)", "decode x replicas (running)", "GPUs",
                "TTFT s", "ITL ms", "hand-over GB / s", "tok/s", "$/h", "$/Mtok"):
        table.add_column(col, justify="left" if "x replicas" in col or col == "mode" else "right")
    for i, r in enumerate(dicts, start=1):
        table.add_row(
            str(i), r["mode"],
            "-" if r["prefill"] is None else
            f"{r['prefill']} x{r['prefill_replicas']} ({r['prefill_batch']})",
            f"{r['decode']} x{r['decode_replicas']} ({r['decode_concurrency']})", str(r["gpus"]),
            f"{r['ttft_s']:.2f}", f"{r['itl_ms']:.1f}",
            "-" if r["mode"] == "agg" else f"{r['handoff_gb']:.2f} / {r['transfer_s']:.2f}",
            f"{r['output_tokens_s']:.0f}",
            "-" if r["usd_per_hour"] is None else f"{r['usd_per_hour']:.2f}",
            "-" if r["usd_per_million_tokens"] is None else f"{r['usd_per_million_tokens']:.2f}")
    out.print(table)
    for i, r in enumerate(dicts, start=1):
        out.print(f"{i}: {r['emit']}", soft_wrap=True, highlight=False)
    out.print(_price_age_line(used))
    out.print("agg: prefills stall the decodes (ITL is the mean gap, stalls included; TTFT adds "
              "a decode step per 8K chunk); disagg: prefill replicas hand each request over "
              "the scale-out network (TTFT = prefill + transfer). No queueing.",
              soft_wrap=True, highlight=False)


def _layout_from_options(
    gpu_specs: dict[str, GpuSpec], gpu: str, nodes: int, tp: int | None, dp: int, ep: int | None,
    pp: int, weights: str, kv: str, mem_fraction: float | None, dcp: int = 1,
    redundant_experts: int = 0,
) -> Layout:
    from capacity.emit import default_mem_fraction

    spec = gpu_spec(gpu_specs, gpu)
    stage = nodes * spec.gpus_per_node // max(1, pp)
    fmt = _formats(weights)
    if len(fmt) != 1:
        raise CapacityError("--weights takes one format here")
    # The fraction known to fit on this GPU where the recipe's does not (capacity.emit.KNOWN_FIT).
    fraction = mem_fraction if mem_fraction is not None else default_mem_fraction(spec.gpu)
    extra = {"mem_fraction": fraction} if fraction is not None else {}
    layout = validated(
        Layout, gpu=spec.gpu, nodes=nodes, tp=tp or stage, attention_dp=dp, ep=ep or tp or stage,
        pp=pp, weight_format=fmt[0], kv_dtype=parse_kv_dtype(kv), dcp=dcp,
        redundant_experts=redundant_experts, **extra,
    )
    if layout.gpus_per_node != spec.gpus_per_node:
        raise CapacityError(
            f"--tp {layout.tp} x --pp {layout.pp} over --nodes {nodes} uses "
            f"{layout.gpus_per_node} GPUs per node; a {spec.gpu} node has {spec.gpus_per_node}")
    return layout


GpuOpt = Annotated[str, typer.Option("--gpu", help="GPU type, e.g. MI300X")]
NodesOpt = Annotated[int, typer.Option(help="nodes per replica")]
TpOpt = Annotated[int | None, typer.Option("--tp", help="tensor-parallel ranks per stage, "
                                           "SGLang's tp_size (default: every GPU of a stage)")]
DpOpt = Annotated[int, typer.Option("--dp", help="attention data parallel ranks")]
EpOpt = Annotated[int | None, typer.Option("--ep", help="expert parallel (default: whole stage)")]
PpOpt = Annotated[int, typer.Option("--pp", help="pipeline stages")]
DcpOpt = Annotated[int, typer.Option("--dcp", help="decode context parallel size (SGLang's "
                                     "dcp_size): each rank holds 1/dcp of a request's MLA KV")]


@app.command("explain")
@_user_errors
def explain_cmd(
    gpu: GpuOpt,
    model: ModelOpt = "kimi-k3",
    draft: DraftOpt = None,
    context: ContextOpt = "128K",
    nodes: NodesOpt = 1,
    tp: TpOpt = None,
    dp: DpOpt = 1,
    ep: EpOpt = None,
    pp: PpOpt = 1,
    dcp: DcpOpt = 1,
    redundant_experts: Annotated[int, typer.Option(
        "--redundant-experts", help="EPLB's redundant experts (SGLang's "
        "--ep-num-redundant-experts): (E + R) / EP experts per rank")] = 0,
    weights: Annotated[str, typer.Option()] = "native",
    kv: Annotated[str, typer.Option()] = "bf16",
    mem_fraction: Annotated[float | None, typer.Option()] = None,
    concurrency: Annotated[int | None, typer.Option(help="default: most that fits")] = None,
    acceptance: AcceptOpt = None,
    workload_name: WorkloadOpt = None,
    gamma: GammaOpt = None,
    kda_rollback: RollbackOpt = DEFAULT_KDA_ROLLBACK,
    replay_ring_len: RingLenOpt = DEFAULT_REPLAY_RING_LEN,
    gpu_table: GpusOpt = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    images_per_request: ImagesOpt = 0,
    image_size: ImageSizeOpt = DEFAULT_IMAGE_SIZE_TEXT,
) -> None:
    """Full memory and time breakdown of one layout."""
    images = parse_images(images_per_request, image_size)
    target = describe_model(model)
    draft_model, spec = _draft_and_spec(draft, acceptance, gamma, workload_name)
    _check_rollback(kda_rollback, spec, replay_ring_len)
    gpu_specs = load_gpus(gpu_table)
    layout = _layout_from_options(gpu_specs, gpu, nodes, tp, dp, ep, pp, weights, kv,
                                  mem_fraction, dcp, redundant_experts)
    spec_gpu = gpu_spec(gpu_specs, gpu)
    text_tokens = parse_tokens(context)
    tokens = prompt_tokens(target, text_tokens, images)
    if images.per_request:
        check_context(target, tokens, f"{text_tokens:,} text tokens + {images.label} images")
    report = memory_per_gpu(target, layout, validated(
        Workload, context_length=tokens, images=images,
        kda_state_slots=MAMBA_SLOTS_PER_RUNNING_REQUEST),
        spec_gpu, draft_model, spec, kda_rollback, replay_ring_len)
    running = concurrency or min(max(1, report.max_concurrent), max_running_requests(draft_model))
    if concurrency is not None and concurrency <= 0:
        raise CapacityError(f"--concurrency must be positive, got {concurrency}")
    rollback_fit = running_fit(target, layout, spec_gpu, tokens, draft_model, spec,
                               running=running, kda_rollback=kda_rollback,
                               ring_len=replay_ring_len)
    rate = decode_rate(target, layout, spec_gpu, running, tokens, draft_model, spec)
    vision = _vision_data(target, layout, spec_gpu, images, text_tokens)
    ttft = prefill_seconds(target, layout, spec_gpu, tokens, 1) + (
        vision["request_ms"] / 1e3 if vision and "request_ms" in vision else 0.0)
    data: dict[str, Any] = {
        "layout": layout.label(), "gpu_memory_gb": report.capacity_bytes / 1e9,
        "fits": report.fits, "reasons": list(report.reasons),
        "max_concurrent": report.max_concurrent,
        "stages": [{
            "stage": s.stage, "layers": [s.first_layer, s.last_layer],
            "static_pool_gb": s.budget / 1e9,
            "weights_gb": {k: v / 1e9 for k, v in s.weights.items()},
            "per_request_gb": {k: v / 1e9 for k, v in s.per_request.items()},
            "outside_pool_gb": {k: v / 1e9 for k, v in s.outside_pool.items()},
            "free_for_requests_gb": s.free_for_requests / 1e9,
            "max_requests_per_attention_dp_rank": s.max_requests_per_rank,
        } for s in report.stages],
        "time": {
            "concurrency": running, "step_ms": rate.step.step_s * 1e3,
            "memory_ms": rate.step.memory_s * 1e3, "compute_ms": rate.step.compute_s * 1e3,
            "fixed_ms": rate.step.fixed_s * 1e3, "communication_ms": rate.step.communication_s * 1e3,
            "draft_ms": rate.step.draft_s * 1e3, "tokens_per_step": rate.step.tokens_per_step,
            "tokens_s_per_user": rate.per_user_tokens_s, "tokens_s_total": rate.total_tokens_s,
            "bytes_per_gpu_per_step_gb": rate.step.bytes_per_gpu / 1e9,
            "prefill_s_one_prompt": ttft,
        },
    }
    rollback = _rollback_data(rollback_fit)
    if rollback is not None:
        data["kda_rollback"] = rollback
    if vision is not None:
        data["vision"] = vision
    if as_json:
        print(json.dumps(data, indent=2))
        return
    out.print(f"[bold]{target.name}{' + ' + draft_model.name if draft_model else ''} on "
              f"{layout.label()}[/bold], {tokens:,}-token context, {spec_gpu.memory_label} per GPU, "
              f"mem_fraction {layout.mem_fraction}")
    for s in data["stages"]:
        table = Table(title=f"stage {s['stage']} (layers {s['layers'][0]}-{s['layers'][1]}), "
                            "GB per GPU")
        table.add_column("term")
        table.add_column("GB", justify="right")
        for k, v in s["weights_gb"].items():
            table.add_row(f"weights: {k}", f"{v:.3f}")
        table.add_row("static pool (mem_fraction x memory)", f"{s['static_pool_gb']:.2f}",
                      style="bold")
        table.add_row("free for requests", f"{s['free_for_requests_gb']:.2f}", style="bold")
        for k, v in s["per_request_gb"].items():
            table.add_row(f"per request: {k}", f"{v:.4f}")
        for k, v in s["outside_pool_gb"].items():
            table.add_row(f"outside pool: {k}", f"{v:.2f}")
        table.add_row("requests per attention-DP rank", str(s["max_requests_per_attention_dp_rank"]))
        out.print(table)
    verdict = "fits" if report.fits else "does NOT fit: " + "; ".join(report.reasons)
    out.print(f"max concurrent requests: {report.max_concurrent} ({verdict})", soft_wrap=True)
    line = _rollback_line(rollback_fit)
    if line:
        out.print(line, soft_wrap=True, highlight=False)
    if vision is not None:
        out.print(_vision_line(vision, spec_gpu.gpu), soft_wrap=True, highlight=False)
    path_line = _sglang_path_line(target, layout, spec_gpu)
    if path_line:
        out.print(path_line, soft_wrap=True, highlight=False)
    t = data["time"]
    out.print(
        f"decode at {running} concurrent: step {t['step_ms']:.2f} ms = max(memory "
        f"{t['memory_ms']:.2f}, compute {t['compute_ms']:.2f}) + fixed {t['fixed_ms']:.2f} + comm "
        f"{t['communication_ms']:.2f} + draft {t['draft_ms']:.2f}; {t['tokens_per_step']:.1f} "
        f"tokens/step -> {t['tokens_s_per_user']:.1f} tok/s per user, {t['tokens_s_total']:.0f} "
        f"total; prefill of one {tokens:,}-token prompt {ttft:.1f} s"
        + (" (its images' tower time included)" if vision and "request_ms" in vision else "")
    )


@app.command("simple")
@_user_errors
def simple_cmd(
    model: ModelOpt = "kimi-k3-dspark",
    prices: PricesOpt = None,
    price_source: Annotated[str, typer.Option(help="use price rows whose source contains this; "
                                                   "'' for all")] = "SAVRN",
    bits: Annotated[str, typer.Option(help="precisions in bits")] = "16,8,4",
    gpu_table: GpusOpt = None,
) -> None:
    """The seed's rule: weights at a precision + 20%, cheapest priced GPUs that hold them."""
    from capacity.simple import simple_table

    descriptor = describe_model(model)
    gpu_specs, price_rows = _tables(gpu_table, prices)
    try:
        precisions = [int(b) for b in _split(bits)]
    except ValueError:
        raise CapacityError(f"--bits must be integers, got {bits!r}") from None
    result = simple_table(descriptor, gpu_specs, price_rows, precisions, price_source or None)
    out.print(result.summary(), soft_wrap=True, highlight=False)
    used = [s.price for row in result.rows for s in row.setups]
    out.print(_price_age_line(used), highlight=False)


@app.command("calibrate")
@_user_errors
def calibrate_cmd(
    refit: Annotated[bool, typer.Option("--fit", help="refit the constants first")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Time-model error against each published measurement."""
    constants = fit() if refit else DEFAULT_CONSTANTS
    results = evaluate(constants)
    summary = calibration_summary(results)
    if as_json:
        print(json.dumps({
            "constants": constants.__dict__,
            "summary": summary,
            "anchors": [{
                "name": r.anchor.name, "gpu": r.anchor.gpu, "model": r.anchor.model,
                "engine": r.anchor.engine, "vendor_claim": r.anchor.vendor_claim,
                "fitted": r.anchor.fitted,
                "measured": r.anchor.measured, "unit": r.anchor.unit,
                "predicted": r.predicted, "error": r.error, "assumption": r.anchor.assumption,
                "source": r.anchor.source,
            } for r in results],
        }, indent=2))
        return
    table = Table(title="calibration anchors (goal: within 25% each; * = vendor claim, "
                        "(x) = cross-check, not fitted)")
    for col in ("anchor", "GPU", "engine", "measured", "model", "error", "unit", "assumption"):
        table.add_column(col, justify="right" if col in ("measured", "model", "error") else "left")
    for r in results:
        error = "n/a" if r.error is None else f"{r.error * 100:+.1f}%"
        model_value = "-" if r.predicted is None else f"{r.predicted:,.2f}"
        table.add_row(r.anchor.name + (" *" if r.anchor.vendor_claim else "")
                      + ("" if r.anchor.fitted else " (x)"), r.anchor.gpu,
                      r.anchor.engine, f"{r.anchor.measured:,.2f}", model_value, error,
                      r.anchor.unit, r.anchor.assumption)
    out.print(table)
    k3 = summary["k3"]
    out.print(f"K3: {k3['modeled']} modeled anchors over {len(k3['gpus'])} GPU types "
              f"({', '.join(k3['gpus'])}; {k3['amd_gpus']} AMD), worst |error| "
              f"{k3['worst_error'] * 100:.1f}% ({k3['worst_anchor']}), mean "
              f"{k3['mean_error'] * 100:.1f}%; {summary['not_modeled']} anchors not modeled "
              "(why: their assumption column)", soft_wrap=True, highlight=False)
    for key, what in (("k3_cross_check", "K3 cross-checks"), ("k2", "K2 cross-checks")):
        group = summary[key]
        if group["modeled"]:
            out.print(f"{what} (printed, not fitted): {group['modeled']} anchors, worst |error| "
                      f"{group['worst_error'] * 100:.1f}% ({group['worst_anchor']})",
                      soft_wrap=True, highlight=False)
    out.print(f"constants: {constants}", soft_wrap=True, highlight=False)


@app.command("emit")
@_user_errors
def emit_cmd(
    gpu: GpuOpt,
    model: ModelOpt = "kimi-k3",
    draft: DraftOpt = None,
    model_ref: Annotated[str | None, typer.Option(help="checkpoint path/repo in the Serve config")
                         ] = None,
    draft_ref: Annotated[str | None, typer.Option(help="draft checkpoint path/repo")] = None,
    context: ContextOpt = "128K",
    nodes: NodesOpt = 1,
    tp: TpOpt = None,
    dp: DpOpt = 1,
    ep: EpOpt = None,
    pp: PpOpt = 1,
    dcp: DcpOpt = 1,
    weights: Annotated[str, typer.Option()] = "native",
    kv: Annotated[str, typer.Option()] = "bf16",
    mem_fraction: Annotated[float | None, typer.Option()] = None,
    replicas: Annotated[int, typer.Option(help="engine replicas")] = 1,
    max_replicas: Annotated[int | None, typer.Option(
        help="autoscale from --replicas up to this many (placement.autoscaling; the cluster "
        "files' GPU workers follow)")] = None,
    pd_max: Annotated[str | None, typer.Option(
        "--pd-max", help="--pd: autoscale each pool from --pd up to PREFILL:DECODE replicas")
    ] = None,
    auth_mode: Annotated[str, typer.Option(help="RAY_AUTH_MODE for the cluster: token|disabled")
                         ] = "token",
    out_dir: Annotated[Path, typer.Option(help="folder for the two YAML files")] = Path("."),
    pd: Annotated[str | None, typer.Option(
        "--pd", help="prefill/decode disaggregated: PREFILL:DECODE replicas of this layout "
        "(SGLang's --disaggregation-mode per side; instead of --replicas)")] = None,
    transfer_backend: Annotated[str, typer.Option(
        help="--pd: SGLang's KV transfer backend, mooncake or nixl")] = "mooncake",
    prefill_nodes: Annotated[int | None, typer.Option(
        help="--pd: nodes per prefill replica (default: --nodes); the options without "
        "--prefill- then describe the decode replicas")] = None,
    prefill_dp: Annotated[int | None, typer.Option(
        help="--pd: the prefill replicas' attention data parallel ranks (default: --dp)")] = None,
    prefill_ep: Annotated[int | None, typer.Option(
        help="--pd: the prefill replicas' expert parallel size (default: --ep, or the whole "
        "stage when --prefill-nodes differs)")] = None,
    prefill_pp: Annotated[int | None, typer.Option(
        help="--pd: the prefill replicas' pipeline stages (default: --pp)")] = None,
    acceptance: AcceptOpt = None,
    workload_name: WorkloadOpt = None,
    gamma: GammaOpt = None,
    kda_rollback: RollbackOpt = DEFAULT_KDA_ROLLBACK,
    replay_ring_len: RingLenOpt = DEFAULT_REPLAY_RING_LEN,
    verify: Annotated[str | None, typer.Option(
        "--verify", help="SGLang's DSpark verify (SGLANG_RAGGED_VERIFY_MODE): compact, "
        "adaptive per request from the draft's confidence and an SPS cost table; static, the "
        "whole block every step; cap-accept, planned but not saved (a measurement mode). "
        "Default: compact, static on AMD (no ragged-verify CUDA graph there)")
    ] = None,
    sps_table: Annotated[str | None, typer.Option(
        "--sps-table", help="the adaptive verify's SPS cost table on the GPU nodes (default: "
        "<draft-ref>/sps/dspark-sps-<layout>.json); the file's header says how to make it")
    ] = None,
    levers: Annotated[bool, typer.Option(
        "--levers/--no-levers", help="choose SGLang 0.5.23's K3 levers for the layout "
        "(extra_buffer_lazy, decode context parallelism unless --dcp is given, the HiCache "
        "host tier, EPLB), each named in the file's header with its reason")] = True,
) -> None:
    """Write a validated Serve config and cluster-launcher config for one layout."""
    from capacity.emit import emit

    if replicas <= 0:
        raise CapacityError(f"--replicas must be positive, got {replicas}")
    sides = _pd_sides(pd, transfer_backend)
    if pd_max is not None and sides is None:
        raise CapacityError("--pd-max autoscales the pools of --pd PREFILL:DECODE")
    if max_replicas is not None and sides is not None:
        raise CapacityError("--max-replicas autoscales --replicas; with --pd use --pd-max")
    most: int | tuple[int, int] | None = (max_replicas if pd_max is None
                                          else _pd_sides(pd_max, transfer_backend))
    target = describe_model(model)
    draft_model, spec = _draft_and_spec(draft, acceptance, gamma, workload_name)
    gpu_specs = load_gpus()
    layout = _layout_from_options(gpu_specs, gpu, nodes, tp, dp, ep, pp, weights, kv,
                                  mem_fraction, dcp)
    prefill_layout = None
    if any(v is not None for v in (prefill_nodes, prefill_dp, prefill_ep, prefill_pp)):
        if sides is None:
            raise CapacityError("the --prefill-* options describe the prefill side of --pd "
                                "PREFILL:DECODE")
        same_stage = prefill_nodes in (None, nodes) and prefill_pp in (None, pp)
        prefill_layout = _layout_from_options(
            gpu_specs, gpu, prefill_nodes or nodes, None, prefill_dp or dp,
            prefill_ep or (ep if same_stage else None), prefill_pp or pp, weights, kv,
            mem_fraction)
    tokens = parse_tokens(context)
    spec_gpu = gpu_spec(gpu_specs, gpu)
    workload = validated(Workload, context_length=tokens)
    for side in (layout, prefill_layout):
        if side is None:
            continue
        # With the weights SGLang 0.5.23 holds there (refused where it has no K3 path).
        held, path = served_layout(target, side)
        report = memory_per_gpu(target, held, workload, spec_gpu, draft_model, spec)
        if not report.fits and not report.reasons[0].startswith("one "):
            how = (f" (with the weights SGLang 0.5.23 holds there: {path.label})"
                   if path is not None and held != side else "")
            raise CapacityError(f"{side.label()} does not fit{how}: "
                                f"{'; '.join(report.reasons)}")
    # The planner sizes max_running_requests and the KDA state pool, and refuses a layout on
    # which one request of the advertised context does not fit (capacity.emit.describe_layout).
    result = emit(out_dir, target, model_ref or target.name, layout, tokens, spec_gpu, replicas,
                  draft_model, draft_ref or (draft_model.name if draft_model else None), spec,
                  auth_mode, planner_refs=(model, draft), kda_rollback=kda_rollback,
                  ring_len=replay_ring_len, pd=sides, transfer_backend=transfer_backend,
                  prefill_layout=prefill_layout, verify=verify, sps_table=sps_table,
                  levers=levers, max_replicas=most)
    running = result.serve_config["applications"][0]["args"]["engine"]["sglang"][
        "max_running_requests"]
    out.print(f"wrote {result.serve_path} (ServeDeploySchema: valid) and {result.cluster_path} "
              f"(cluster launcher schema: valid); max_running_requests {running}")


def _pd_sides(pd: str | None, transfer_backend: str) -> tuple[int, int] | None:
    """`--pd PREFILL:DECODE` -> (prefill, decode) replicas, each at least 1."""
    if transfer_backend not in TRANSFER_BACKENDS:
        raise CapacityError(f"--transfer-backend {transfer_backend!r}: one of "
                            f"{', '.join(TRANSFER_BACKENDS)}")
    if pd is None:
        return None
    parts = pd.split(":")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise CapacityError(f"--pd {pd!r}: PREFILL:DECODE replicas, each >= 1 (e.g. 1:2)")
    return int(parts[0]), int(parts[1])


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
