"""The planner's image path: the tower's size from vision_config, K3's image -> tokens rule,
the tower's time in TTFT, and the CLI's image options."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from capacity import CapacityError, Layout, Workload, describe_model, load_gpus, memory_per_gpu
from capacity.cli import app, parse_images
from capacity.config import Images
from capacity.planner import plan
from capacity.vision import (
    MediaLimits,
    image_grid,
    largest_image,
    load_media_limits,
    prompt_tokens,
    vision_from_config,
)

runner = CliRunner()
K3_MEDIA = MediaLimits(patch_size=14, merge_kernel_size=2, in_patch_limit=65536,
                       patch_limit_on_one_side=512, fixed_output_tokens=None, source="test")


@pytest.fixture(scope="module")
def k3():
    return describe_model("kimi-k3")


def test_tower_params_from_the_config_equal_a_hand_count(k3) -> None:
    # vision_config: D 1024, 27 layers, qkv width 1536, MLP 4096, patch 14, pos table 64 x 64,
    # RMSNorm (weight only), no biases; projector 4 x 1024 -> 4096 -> 7168 + post_norm.
    d, qkv, inter, layers = 1024, 1536, 4096, 27
    patch_embed = d * 3 * 14 * 14
    pos_table = 64 * 64 * d
    block = 2 * d + 3 * qkv * d + d * qkv + inter * d + d * inter  # norms, wqkv, wo, fc0, fc1
    tower = patch_embed + pos_table + layers * block + d  # + final_layernorm
    projector = 4096 * 4096 + 7168 * 4096 + 7168
    assert k3.vision.tower_params == tower == 401_214_464  # the "~401M" of the model card
    assert k3.vision.projector_params == projector == 46_144_512
    assert k3.vision.tower_bytes + k3.vision.projector_bytes == 2 * (tower + projector)
    assert k3.media == load_media_limits(None)
    assert (k3.media.in_patch_limit, k3.media.patch_limit_on_one_side) == (65536, 512)


def test_biases_and_layernorm_add_their_vectors() -> None:
    config = {"patch_size": 14, "vt_hidden_size": 8, "vt_num_hidden_layers": 2,
              "vt_num_attention_heads": 2, "vt_intermediate_size": 16, "init_pos_emb_height": 2,
              "init_pos_emb_width": 3, "merge_kernel_size": [2, 2], "text_hidden_size": 5}
    # SGLang's module defaults: LayerNorm, biases on everywhere, qkv width = D.
    with_bias = vision_from_config(config, "test")
    plain = vision_from_config({**config, "norm_type": "rmsnorm", "attn_bias": False,
                                "linear_bias": False, "patch_embed_proj_bias": False}, "test")
    d, inter, layers = 8, 16, 2
    per_layer_extra = 2 * d + 3 * d + d + inter + d  # norm biases, wqkv, wo, fc0, fc1 biases
    assert with_bias.tower_params - plain.tower_params == d + layers * per_layer_extra + d
    with pytest.raises(CapacityError, match="qkv_hidden_size"):
        vision_from_config({**config, "qkv_hidden_size": 9}, "test")
    with pytest.raises(CapacityError, match="missing fields: vt_hidden_size"):
        vision_from_config({k: v for k, v in config.items() if k != "vt_hidden_size"}, "test")


@pytest.mark.parametrize(("size", "resized", "grid", "tokens"), [
    ((1024, 1024), (1024, 1024), (74, 74), 1369),  # pads 1024 -> 1036
    ((1024, 768), (1024, 768), (56, 74), 37 * 28),
    ((28, 28), (28, 28), (2, 2), 1),
    ((1, 1), (1, 1), (2, 2), 1),  # padded up to one merged token
    ((640, 480), (640, 480), (36, 46), 23 * 18),
    # The patch limit: scale = sqrt(65536 / (257 x 257)), int() truncation (kimi-k3-vision.md).
    ((3600, 3599), (3585, 3584), (256, 258), 128 * 129),
    # The per-side limit: 14 x 512 / 8366.
    ((8366, 100), (7167, 85), (8, 512), 4 * 256),
    # vLLM's K3 processor profiles this one as its largest image: 16,817 tokens.
    ((1861, 7041), (1850, 7002), (502, 134), 16_817),
    ((4000, 3000), (4000, 3000), (216, 286), 108 * 143),  # 61,776 patches: under the limit
    # sqrt(65536 / (357 x 285)) = 0.80257: 4012.85 x 3210.28, truncated.
    ((5000, 4000), (4012, 3210), (230, 288), 115 * 144),
])
def test_tokens_per_image_follow_k3s_resize(size, resized, grid, tokens) -> None:
    image = image_grid(*size, K3_MEDIA)
    assert (image.new_width, image.new_height) == resized
    assert (image.grid_h, image.grid_w) == grid
    assert image.tokens == tokens == image.patches // 4


def test_the_patch_limit_binds_before_the_pad() -> None:
    # Every image past the limit lands within a few percent of it, never far above.
    for size in ((3600, 3599), (20000, 20000), (5000, 900), (7168, 7168), (1000, 60000)):
        image = image_grid(*size, K3_MEDIA)
        assert image.patches <= 1.03 * K3_MEDIA.in_patch_limit, size
        assert max(image.grid_h, image.grid_w) <= 512 + 1


def test_largest_image_is_the_brute_force_maximum() -> None:
    """The search over (W // p, H // p) against every W, H up to past the side clamp, on small
    limits where the brute force is cheap."""
    media = MediaLimits(patch_size=2, merge_kernel_size=2, in_patch_limit=60,
                        patch_limit_on_one_side=12, fixed_output_tokens=None, source="test")
    brute = max(image_grid(w, h, media).patches for w in range(1, 120) for h in range(1, 120))
    assert largest_image(media).patches == brute
    k3 = largest_image(K3_MEDIA)
    # More than vLLM's profiled 1861x7041 (67,268 patches); a numpy brute force over every
    # W, H <= 9000 finds the same 67,320.
    assert (k3.label, k3.patches, k3.tokens) == ("1889x7377", 67_320, 16_830)


def test_prompt_is_text_plus_image_tokens(k3) -> None:
    assert prompt_tokens(k3, 1000, Images()) == 1000
    assert prompt_tokens(k3, 1000, Images(per_request=3, width=1024, height=768)) == 1000 + 3 * 1036
    with pytest.raises(CapacityError, match="has no vision_config"):
        prompt_tokens(describe_model("kimi-k2"), 1000, Images(per_request=1))


def test_tower_memory_is_on_every_gpu_in_bf16(k3) -> None:
    gpus = load_gpus()
    for layout in (Layout(gpu="H200", nodes=2, tp=16, ep=16),
                   Layout(gpu="H200", nodes=2, tp=8, pp=2, ep=8)):
        report = memory_per_gpu(k3, layout, Workload(context_length=8192), gpus["H200"])
        for stage in report.stages:
            assert stage.weights["vision_tower"] == 2 * 401_214_464
            assert stage.weights["mm_projector"] == 2 * 46_144_512
            # The largest image's tower call, outside the static pool: ~32 KB per patch.
            peak = stage.outside_pool["vision_activation"]
            assert 30_000 * 67_320 < peak < 34_000 * 67_320
    # Ten 4K-ish images of one request on a TP2 rank pack into one call above that.
    many = Images(per_request=10, width=3600, height=3599)
    lay = Layout(gpu="H200", nodes=1, tp=2, attention_dp=1, ep=2)
    packed = memory_per_gpu(k3, lay, Workload(context_length=200_000, images=many), gpus["H200"])
    assert packed.stages[0].outside_pool["vision_activation"] == k3.vision.activation_bytes(
        5 * image_grid(3600, 3599, k3.media).patches)


def test_ttft_grows_with_images_per_request(k3) -> None:
    gpus = load_gpus()
    ttft = []
    for count in (0, 1, 4, 16):
        result = plan(k3, gpus, [], 32_768, allowed_gpus=["H200"], max_nodes=2,
                      images=Images(per_request=count, width=1024, height=1024))
        best = next(r for r in result.rows if r.layout.label() == "2x8 H200 TP16 EP16")
        assert result.context_length == 32_768 + count * 1369
        ttft.append(best.prefill_s)
        assert (best.vision_ms_per_image is None) == (count == 0)
    assert ttft == sorted(ttft) and len(set(ttft)) == 4


def test_tower_time_is_the_flops_at_the_planners_prefill_efficiency(k3) -> None:
    from capacity.timing import DEFAULT_CONSTANTS, vision_seconds

    gpus = load_gpus()
    v = k3.vision
    patches = 74 * 74
    # Per layer: 2P x D x (3 qkv + qkv + 2 MLP) + 4 P^2 x qkv; the patch embedding; projector
    # over P / 4 tokens: 4D -> 4D -> 7168.
    flops = (2 * patches * 588 * 1024
             + 27 * (2 * patches * 1024 * (4 * 1536 + 2 * 4096) + 4 * patches**2 * 1536))
    assert v.tower_flops(patches) == pytest.approx(flops)
    assert v.projector_flops(1369) == 2 * 1369 * 4096 * (4096 + 7168)
    c = DEFAULT_CONSTANTS
    lay = Layout(gpu="H200", nodes=2, tp=16, ep=16)
    one = vision_seconds(k3, lay, gpus["H200"], Images(per_request=1))
    peak = gpus["H200"].bf16_tflops * 1e12 * c.prefill_compute_efficiency
    expected = (flops + v.projector_flops(1369)) / peak + 28 * c.layer_overhead_us * 1e-6
    assert one.per_image_s == pytest.approx(expected)
    # 40 images over 16 attention-TP ranks: 3 on the busiest, the projector for all 40.
    forty = vision_seconds(k3, lay, gpus["H200"], Images(per_request=40))
    assert forty.images_on_busiest_rank == 3
    assert one.request_s < forty.request_s < 40 * one.request_s
    assert forty.per_image_s == one.per_image_s
    assert math.isclose(one.request_s, one.per_image_s)


@pytest.mark.parametrize(("count", "size", "fragment"), [
    (1, "0x0", "at least 1 pixel"),
    (1, "1024x0", "at least 1 pixel"),
    (1, "40000x25000", "1,000,000,000 pixels"),
    (1, "1024", "WIDTHxHEIGHT"),
    (1, "axb", "WIDTHxHEIGHT"),
    (1, "-5x10", "WIDTHxHEIGHT"),
    (-1, "1024x768", "--images-per-request must be 0 or more, got -1"),
])
def test_image_options_reject_absurd_values(count, size, fragment) -> None:
    with pytest.raises(CapacityError, match=fragment):
        parse_images(count, size)
    result = runner.invoke(app, ["explain", "--gpu", "H200", "--nodes", "2",
                                 "--images-per-request", str(count), "--image-size", size])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and fragment in " ".join(result.output.split())


def test_image_options_parse() -> None:
    assert parse_images(2, "1024x768") == Images(per_request=2, width=1024, height=768)
    assert parse_images(0, " 640 X 480 ") == Images(per_request=0, width=640, height=480)


def test_too_many_image_tokens_exceed_the_context(k3) -> None:
    result = runner.invoke(app, ["explain", "--gpu", "H200", "--nodes", "2", "--context", "1M",
                                 "--images-per-request", "2"])
    assert result.exit_code == 2, result.output
    assert "1,048,576 text tokens + 2 x 1024x1024 images" in " ".join(result.output.split())
    result = runner.invoke(app, ["explain", "--gpu", "H200", "--model", "kimi-k2",
                                 "--images-per-request", "1"])
    assert result.exit_code == 2 and "no vision_config" in result.output


def test_explain_and_plan_show_the_tower() -> None:
    result = runner.invoke(app, ["explain", "--gpu", "H200", "--nodes", "2", "--kv", "fp8",
                                 "--images-per-request", "2", "--image-size", "1024x1024",
                                 "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    vision = data["vision"]
    assert vision["tokens_per_image"] == 1369 and vision["prompt_tokens"] == 131_072 + 2738
    assert vision["weights_gb_per_gpu"] == pytest.approx(0.894717, abs=1e-6)
    assert data["stages"][0]["weights_gb"]["vision_tower"] == pytest.approx(0.802429, abs=1e-6)
    assert vision["ms_per_image"] > 1
    plain = json.loads(runner.invoke(app, ["explain", "--gpu", "H200", "--nodes", "2", "--kv",
                                           "fp8", "--json"]).output)
    assert data["time"]["prefill_s_one_prompt"] > plain["time"]["prefill_s_one_prompt"]
    result = runner.invoke(app, ["plan", "--gpus", "H200,MI355X", "--max-nodes", "2",
                                 "--images-per-request", "2", "--image-size", "1024x768"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "1024x768 image -> 1024x768, 4,144 patches, 1,036 tokens" in text
    assert "TTFT includes the vision tower" in text
