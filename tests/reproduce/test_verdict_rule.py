"""The reproductions' verdict rule on synthetic numbers: direction, pairing by seed, floor and
ceiling (not measured), runs that did not train, divergence, and the audit's cases."""

from __future__ import annotations

import math

import pytest

from fastweights.reproduce.common import Claim, decide, judge, read_csv, write_csv

NAN = float("nan")


def test_better_is_directional():
    assert decide([1.0, 1.01, 0.99], [2.0, 2.02, 1.98], "better").verdict == "reproduced"
    assert decide([2.0, 2.02, 1.98], [1.0, 1.01, 0.99], "better").verdict == "not reproduced"
    # TTT walk step 1 as recorded: A numerically worse (2.941 vs 2.926) must not be reproduced
    step1 = decide({0: 2.932, 1: 2.950}, {0: 2.914, 1: 2.938}, "better", paired=True)
    assert step1.d < 0 and step1.verdict != "reproduced"
    # ... whereas "no worse" accepts it only when the excess is within the margin at its worst
    assert decide({0: 2.932, 1: 2.950}, {0: 2.914, 1: 2.938}, "not_worse", paired=True).verdict == "reproduced"


def test_a_difference_below_the_margin_is_inconclusive():
    # AFT-local vs AFT-full: d = 0.012 under a 1 % margin of 0.028
    v = decide({0: 2.808, 1: 2.822}, {0: 2.821, 1: 2.833}, "better", paired=True)
    assert v.d == pytest.approx(0.012) and v.margin == pytest.approx(0.02827, abs=1e-4)
    assert v.verdict == "inconclusive"


def test_degrades_is_better_reversed_and_a_collapse_claim_asks_more():
    assert decide([3.0, 3.01], [2.0, 2.02], "degrades").verdict == "reproduced"
    assert decide([2.0, 2.02], [3.0, 3.01], "degrades").verdict == "not reproduced"
    # long-context-truncated sum rule: +0.027 is a drift past a 1 % margin, not a collapse (10 %)
    drift = ({0: 2.6617, 1: 2.6643}, {0: 2.6289, 1: 2.6431})
    assert decide(*drift, "degrades", paired=True).verdict == "reproduced"
    assert decide(*drift, "degrades", paired=True, margin=0.1).verdict == "inconclusive"
    # ... and a clear fall refutes a collapse beyond the default margin (long-context, carried)
    fall = ({0: 2.777, 1: 2.845}, {0: 2.870, 1: 2.925})
    assert decide(*fall, "degrades", paired=True, margin=0.1).verdict == "not reproduced"


def test_both_sides_at_the_floor_or_ceiling_are_not_measured():
    # passkey: every recurrent model at 0 % (miss 1): no worse is not "reproduced"
    v = decide({0: 1.0, 1: 1.0}, {0: 1.0, 1: 1.0}, "not_worse", paired=True, floor=1.0)
    assert v.verdict == "not measured" and "floor" in v.reason
    assert decide([1.0, 1.0], [1.0, 1.0], "better", floor=1.0).verdict == "not measured"
    # both perfect (miss 0): the comparison cannot separate them either
    v = decide([0.0, 0.0], [0.0, 0.0], "not_worse", ceiling=0.0, floor=1.0)
    assert v.verdict == "not measured" and "ceiling" in v.reason
    # one side learned, the other at chance: measured, in the direction of the learned side
    assert decide([0.0, 0.0], [1.0, 0.98], "better", floor=1.0).verdict == "reproduced"
    assert decide([1.0, 0.98], [0.0, 0.0], "better", floor=1.0).verdict == "not reproduced"


def test_one_noisy_side_does_not_make_no_worse_reproduced():
    # infini <= softmax at 512: 0 % vs 17 % (softmax seeds 0 % and 33 %)
    v = decide({0: 1.0, 1: 1.0}, {0: 1.0, 1: 0.667}, "not_worse", paired=True, floor=1.0)
    assert v.verdict == "inconclusive", v
    v = decide({0: 1.0, 1: 1.0}, {0: 1.0, 1: 0.667}, "not_worse", floor=1.0)
    assert v.verdict == "inconclusive", v


def test_pairing_by_seed_removes_the_shared_seed_effect():
    a = {0: 2.00, 1: 2.50, 2: 3.00}
    b = {s: v + 0.05 + 0.001 * s for s, v in a.items()}  # every seed: B higher by ~0.05
    paired = decide(a, b, "better", paired=True)
    unpaired = decide(a, b, "better", paired=False)
    assert paired.paired and paired.verdict == "reproduced"
    assert paired.diffs == pytest.approx({0: 0.05, 1: 0.051, 2: 0.052})
    assert paired.noise == pytest.approx(2 * 0.001 / math.sqrt(3))
    assert not unpaired.paired and unpaired.verdict == "inconclusive"  # seed spread 0.5 swamps it
    # pairing needs the same seeds on both sides
    assert not decide({0: 1.0, 1: 1.1}, {1: 2.0, 2: 2.1}, "better", paired=True).paired
    # and a difference that flips sign between seeds is noise when paired
    assert decide({0: 1.0, 1: 1.0}, {0: 1.2, 1: 0.85}, "better", paired=True).verdict == "inconclusive"


def test_flat():
    assert decide([2.00, 2.01], [2.005, 2.012], "flat", paired=True).verdict == "reproduced"
    assert decide([2.5, 2.51], [2.0, 2.01], "flat").verdict == "not reproduced"
    assert decide([2.0, 2.3], [2.1, 1.8], "flat").verdict == "inconclusive"


def test_one_seed_only_the_margin_provisional():
    v = decide([1.0], [1.02], "better")
    assert v.verdict == "reproduced" and math.isnan(v.noise) and "provisional" in v.reason
    assert decide([1.0], [1.005], "better").verdict == "inconclusive"


def test_divergence_and_missing_sides():
    assert decide([NAN], [3.0], "better").verdict == "not reproduced"
    assert decide([3.0], [NAN, 2.0], "better").verdict == "reproduced"
    assert decide([3.0], [NAN, 2.0], "not_worse").verdict == "reproduced"
    assert decide([NAN], [3.0], "degrades").verdict == "reproduced"
    assert decide([NAN], [float("inf")], "better").verdict == "not measured"
    v = decide([], [1.0], "better")
    assert v.verdict == "not measured" and "A" in v.reason
    with pytest.raises(ValueError, match="kind"):
        decide([1.0], [2.0], "bigger")


def test_claims_check_their_fields():
    with pytest.raises(ValueError, match="kind"):
        Claim("x", "p", ("a", "loss"), ("b", "loss"), kind="bigger")
    with pytest.raises(ValueError, match="ceiling"):
        Claim("x", "p", ("a", "loss"), ("b", "loss"), floor=0.0, ceiling=1.0)
    with pytest.raises(ValueError, match="margin"):
        Claim("x", "p", ("a", "loss"), ("b", "loss"), margin=-0.1)


def rows_of(table):
    return [{"experiment": "e", "model": m, "seed": s, "parameters": 10, "steps": 1, "tokens": 1,
             "seconds": 1.0, "metrics": metrics} for m, s, metrics in table]


def test_judge_pairs_by_seed_and_leaves_out_runs_that_did_not_train():
    rows = rows_of([("a", 0, {"loss": 1.0}), ("a", 1, {"loss": 1.01}),
                    ("b", 0, {"loss": 2.0}), ("b", 1, {"loss": 2.01}),
                    ("stuck", 0, {"loss": 0.5, "trained": 0.0}), ("stuck", 1, {"loss": 0.5, "trained": 0.0})])
    (_, v), (_, w) = judge(rows, [Claim("a < b", "p", ("a", "loss"), ("b", "loss")),
                                  Claim("stuck < b", "p", ("stuck", "loss"), ("b", "loss"))])
    assert v.verdict == "reproduced" and v.paired and v.diffs == pytest.approx({0: 1.0, 1: 1.0})
    assert w.verdict == "not measured" and "did not train: stuck seed 0, stuck seed 1" in w.reason
    (_, k), = judge(rows, [Claim("stuck worse", "p", ("stuck", "loss"), ("b", "loss"), "better",
                                 with_untrained=True)])
    assert k.verdict == "reproduced" and "kept" in k.reason
    (_, u), = judge(rows, [Claim("a faster", "p", ("a", "loss"), ("b", "loss"), unmeasured="shared machine")])
    assert u.verdict == "not measured" and u.reason == "shared machine" and u.d == pytest.approx(1.0)


def test_results_csv_reads_back_what_was_written(tmp_path):
    rows = rows_of([("a", 0, {"loss": 1.5, "acc": NAN}), ("b", 1, {"loss": 2.0})])
    write_csv(tmp_path / "results.csv", rows)
    back = read_csv(tmp_path / "results.csv")
    assert [r["model"] for r in back] == ["a", "b"] and back[1]["seed"] == 1
    assert back[0]["metrics"]["loss"] == 1.5 and math.isnan(back[0]["metrics"]["acc"])
    assert "acc" not in back[1]["metrics"]  # an empty cell is no metric
