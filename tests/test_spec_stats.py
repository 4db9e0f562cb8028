"""The one definition of the speculative statistics both backends report."""

from __future__ import annotations

from serve_app.engines.spec_stats import EngineTotals, SpecStats, sglang_request_spec

KEYS = {"spec_verify_ct", "spec_accept_length", "spec_accept_rate",
        "spec_correct_drafts_histogram", "spec_proposed_drafts", "spec_accepted_drafts"}


def test_record_merge_and_formulas() -> None:
    a = SpecStats()
    a.record(4, 2)
    a.record(4, 0)
    assert (a.verify_ct, a.proposed_drafts, a.accepted_drafts) == (2, 8, 2)
    assert a.correct_drafts_histogram == [1, 0, 1]
    b = SpecStats()
    b.record(3, 3)
    a.merge(b)
    assert a.correct_drafts_histogram == [1, 0, 1, 1]
    d = a.as_dict(9)
    assert set(d) == KEYS
    assert d["spec_accept_length"] == 3.0 and d["spec_accept_rate"] == 5 / 11
    assert SpecStats.from_dict(d) == a
    empty = SpecStats().as_dict(0)
    assert empty["spec_accept_length"] == 1.0 and empty["spec_accept_rate"] == 0.0


def test_sglang_meta_keeps_sglang_ratios() -> None:
    meta = {"spec_verify_ct": 2, "spec_accept_length": 2.5, "spec_accept_rate": 0.2,
            "spec_num_correct_drafts": 3, "spec_num_proposed_drafts": 12,
            "spec_correct_drafts_histogram": [0, 1, 1], "completion_tokens": 5}
    d = sglang_request_spec(meta, speculative=True)
    assert d is not None and set(d) == KEYS
    assert (d["spec_accept_length"], d["spec_accept_rate"]) == (2.5, 0.2)
    assert (d["spec_proposed_drafts"], d["spec_accepted_drafts"]) == (12, 3)
    assert sglang_request_spec({}, speculative=False) is None
    assert sglang_request_spec({}, speculative=True) == SpecStats().as_dict(0)


def test_totals() -> None:
    t = EngineTotals()
    s = SpecStats()
    s.record(4, 1)
    t.add_finished(3, 2, s)
    t.add_finished(5, 7, None)
    assert (t.requests_finished, t.prompt_tokens, t.completion_tokens) == (2, 8, 9)
    assert t.spec_completion_tokens == 2 and t.spec_dict()["spec_accept_length"] == 2.0
