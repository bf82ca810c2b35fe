"""The reproductions' verdict rule on synthetic numbers: direction, pairing by seed, the Student-t
interval, "smaller than claimed", the seed counts, equality, floor and ceiling (not measured),
runs that did not train, divergence, and the audits' cases."""

from __future__ import annotations

import math
import statistics

import pytest

from fastweights.reproduce.common import (
    SMALLER,
    Claim,
    decide,
    judge,
    read_csv,
    t_cdf_two_sided,
    t_quantile,
    write_csv,
)

NAN = float("nan")
SRC = "a seed note, §1"


def seeds(*values: float) -> dict[int, float]:
    return dict(enumerate(values))


def test_t_quantiles_match_the_tables():
    # two-sided 95 %: 12.706 (1 dof), 4.303, 3.182, 2.776, 2.571, ..., 2.042 (30)
    for dof, t in [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (5, 2.5706), (7, 2.3646),
                   (30, 2.0423)]:
        assert t_quantile(0.95, dof) == pytest.approx(t, abs=1e-4)
    assert t_cdf_two_sided(0.0, 3) == 0.0 and t_cdf_two_sided(1e9, 4) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="dof"):
        t_cdf_two_sided(1.0, 0)


def test_better_is_directional():
    a, b = seeds(1.0, 1.01, 0.99, 1.0), seeds(2.0, 2.02, 1.98, 2.0)
    assert decide(a, b, "better").verdict == "reproduced"
    assert decide(b, a, "better").verdict == "not reproduced"
    # TTT walk step 1 as recorded: A numerically worse (2.941 vs 2.926) must not be reproduced
    step1 = decide(seeds(2.932, 2.950, 2.94, 2.942), seeds(2.914, 2.938, 2.93, 2.92), "better", paired=True)
    assert step1.d < 0 and step1.verdict != "reproduced"


def test_the_noise_is_the_student_t_interval_of_the_paired_differences():
    a = seeds(2.00, 2.50, 3.00, 2.2)
    b = {s: v + 0.05 + 0.001 * s for s, v in a.items()}  # every seed: B higher by ~0.05
    paired = decide(a, b, "better", paired=True)
    diffs = [0.05 + 0.001 * s for s in range(4)]
    assert paired.paired and paired.diffs == pytest.approx(dict(enumerate(diffs)))
    assert paired.noise == pytest.approx(3.1824 * statistics.stdev(diffs) / 2, rel=1e-4)
    assert paired.verdict == "reproduced"
    unpaired = decide(a, b, "better", paired=False)
    assert not unpaired.paired and unpaired.verdict == "inconclusive"  # seed spread 0.5 swamps it
    # a difference that flips sign between seeds is noise when paired
    flip = decide(seeds(1.0, 1.0, 1.0, 1.0), seeds(1.2, 0.85, 1.2, 0.85), "better", paired=True)
    assert flip.verdict == "inconclusive"


def test_pairing_uses_the_seeds_both_sides_have():
    v = decide(seeds(1.0, 1.1, 1.2, 1.3, 1.4, 1.5), {1: 2.1, 2: 2.2, 3: 2.3, 4: 2.4}, "better",
               paired=True)
    assert v.paired and sorted(v.diffs) == [1, 2, 3, 4] and v.verdict == "reproduced"
    assert not decide({0: 1.0, 1: 1.1}, {2: 2.0, 3: 2.1}, "better", paired=True).paired


def test_welch_for_unpaired_sides():
    a, b = [1.0, 1.2, 1.1, 0.9], [2.0, 2.5, 1.5, 2.4, 1.6]
    v = decide(a, b, "better")
    va, vb = statistics.variance(a) / 4, statistics.variance(b) / 5
    dof = (va + vb) ** 2 / (va ** 2 / 3 + vb ** 2 / 4)
    assert v.noise == pytest.approx(t_quantile(0.95, math.floor(dof)) * math.sqrt(va + vb))


def test_an_effect_whose_interval_excludes_the_claimed_size_is_smaller_than_claimed():
    # long-context, sum rule carried: own - fresh +0.0069 and +0.0017 per seed against a 10 %
    # collapse (margin ~0.28): with enough seeds the interval excludes the claimed collapse
    collapse = decide(seeds(2.821, 2.815, 2.818, 2.820, 2.816, 2.819),
                      seeds(2.814, 2.813, 2.815, 2.812, 2.814, 2.815), "degrades", paired=True,
                      margin=0.1)
    assert collapse.verdict == SMALLER
    # ... and a tiny but clear effect under a 1 % margin is smaller than claimed, not reproduced
    tiny = decide(seeds(2.000, 2.001, 2.000, 2.002, 2.001, 2.000),
                  seeds(2.005, 2.006, 2.006, 2.007, 2.005, 2.006), "better", paired=True)
    assert 0 < tiny.d < tiny.margin and tiny.verdict == SMALLER
    # with noise reaching past the margin it stays inconclusive
    wide = decide(seeds(2.0, 2.0, 2.0, 2.0, 2.0, 2.0), seeds(2.0, 2.06, 1.97, 2.05, 1.96, 2.04),
                  "better", paired=True)
    assert wide.verdict == "inconclusive"


def test_a_clear_opposite_effect_refutes_a_collapse():
    fall = decide(seeds(2.777, 2.845, 2.80, 2.79), seeds(2.870, 2.925, 2.90, 2.88), "degrades",
                  paired=True, margin=0.1)
    assert fall.verdict == "not reproduced"


def test_fewer_than_four_seeds_give_no_verdict():
    v = decide(seeds(1.0, 1.01, 0.99), seeds(2.0, 2.02, 1.98), "better")
    assert v.verdict == "inconclusive" and "fewer than 4" in v.reason and "reproduced" in v.reason
    v = decide([1.0], [1.5], "better")
    assert v.verdict == "inconclusive" and math.isnan(v.noise)


def test_an_effect_near_the_margin_needs_six_seeds():
    # d = 0.045 against a margin of 0.03 (1 % of 3.0): within twice the margin
    a = [2.955, 2.956, 2.954, 2.955]
    b = [3.0, 3.001, 3.0, 2.999]
    four = decide(seeds(*a), seeds(*b), "better", paired=True)
    assert four.verdict == "inconclusive" and "needs 6 seeds" in four.reason
    six = decide(seeds(*a, 2.955, 2.956), seeds(*b, 3.0, 3.001), "better", paired=True)
    assert six.verdict == "reproduced"
    far = decide(seeds(*a), seeds(3.2, 3.201, 3.2, 3.199), "better", paired=True)
    assert far.verdict == "reproduced"  # far beyond twice the margin: four seeds do


def test_flat_is_an_equality_test():
    a, b = seeds(2.00, 2.01, 2.0, 2.005, 2.0, 2.01), seeds(2.005, 2.012, 2.003, 2.004, 2.001, 2.0)
    assert decide(a, b, "flat", paired=True, margin_abs=0.05).verdict == "reproduced"
    # an equality is always within twice the margin: it needs six seeds
    four = decide(dict(list(a.items())[:4]), b, "flat", paired=True, margin_abs=0.05)
    assert four.verdict == "inconclusive" and "needs 6 seeds" in four.reason
    assert decide(seeds(2.5, 2.51, 2.49, 2.5), seeds(2.0, 2.01, 1.99, 2.0), "flat").verdict == "not reproduced"
    assert decide(seeds(2.0, 2.3, 1.9, 2.2), seeds(2.1, 1.8, 2.3, 1.9), "flat").verdict == "inconclusive"


def test_no_worse():
    a = seeds(2.932, 2.950, 2.94, 2.941, 2.93, 2.935)
    b = seeds(2.914, 2.938, 2.93, 2.925, 2.92, 2.93)
    v = decide(a, b, "not_worse", paired=True, margin=0.02)
    assert v.verdict == "reproduced"
    # infini <= softmax at 512: 0 % vs 17 %: one noisy side keeps it inconclusive
    v = decide(seeds(1.0, 1.0, 1.0, 1.0), seeds(1.0, 0.667, 1.0, 0.667), "not_worse", paired=True,
               floor=1.0, margin_abs=0.05)
    assert v.verdict == "inconclusive", v


def test_both_sides_at_the_floor_or_ceiling_are_not_measured():
    v = decide(seeds(1.0, 1.0, 1.0, 1.0), seeds(1.0, 1.0, 1.0, 1.0), "not_worse", paired=True, floor=1.0)
    assert v.verdict == "not measured" and "floor" in v.reason
    v = decide([0.0] * 4, [0.0] * 4, "not_worse", ceiling=0.0, floor=1.0)
    assert v.verdict == "not measured" and "ceiling" in v.reason
    # one side learned, the other at chance: measured, in the direction of the learned side
    assert decide([0.0] * 4, [1.0, 0.98, 1.0, 0.99], "better", floor=1.0).verdict == "reproduced"
    assert decide([1.0, 0.98, 1.0, 0.99], [0.0] * 4, "better", floor=1.0).verdict == "not reproduced"


def test_divergence_and_missing_sides():
    assert decide([NAN], [3.0], "better").verdict == "not reproduced"
    assert decide([3.0], [NAN, 2.0], "better").verdict == "reproduced"
    assert decide([NAN], [3.0], "degrades").verdict == "reproduced"
    assert decide([NAN], [float("inf")], "better").verdict == "not measured"
    v = decide([], [1.0], "better")
    assert v.verdict == "not measured" and "A" in v.reason
    with pytest.raises(ValueError, match="kind"):
        decide([1.0], [2.0], "bigger")


def test_claims_check_their_fields():
    with pytest.raises(ValueError, match="kind"):
        Claim("x", "p", ("a", "loss"), ("b", "loss"), kind="bigger", source=SRC)
    with pytest.raises(ValueError, match="ceiling"):
        Claim("x", "p", ("a", "loss"), ("b", "loss"), floor=0.0, ceiling=1.0, source=SRC)
    with pytest.raises(ValueError, match="margin"):
        Claim("x", "p", ("a", "loss"), ("b", "loss"), margin=-0.1, source=SRC)
    with pytest.raises(ValueError, match="source"):
        Claim("x", "p", ("a", "loss"), ("b", "loss"))
    Claim("x", "control", ("a", "loss"), ("b", "loss"), control=True)  # a control names none


def rows_of(table):
    return [{"experiment": "e", "model": m, "seed": s, "parameters": 10, "steps": 1, "tokens": 1,
             "seconds": 1.0, "metrics": metrics} for m, s, metrics in table]


def test_judge_pairs_by_seed_and_a_run_that_did_not_train_is_not_measured():
    rows = rows_of([*[("a", s, {"loss": 1.0 + 0.01 * s}) for s in range(4)],
                    *[("b", s, {"loss": 2.0 + 0.01 * s}) for s in range(4)],
                    *[("stuck", s, {"loss": 3.0, "trained": float(s != 2)}) for s in range(4)]])
    (_, v), (_, w) = judge(rows, [Claim("a < b", "p", ("a", "loss"), ("b", "loss"), source=SRC),
                                  Claim("b < stuck", "p", ("b", "loss"), ("stuck", "loss"), source=SRC)])
    assert v.verdict == "reproduced" and v.paired and v.diffs == pytest.approx(dict.fromkeys(range(4), 1.0))
    # one of stuck's four runs did not train: no verdict, although the numbers would give one
    assert w.verdict == "not measured" and "did not train: stuck seed 2" in w.reason
    assert w.d == pytest.approx(0.985)
    (_, u), = judge(rows, [Claim("a faster", "p", ("a", "loss"), ("b", "loss"), unmeasured="shared machine",
                                 source=SRC)])
    assert u.verdict == "not measured" and u.reason == "shared machine" and u.d == pytest.approx(1.0)


def test_results_csv_reads_back_what_was_written(tmp_path):
    rows = rows_of([("a", 0, {"loss": 1.5, "acc": NAN}), ("b", 1, {"loss": 2.0})])
    write_csv(tmp_path / "results.csv", rows)
    back = read_csv(tmp_path / "results.csv")
    assert [r["model"] for r in back] == ["a", "b"] and back[1]["seed"] == 1
    assert back[0]["metrics"]["loss"] == 1.5 and math.isnan(back[0]["metrics"]["acc"])
    assert "acc" not in back[1]["metrics"]  # an empty cell is no metric
