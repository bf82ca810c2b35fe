"""Mutation check: plant small, realistic bugs in the library one at a time and record which the
tests catch (docs/benchmarks.md, "Mutation check").

Not part of the test suite (pytest collects ``tests/`` only). Run it from the repository root,
on a clean tree for the files it mutates:

    OMP_NUM_THREADS=1 python tools/mutation_check.py           # every mutation, nearest tests
    python tools/mutation_check.py --only infini-rows-delta-update trainer-since-best-restarts
    python tools/mutation_check.py --full                      # the README's whole test command
    python tools/mutation_check.py --list                      # the mutations, nothing run
    python tools/mutation_check.py --check                     # every planted text still found once

Each mutation replaces one exact text of one source file; the text must occur exactly once (a
mutation whose text moved or was duplicated is an error, so the list cannot rot silently). The
targeted mode runs, for each mutation, the test files (or test ids) nearest to the code it
touches (``tests`` below), with ``-x``; ``--full`` runs the README's test command
(``python -m pytest -q -n auto --dist loadfile``) instead, which takes the whole suite's time
per mutation. The file is always put back (``finally``, also on Ctrl-C or SIGTERM) and checked
byte for byte. A caught mutation's first failing test is then run once more on the restored
tree: it must pass there, or the result is marked invalid (a test that fails anyway catches
nothing). The record (``--out``, default ``benchmarks/results/mutation/``) is ``<mode>.md`` and
``<mode>.csv``: per mutation caught / survived / invalid, the catching test and the seconds
taken; a survivor's row carries the reason it may stand, when the list gives one.

Tests run with ``PYTHONPATH=src`` (this checkout's code) and ``OMP_NUM_THREADS=1`` unless set.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = "src/fastweights/"
FULL_COMMAND = "python -m pytest -q -n auto --dist loadfile"  # README.md, "Quick start"


@dataclass(frozen=True)
class Mutation:
    """One planted bug: ``old`` (found exactly once in ``path``) becomes ``new``."""

    id: str
    area: str  # ops, layers, parallel, train
    path: str  # below src/fastweights/
    old: str
    new: str
    bug: str  # what the substitution models
    tests: tuple[str, ...]  # the nearest test files or ids (targeted mode)
    stands: str = ""  # why a survivor may stand (only read when it survives)


MUTATIONS: tuple[Mutation, ...] = (
    # --- the three survivors of issue 45 ---
    Mutation("infini-rows-delta-update", "ops", "ops/infini/recurrent.py",
             "M[rows], z[rows], update, eps)", 'M[rows], z[rows], "linear", eps)',
             "stacked Infini decoding (InfiniRowsState) writes a closed segment with the linear "
             "update under update=\"delta\"",
             ("tests/models/test_multistream.py", "tests/ops/test_infini.py")),
    Mutation("ttt-mlp-traced-carry-sign", "ops", "ops/ttt/chunk.py",
             "Zbar1 = Zbar1 - tau_rows * (Qa[:, :, 0] @ prior1)",
             "Zbar1 = Zbar1 + tau_rows * (Qa[:, :, 0] @ prior1)",
             "the traced TTT-MLP dual form (torch.compile's) flips the sign of the correction "
             "from gradient sums carried in mid-mini-batch",
             ("tests/ops/test_ttt.py",
              "tests/ops/test_compile.py::test_ttt_compiled_from_a_mid_minibatch_carry_equals_naive")),
    Mutation("trainer-since-best-restarts", "train", "train/trainer.py",
             'state["best_val_loss"],\n                                                 state["since_best"])',
             'state["best_val_loss"],\n                                                 0)',
             "on resume the early-stopping count restarts at 0",
             ("tests/train/test_trainer.py",)),
    # --- ops ---
    Mutation("ttt-linear-autograd-carry-sign", "ops", "ops/ttt/chunk.py",
             "Zq = Zq - tau_rows * (Qa[:, :, 0] @ prior)", "Zq = Zq + tau_rows * (Qa[:, :, 0] @ prior)",
             "TTT-Linear's autograd dual form (also what torch.compile traces) flips the sign of "
             "the carried-sums correction",
             ("tests/ops/test_ttt.py",)),
    Mutation("ttt-inference-carry-sign", "ops", "ops/ttt/chunk.py",
             "o.sub_(tau_r * (Qa[0] @ P))", "o.add_(tau_r * (Qa[0] @ P))",
             "TTT-Linear's no-grad dual form flips the sign of the carried-sums correction",
             ("tests/ops/test_ttt.py",)),
    Mutation("ttt-step-sizes-skip-diagonal", "ops", "ops/ttt/chunk.py",
             "E = (per_head(tau.unsqueeze(-1), eta_mb.unsqueeze(-1)) * eta_mb.unsqueeze(-2)).tril()",
             "E = (per_head(tau.unsqueeze(-1), eta_mb.unsqueeze(-1)) * eta_mb.unsqueeze(-2)).tril(-1)",
             "the dual form's step-size matrix E (autograd and traced forms) leaves out each "
             "token's own gradient",
             ("tests/ops/test_ttt.py",)),
    Mutation("ttt-mlp-double-backward-total-derivatives", "ops", "ops/ttt/mlp_scan.py",
             "alias = [None if t is None else t.view_as(t) for t in inputs]",
             "alias = list(inputs)",
             "TTT-MLP's double backward differentiates w.r.t. its inputs themselves, which depend "
             "on one another (E on eta, the target on the keys): first derivatives under "
             "create_graph count those paths twice (a real bug, fixed with issue 45)",
             ("tests/ops/test_ttt_mlp_backward.py", "tests/ops/test_grad_paths.py")),
    Mutation("infini-retrieve-shifted-eps", "ops", "ops/infini/memory.py",
             "den = (sq @ z.unsqueeze(-1)).clamp_min(eps)", "den = (sq @ z.unsqueeze(-1)) + eps",
             "Infini's memory retrieval divides by sigma(q).z + eps instead of clamping at eps "
             "(a helper shared by the oracle and the fast forms)",
             ("tests/ops/test_infini.py",)),
    Mutation("dpfp-roll-direction", "ops", "ops/feature_maps.py",
             "torch.roll(r, shifts=j, dims=-1)", "torch.roll(r, shifts=-j, dims=-1)",
             "DPFP's products pair each entry with the next instead of the previous one (a "
             "feature map shared by every form)",
             ("tests/ops/test_feature_maps.py",)),
    Mutation("delta-rule-autograd-drops-state", "ops", "ops/delta_rule/chunk.py",
             "S, entering, Us = S0, [], []", "S, entering, Us = torch.zeros_like(S0), [], []",
             "the delta rule's chunked form, on its autograd / traced path, ignores the initial "
             "state",
             ("tests/ops/test_fwp.py", "tests/ops/test_grad_paths.py")),
    Mutation("chunk-scan-autograd-drops-first", "ops", "ops/_chunks.py",
             "entering = torch.cat([first.unsqueeze(2), per_chunk[:, :, :-1]], dim=2).cumsum(dim=2)",
             "entering = torch.cat([torch.zeros_like(first).unsqueeze(2), per_chunk[:, :, :-1]], "
             "dim=2).cumsum(dim=2)",
             "the chunk scan of the sum rule, on its autograd / traced path, ignores the initial "
             "state",
             ("tests/ops/test_fwp.py", "tests/ops/test_grad_paths.py")),
    Mutation("gated-delta-step-autograd-skips-decay", "ops", "ops/gated_delta_rule/recurrent.py",
             "Sd = torch.baddbmm(Sd, kr.transpose(1, 2), u)  # autograd",
             "Sd = torch.baddbmm(S.reshape(B * H, Dk, Dv), kr.transpose(1, 2), u)  # autograd",
             "Gated DeltaNet's one-token step, when it records gradients, adds the update to the "
             "undecayed state",
             ("tests/ops/test_gated_delta.py", "tests/ops/test_grad_paths.py")),
    Mutation("softmax-padding-mask-off-by-one", "ops", "ops/softmax/attention.py",
             "mask = keys >= (Tk - kv_lengths).view(-1, 1, 1, 1)",
             "mask = keys > (Tk - kv_lengths).view(-1, 1, 1, 1)",
             "softmax attention with kv_lengths masks one real key as padding",
             ("tests/ops/test_softmax.py", "tests/models/test_multistream.py")),
    Mutation("decay-recurrence-ignores-decay", "ops", "ops/transnormer/recurrent.py",
             "S = outer_add(S if lam is None else lam * S, k[:, t], v[:, t])",
             "S = outer_add(S, k[:, t], v[:, t])",
             "TransNormer's token-by-token form forgets the decay",
             ("tests/ops/test_transnormer.py",)),
    Mutation("aft-local-step-bias-misaligned", "ops", "ops/aft/recurrent.py",
             "band[t if band.shape[0] > 1 else 0][..., -J:]", "band[t if band.shape[0] > 1 else 0][..., :J]",
             "AFT-local's token-by-token form reads the window biases from the wrong end",
             ("tests/ops/test_aft.py",)),
    # --- layers ---
    Mutation("infini-layer-rope-not-periodic", "layers", "layers/infini.py",
             "pos = token_positions(bounds, starts, x.device) % self.segment_len",
             "pos = token_positions(bounds, starts, x.device)",
             "the Infini layer rotates by global instead of segment-local positions",
             ("tests/layers/test_infini_layers.py",)),
    Mutation("infini-stack-pads-right", "layers", "layers/infini.py",
             "F.pad(c, (0, 0, 0, 0, N - 1 - n, 0))", "F.pad(c, (0, 0, 0, 0, 0, N - 1 - n))",
             "stacking Infini states pads each open segment after its tokens instead of before",
             ("tests/models/test_multistream.py",)),
    Mutation("ttt-layer-traced-tau-unclamped", "layers", "layers/ttt.py",
             "return (self._inv_base() + self.token_offset).clamp_min(0.0)",
             "return self._inv_base() + self.token_offset",
             "the TTT layer's token scale, on its autograd / traced path, is not clamped at 0",
             ("tests/layers/test_ttt_layers.py",)),
    Mutation("rotary-traced-form-sign", "layers", "layers/positional.py",
             "torch.stack((even * c - odd * s, even * s + odd * c), -1)",
             "torch.stack((even * c - odd * s, even * s - odd * c), -1)",
             "the rotary rotation's traced form (torch.compile / torch.export) has a sign error",
             ("tests/models/test_export.py::test_step_export_matches_eager",
              "tests/layers/test_compile.py::test_compiled_delta_layer_matches_eager")),
    Mutation("fwp-context-parallel-strategy", "layers", "layers/fwp.py",
             'if self.update == "delta" and self.normalize.endswith("attention"):\n'
             "            return ContextParallel.relay()",
             'if self.update == "delta" and self.normalize == "attention":\n'
             "            return ContextParallel.relay()",
             "the delta rule with normalize=\"sum+attention\" takes the affine scan under context "
             "parallelism (its normaliser z is not affine in the incoming state)",
             ("tests/parallel/test_context_parallel.py",)),
    # --- parallel ---
    Mutation("cp-prefix-inclusive", "parallel", "parallel/mechanisms.py",
             "return sum(v * float(j < self.rank) for j, v in enumerate(values))",
             "return sum(v * float(j <= self.rank) for j, v in enumerate(values))",
             "the context-parallel prefix sums include the rank's own shard",
             ("tests/parallel/test_context_parallel.py",)),
    Mutation("cp-independent-state-everywhere", "parallel", "parallel/mechanisms.py",
             "return self.run(x, state0 if self.rank == 0 else None)",
             "return self.run(x, state0)",
             "independent shards all continue the carried state instead of rank 0 alone",
             ("tests/parallel/test_context_parallel.py",)),
    # --- train ---
    Mutation("trainer-best-restarts", "train", "train/trainer.py",
             'self.step, self.best, self.since_best = (state["step"], state["best_val_loss"],',
             'self.step, self.best, self.since_best = (state["step"], float("inf"),',
             "on resume the best validation loss restarts at infinity",
             ("tests/train/test_trainer.py",)),
    Mutation("trainer-torch-rng-not-restored", "train", "train/distributed.py",
             '    torch.set_rng_state(states["torch"])\n', "",
             "on resume torch's random generator (dropout, FAVOR+ redraws) is not restored",
             ("tests/train/test_trainer.py",)),
    Mutation("trainer-numpy-rng-not-restored", "train", "train/distributed.py",
             '    np.random.set_state(states["numpy"])\n', "",
             "on resume NumPy's random generator is not restored",
             ("tests/train/test_trainer.py",),
             stands="nothing in training draws from NumPy's (or Python's) generator: both are "
                    "seeded at the start of every session and saved for user code, so a resumed "
                    "run's state equals the uninterrupted run's with or without the restore; no "
                    "test can observe it"),
    Mutation("trainer-patience-off-by-one", "train", "train/trainer.py",
             "return self.cfg.patience > 0 and self.since_best >= self.cfg.patience",
             "return self.cfg.patience > 0 and self.since_best > self.cfg.patience",
             "early stopping waits one validation more than patience",
             ("tests/train/test_trainer.py",)),
    Mutation("trainer-scheduler-not-restored", "train", "train/trainer.py",
             '        self.sched.load_state_dict(saved["scheduler"])\n', "",
             "on resume the learning-rate schedule starts again from step 0",
             ("tests/train/test_trainer.py",)),
    Mutation("lr-warmup-off-by-one", "train", "train/config.py",
             "return (step + 1) / cfg.warmup", "return step / cfg.warmup",
             "the warm-up's first step has learning rate 0",
             ("tests/train/test_trainer.py",)),
    Mutation("grad-accum-unweighted", "train", "train/trainer.py",
             "part = part * (count / max(1, sum(counts)))", "part = part / len(batches)",
             "gradient accumulation weighs micro-batches equally, not by predicted tokens",
             ("tests/train/test_grad_accum.py",)),
    Mutation("carry-resume-stream-position", "train", "train/checkpoint.py",
             'return carry["position"], state_tree.map_tensors(',
             "return 0, state_tree.map_tensors(",
             "carry_state: a resumed run restarts its streams' position",
             ("tests/train/test_carry_state.py",)),
    Mutation("keep-last-off-by-one", "train", "train/checkpoint.py",
             "if intact == keep_last:", "if intact == keep_last + 1:",
             "keep_last K keeps K + 1 checkpoints",
             ("tests/train/test_signals.py::test_prune_keeps_the_newest_complete_checkpoints",
              "tests/train/test_signals.py::test_prune_never_deletes_latest_or_the_newest_intact_one")),
)


class _Terminated(Exception):
    """SIGTERM, raised so that the ``finally`` that restores a file runs."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


def check_mutations(mutations: tuple[Mutation, ...]) -> list[str]:
    """Problems with the list: unknown files, texts not found exactly once, duplicate ids."""
    problems, seen = [], set()
    for m in mutations:
        if m.id in seen:
            problems.append(f"{m.id}: duplicate id")
        seen.add(m.id)
        path = ROOT / SRC / m.path
        if not path.is_file():
            problems.append(f"{m.id}: no file {SRC}{m.path}")
            continue
        n = path.read_text().count(m.old)
        if n != 1:
            problems.append(f"{m.id}: the text to mutate occurs {n} times in {SRC}{m.path} "
                            "(must be once)")
        if m.old == m.new:
            problems.append(f"{m.id}: the mutation changes nothing")
    return problems


def dirty_files(paths: list[str]) -> list[str]:
    """Those of ``paths`` with uncommitted changes (git status)."""
    out = subprocess.run(["git", "status", "--porcelain", "--", *paths], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [line[3:] for line in out.splitlines() if line.strip()]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH"))
                                        if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def pytest_command(tests: tuple[str, ...], full: bool) -> list[str]:
    if full:
        return [sys.executable, "-m", "pytest", "-q", "-n", "auto", "--dist", "loadfile", "-rfE",
                "-p", "no:cacheprovider"]
    return [sys.executable, "-m", "pytest", "-q", "-n", "0", "-x", "-rfE", "-p",
            "no:cacheprovider", *tests]


FAILED = re.compile(r"^(FAILED|ERROR) (\S+)")


def run_tests(cmd: list[str], timeout: float) -> tuple[str, str, str]:
    """(outcome, first failing test or '', last output line): outcome "passed", "failed",
    "timeout" or "no tests" (pytest's exit code 5: the selection matched nothing)."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"(no result within {timeout:.0f} s)", ""
    lines = (proc.stdout + proc.stderr).splitlines()
    last = next((ln for ln in reversed(lines) if ln.strip()), "")
    if proc.returncode == 0:
        return "passed", "", last
    if proc.returncode == 5:
        return "no tests", "", last
    first = next((m.group(2) for ln in lines if (m := FAILED.match(ln))), "")
    return "failed", first or f"(exit {proc.returncode}: {last[:120]})", last


def plant_and_run(m: Mutation, full: bool, timeout: float) -> dict[str, str]:
    """Plant ``m``, run its tests, put the file back; then confirm the catching test passes on
    the restored tree. A row of the record."""
    path = ROOT / SRC / m.path
    original = path.read_bytes()
    text = original.decode()
    if text.count(m.old) != 1:
        raise SystemExit(f"{m.id}: the text to mutate is not found exactly once in {path}")
    start = time.perf_counter()
    try:
        path.write_text(text.replace(m.old, m.new, 1))
        outcome, catcher, last = run_tests(pytest_command(m.tests, full), timeout)
    finally:
        path.write_bytes(original)
    if path.read_bytes() != original:
        raise SystemExit(f"{path} could not be restored: check it with git diff")
    seconds = time.perf_counter() - start
    if outcome == "passed":
        result = "survived"
    elif outcome == "no tests":
        raise SystemExit(f"{m.id}: its tests {m.tests} select nothing ({last})")
    else:
        result = "caught"
        if "::" in catcher and not catcher.startswith("("):  # the catching test, unmutated
            again, _, last2 = run_tests(pytest_command((catcher,), False), timeout)
            if again != "passed":
                result, catcher = "invalid", f"{catcher} fails without the mutation ({last2})"
    return {"id": m.id, "area": m.area, "file": SRC + m.path, "bug": m.bug, "result": result,
            "caught_by": catcher if result != "survived" else "",
            "why_it_may_stand": m.stands if result == "survived" else "",
            "seconds": f"{seconds:.0f}",
            "tests": "whole suite" if full else " ".join(m.tests)}


def _machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                      if ln.startswith("Model name")), platform.processor())
    except OSError:
        model = platform.processor()
    return f"{model}, {os.cpu_count()} logical CPUs"


def write_record(rows: list[dict[str, str]], out: Path, mode: str, argv: list[str]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    fields = list(rows[0])
    with open(out / f"{mode}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    caught = sum(r["result"] == "caught" for r in rows)
    lines = [
        f"# Mutation check ({mode})", "",
        "Command: `" + " ".join([f"OMP_NUM_THREADS={_env()['OMP_NUM_THREADS']}", "python",
                                 "tools/mutation_check.py", *argv]) + "`",
        f"Commit: {commit} (the planted texts are in tools/mutation_check.py); "
        f"date: {datetime.date.today().isoformat()}; machine: {_machine()}; "
        f"torch {_torch_version()}.", "",
        f"{caught} of {len(rows)} planted bugs caught.", "",
        "| mutation | area | file | bug | result | caught by | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        by = f"`{r['caught_by']}`" if r["caught_by"] else ""
        if r["result"] == "survived":
            by = r["why_it_may_stand"] or "**no test catches it**"
        lines.append(f"| {r['id']} | {r['area']} | `{r['file']}` | {r['bug']} | {r['result']} | "
                     f"{by} | {r['seconds']} |")
    (out / f"{mode}.md").write_text("\n".join(lines) + "\n")
    return out / f"{mode}.md"


def _torch_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True, env=_env())
    return out.stdout.strip() or "?"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true",
                   help=f"run the README's whole test command ({FULL_COMMAND}) per mutation")
    p.add_argument("--only", nargs="+", metavar="ID", help="these mutations only")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--check", action="store_true",
                   help="check that every planted text is found exactly once, and exit")
    p.add_argument("--timeout", type=float, default=1200.0,
                   help="seconds per test run (a run past it counts as caught)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "mutation",
                   help="folder of the record")
    args = p.parse_args(argv)
    problems = check_mutations(MUTATIONS)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    if args.full and FULL_COMMAND not in (ROOT / "README.md").read_text():
        print(f"README.md no longer holds the test command {FULL_COMMAND!r}: update "
              "FULL_COMMAND and pytest_command", file=sys.stderr)
        return 2
    chosen = list(MUTATIONS)
    if args.only:
        unknown = sorted(set(args.only) - {m.id for m in MUTATIONS})
        if unknown:
            print(f"unknown mutation ids {unknown}; --list shows them", file=sys.stderr)
            return 2
        chosen = [m for m in MUTATIONS if m.id in args.only]
    if args.list or args.check:
        for m in chosen if args.list else []:
            print(f"{m.id:40s} {m.area:9s} {SRC}{m.path}: {m.bug}")
        if args.check:
            print(f"{len(MUTATIONS)} mutations, every planted text found exactly once")
        return 0
    dirty = dirty_files(sorted({SRC + m.path for m in chosen}))
    if dirty:
        print("refusing to start: uncommitted changes in files this check mutates: "
              + ", ".join(dirty), file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    rows = []
    for i, m in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {m.id} ...", end=" ", flush=True)
        row = plant_and_run(m, args.full, args.timeout)
        print(f"{row['result']} ({row['seconds']} s) {row['caught_by']}", flush=True)
        rows.append(row)
    mode = "full" if args.full else "targeted"
    record = write_record(rows, args.out, mode, argv)
    survived = [r["id"] for r in rows if r["result"] != "caught"]
    print(f"record: {record.relative_to(ROOT) if record.is_relative_to(ROOT) else record}; "
          f"not caught: {survived or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
