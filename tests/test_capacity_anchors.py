"""The time model's published K3 anchors: how many, on which GPUs, how close, and what the
calibrate command prints about them."""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

from capacity.calibration import anchors, calibration_summary, evaluate, k3_anchor_gpus
from capacity.cli import app
from capacity.tables import load_gpus


def test_k3_anchors_cover_five_gpu_types_two_of_them_amd():
    results = evaluate()
    k3 = [r for r in results
          if r.anchor.model == "K3" and r.anchor.fitted and r.error is not None]
    gpus = load_gpus()
    types = {r.anchor.gpu.upper() for r in k3}
    assert len(k3) >= 15
    assert len(types) >= 5
    assert {g for g in types if gpus[g].vendor == "AMD"} >= {"MI355X", "MI325X"}
    assert types == set(k3_anchor_gpus())
    worst = max(k3, key=lambda r: abs(r.error))
    assert abs(worst.error) <= 0.25, worst.anchor.name


def test_every_anchor_names_a_dated_source_and_a_known_gpu():
    gpus = load_gpus()
    for anchor in anchors():
        assert re.search(r"20\d\d-\d\d(-\d\d)?", anchor.source), anchor.name
        assert anchor.gpu.upper() in gpus, anchor.name
        assert anchor.assumption, anchor.name
        if anchor.predict is None:
            assert anchor.assumption.startswith("not modeled"), anchor.name
    # AMD's own day-0 numbers are marked as the vendor's claims.
    assert all(a.vendor_claim for a in anchors() if a.gpu == "MI355X" and a.predict)


def test_cross_checks_say_why_they_are_not_fitted():
    cross = [a for a in anchors() if a.predict and not a.fitted]
    assert {a.model for a in cross} == {"K2", "K3"}
    assert all("cross-check, not fitted" in a.assumption for a in cross)
    summary = calibration_summary(evaluate())
    assert summary["k3_cross_check"]["modeled"] == sum(1 for a in cross if a.model == "K3")


def test_the_pd_frontier_is_listed_but_not_modeled():
    frontier = [a for a in anchors() if a.name.startswith("K3 PD") or "HiCache" in a.name]
    assert len(frontier) >= 3
    assert all(a.predict is None and "not modeled" in a.assumption for a in frontier)


def test_the_gb200_dcp_cells_are_predicted_as_cross_checks():
    """The GB200 DCP decode cells run through the time model's DCP (KV and MLA attention over
    dcp ranks): printed beside the measurement, not fitted (the same day-0 decode as the other
    GB200 decode cells)."""
    from capacity.config import Layout
    from capacity.families import describe_model
    from capacity.timing import decode_rate

    rows = {r.anchor.name: r for r in evaluate() if "GB200 DCP" in r.anchor.name}
    assert len(rows) == 2
    for row in rows.values():
        assert row.anchor.predict is not None and not row.anchor.fitted
        # Like the other day-0 GB200 decode cells, the model is faster than the measurement.
        assert row.predicted is not None and row.error is not None and row.error > 0
    # At 8.7k tokens the DCP16 collectives cost more than the 1/16 KV read saves: the same
    # layout without DCP decodes faster in the model.
    plain = decode_rate(describe_model("kimi-k3"), Layout(gpu="GB200", nodes=4, tp=16, ep=16),
                        load_gpus()["GB200"], 8, 8192 + 512, None, None).per_user_tokens_s
    assert rows["K3 16xGB200 DCP16 + EP16 decode, c=8"].predicted < plain


def test_b300_tok_s_per_gpu_is_input_plus_output():
    """The cookbook's c=1 row, by hand: 9,216 tokens per request in TTFT + 1,023 x TPOT, on 8
    GPUs, is its 127 tok/s/GPU; the anchors read the c=16 / c=64 rows the same way."""
    assert round(9216 / (0.378 + 1023 * 0.00851) / 8) == 127
    unit = {a.name: a.unit for a in anchors()}
    assert unit["K3 8xB300 no spec, c=16"] == "tok/s per GPU (in+out)"


def test_summary_counts_what_it_says():
    summary = calibration_summary(evaluate())
    k3 = summary["k3"]
    assert isinstance(k3, dict)
    assert k3["modeled"] >= 15 and len(k3["gpus"]) >= 5 and k3["amd_gpus"] >= 2
    assert 0 < k3["mean_error"] <= k3["worst_error"] <= 0.25


def test_calibrate_prints_every_anchor_error_and_the_k3_summary():
    result = CliRunner().invoke(app, ["calibrate"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    for a in anchors():
        assert a.name in result.output
    assert re.search(r"K3: \d+ modeled anchors over \d+ GPU types .*2 AMD", result.output)
    data = json.loads(CliRunner().invoke(app, ["calibrate", "--json"]).output)
    modeled = [a for a in data["anchors"]
               if a["error"] is not None and a["model"] == "K3" and a["fitted"]]
    assert len(modeled) >= 15 and all(abs(a["error"]) <= 0.25 for a in modeled)
