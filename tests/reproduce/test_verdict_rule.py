"""The reproductions' verdict rule on synthetic numbers: direction, pairing by seed, the Student-t
interval, each label (reproduced, not reproduced, right direction but smaller than claimed, no
effect, inconclusive), the seed counts, one seed set per record, equality, floor and ceiling (not
measured), runs that did not train, divergence, the windows' noise, Holm, and the audits' cases."""

from __future__ import annotations

import math
import statistics

import pytest

from fastweights.reproduce.common import (
    INCONCLUSIVE,
    NO_EFFECT,
    NOT_MEASURED,
    NOT_REPRODUCED,
    REPRODUCED,
    SMALLER,
    Claim,
    decide,
    holm,
    judge,
    judged_seeds,
    p_value,
    read_csv,
    t_cdf_two_sided,
    t_quantile,
    window_se,
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
    assert flip.verdict == INCONCLUSIVE


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


def test_an_effect_whose_interval_lies_above_0_and_below_the_margin_is_smaller_than_claimed():
    # long-context, sum rule carried: own - fresh +0.0069 and +0.0017 per seed against a 10 %
    # collapse (margin ~0.28): the interval lies above 0 and excludes the claimed collapse
    collapse = decide(seeds(2.821, 2.815, 2.818, 2.820, 2.816, 2.819),
                      seeds(2.814, 2.813, 2.815, 2.812, 2.814, 2.815), "degrades", paired=True,
                      margin=0.1)
    lo, hi = -collapse.d - collapse.noise, -collapse.d + collapse.noise
    assert lo > 0 and hi < collapse.margin and collapse.verdict == SMALLER
    # ... and a tiny but clear effect under a 1 % margin is smaller than claimed, not reproduced
    tiny = decide(seeds(2.000, 2.001, 2.000, 2.002, 2.001, 2.000),
                  seeds(2.005, 2.006, 2.006, 2.007, 2.005, 2.006), "better", paired=True)
    assert 0 < tiny.d < tiny.margin and tiny.interval[0] > 0 and tiny.verdict == SMALLER
    # with noise reaching past the margin it stays inconclusive
    wide = decide(seeds(2.0, 2.0, 2.0, 2.0, 2.0, 2.0), seeds(2.0, 2.06, 1.97, 2.05, 1.96, 2.04),
                  "better", paired=True)
    assert wide.verdict == INCONCLUSIVE


def _shifted(d: float, spread: float, n: int = 6, base: float = 2.0) -> tuple[dict, dict]:
    """A, B with per-seed differences B - A = d + spread x (a fixed pattern of mean 0, sd 1)."""
    pattern = [-1.2, 0.9, -0.4, 1.3, -0.8, 0.2, 0.6, -0.6][:n]
    mean, sd = statistics.fmean(pattern), statistics.stdev(pattern)
    return seeds(*[base] * n), seeds(*[base + d + spread * (x - mean) / sd for x in pattern])


@pytest.mark.parametrize("d, spread, kind, label", [
    # six seeds: margin = 1 % of |mean(B)| ~ 0.02; half-width = 2.571 x spread / sqrt(6) ~ 1.05 x spread
    (0.05, 0.005, "better", REPRODUCED),         # interval above 0, estimate beyond the margin
    (0.021, 0.015, "better", REPRODUCED),        # lower end above 0 (~0.005) and d >= margin
    (0.03, 0.04, "better", INCONCLUSIVE),        # d beyond the margin but the interval holds 0
    (0.01, 0.004, "better", SMALLER),            # interval [~0.006, ~0.014]: above 0, below margin
    (0.015, 0.008, "better", INCONCLUSIVE),      # above 0 but reaching the margin: size undecided
    (0.002, 0.01, "better", NO_EFFECT),          # around 0, inside +-margin
    (0.0, 0.01, "better", NO_EFFECT),
    (0.0, 0.03, "better", INCONCLUSIVE),         # around 0 but reaching past the margin
    (-0.01, 0.004, "better", NOT_REPRODUCED),    # a resolved reversal of half the margin
    (-0.002, 0.0005, "better", NOT_REPRODUCED),  # ... whatever its size
    (-0.3, 0.01, "better", NOT_REPRODUCED),
    (-0.01, 0.004, "degrades", SMALLER),         # A > B: the same with -d
    (0.01, 0.004, "degrades", NOT_REPRODUCED),
])
def test_each_label_is_what_the_interval_says(d, spread, kind, label):
    a, b = _shifted(d, spread)
    v = decide(a, b, kind, paired=True)
    e = v.d if kind == "better" else -v.d
    lo, hi = e - v.noise, e + v.noise
    assert v.verdict == label, (v, lo, hi, v.margin)
    if label == REPRODUCED:
        assert lo > 0 and e >= v.margin
    elif label == NOT_REPRODUCED:
        assert hi < 0
    elif label == SMALLER:
        assert lo > 0 and hi < v.margin
    elif label == NO_EFFECT:
        assert -v.margin < lo <= 0 <= hi < v.margin


def test_a_resolved_reversal_is_never_smaller_than_claimed():
    # the audit's case: a true reversal of half the margin at 6-8 seeds, drawn many times: the
    # rule says "not reproduced" whenever the interval lies below 0, and never "smaller"
    import random

    rng = random.Random(0)
    labels = []
    for _ in range(300):
        n = rng.choice([6, 7, 8])
        v = decide(seeds(*[2.0] * n), seeds(*[1.99 + rng.gauss(0, 0.008) for _ in range(n)]),
                   "better", paired=True)
        labels.append(v.verdict)
        assert v.verdict == NOT_REPRODUCED or v.interval[1] >= 0
        assert v.verdict not in (SMALLER, REPRODUCED)
    assert labels.count(NOT_REPRODUCED) > 0.7 * len(labels)


def test_a_collapse_claim_is_refuted_by_an_opposite_effect_of_any_size():
    # "degrades by 10 %" against a resolved small improvement: not reproduced, not "smaller"
    fall = decide(seeds(2.40, 2.41, 2.40, 2.41, 2.40, 2.41), seeds(2.42, 2.43, 2.425, 2.43, 2.42, 2.43),
                  "degrades", paired=True, margin=0.1)
    assert fall.interval[0] > 0 and fall.verdict == NOT_REPRODUCED  # d > 0: A lower, not higher
    big = decide(seeds(2.777, 2.845, 2.80, 2.79), seeds(2.870, 2.925, 2.90, 2.88), "degrades",
                 paired=True, margin=0.1)
    assert big.verdict == NOT_REPRODUCED


def test_p_values_and_holm():
    # p of d = 0 matches the t table: t = 2.571 with 5 dof is p = 0.05
    assert p_value(2.5706, 1.0, 5) == pytest.approx(0.05, abs=1e-4)
    assert p_value(0.0, 1.0, 5) == pytest.approx(1.0) and math.isnan(p_value(1.0, NAN, 3))
    assert p_value(1.0, 0.0, 3) == 0.0
    # Holm: sorted ascending, the k-th smallest (0-based) x (m - k), running maximum, capped at 1
    assert holm([0.01, 0.04, 0.03, NAN]) == pytest.approx([0.03, 0.06, 0.06, NAN], nan_ok=True)
    assert holm([0.5, 0.6]) == [1.0, 1.0]
    a, b = _shifted(0.05, 0.005)
    v = decide(a, b, "better", paired=True)
    assert v.p == pytest.approx(p_value(v.d, v.se, 5)) and v.p < 1e-4 and v.dof == 5


def test_the_evaluation_windows_add_their_noise():
    a, b = _shifted(0.01, 0.004)
    seeds_only = decide(a, b, "better", paired=True)
    both = decide(a, b, "better", paired=True, eval_se=0.01)
    assert both.se == pytest.approx(math.hypot(seeds_only.se, 0.01))
    assert both.noise > seeds_only.noise and both.eval_se == 0.01
    assert seeds_only.verdict == SMALLER and both.verdict == INCONCLUSIVE
    # window_se: per window the seeds' mean difference B - A, its sd over windows / sqrt(W)
    w = {("a", 0, "loss"): [1.0, 2.0, 3.0], ("a", 1, "loss"): [1.0, 2.0, 3.0],
         ("b", 0, "loss"): [1.1, 2.3, 3.2], ("b", 1, "loss"): [1.3, 2.3, 3.0]}
    assert window_se(w, ("a", "loss"), ("b", "loss"), [0, 1]) == pytest.approx(
        statistics.stdev([0.2, 0.3, 0.1]) / math.sqrt(3))
    assert window_se(w, ("a", "loss"), ("b", "loss"), [0, 1, 2]) is None  # seed 2 not recorded


def test_every_claim_of_a_record_is_judged_on_the_same_seeds():
    # seeds 4, 5 added to a and b only (to settle their claim): left out of every verdict
    table = [*[("a", s, {"loss": 1.0 + 0.001 * s}) for s in range(6)],
             *[("b", s, {"loss": 1.02 + 0.0012 * s}) for s in range(6)],
             *[("c", s, {"loss": 3.0}) for s in range(4)]]
    rows = rows_of(table)
    claims = [Claim("a < b", "p", ("a", "loss"), ("b", "loss"), source=SRC),
              Claim("a < c", "p", ("a", "loss"), ("c", "loss"), source=SRC)]
    assert judged_seeds(rows, claims) == [0, 1, 2, 3]
    (_, v), (_, w) = judge(rows, claims)
    assert v.n_a == v.n_b == 4 and sorted(v.diffs) == [0, 1, 2, 3] and w.n_a == 4
    assert v.verdict == INCONCLUSIVE and "needs 6 seeds" in v.reason
    # alone, the claim has its six seeds
    (_, alone), = judge(rows, claims[:1])
    assert alone.n_a == 6 and alone.verdict == REPRODUCED
    # Holm over the measured claims
    assert [v.p_holm, w.p_holm] == pytest.approx(holm([v.p, w.p]))


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
    assert w.verdict == NOT_MEASURED and "did not train: stuck seed 2" in w.reason
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
