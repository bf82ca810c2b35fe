"""``fastweights bench fwp-forms``: with ``--autocast-bf16`` the float32 and CPU
bfloat16 product rows side by side, with the CPU's capabilities in the header; with
``--profile`` the per-form table of operators."""

from __future__ import annotations

import os
import re

import pytest
import torch

from fastweights.bench.fwp_forms import profile_table
from fastweights.cli import main
from fastweights.ops._autocast import CPU_BF16_ENV


def forms(argv: list[str]) -> None:
    assert main(["bench", "fwp-forms", *argv]) == 0


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
def test_autocast_bf16_rows_next_to_float32(capsys, monkeypatch, backward):
    monkeypatch.setenv(CPU_BF16_ENV, "off")  # the bench forces "on" for its rows, then restores
    forms(["--T", "20", "--H", "1", "--D", "4", "--repeats", "2", "--chunk-sizes", "8",
           "--modes", "chunk,recurrent", "--autocast-bf16"] + (["--backward"] if backward else []))
    lines = capsys.readouterr().out.splitlines()
    assert os.environ[CPU_BF16_ENV] == "off"
    header = lines[1]
    assert f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}" in header
    assert "fast bfloat16 (AMX-BF16/AVX512-BF16): " in header and "bfloat16 matmul" in header
    rows = {line.split("  ")[0].strip(): line for line in lines[2:]}
    for op in ("linear_attn", "delta_rule"):
        assert f"{op}[chunk C=8]" in rows and f"{op}[recurrent]" in rows
        bf16 = rows[f"{op}[chunk C=8] autocast-bf16"]
        assert " ms " in bf16
        if not backward:  # the product path ran: close to float32, not equal to it
            err = float(bf16.rsplit("= ", 1)[1])
            assert 0 < err < 0.05
    assert f"{'linear_attn'}[recurrent] autocast-bf16" not in rows  # chunked forms only


ROW = re.compile(r"^  (\S.*?)\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d)%$")


def _rows(table: str) -> list[tuple[str, int, float, float]]:
    return [(m[1], int(m[2]), float(m[3]), float(m[4]))
            for m in (ROW.match(line) for line in table.splitlines()) if m]


def test_profile_table_lists_the_operators_by_self_time():
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    table = profile_table(lambda: (a @ b).relu_().sum(), repeats=3, top=2)
    lines = table.splitlines()
    assert lines[0].split() == ["operator", "calls", "self", "ms", "share"]
    rows = _rows(table)
    listed, rest, total = rows[:2], rows[2], rows[3]
    assert [r[2] for r in listed] == sorted((r[2] for r in listed), reverse=True)
    assert rest[0].endswith("other operators)") and total[0] == "all operators (self CPU)"
    assert total[3] == 100.0
    assert abs(sum(r[3] for r in rows[:3]) - 100.0) < 0.5  # shares of one call's total
    assert abs(sum(r[2] for r in rows[:3]) - total[2]) < 0.03  # each rounded to 0.01
    assert total[1] == sum(r[1] for r in rows[:3])  # operator calls per call
    names = {r[0] for r in rows}
    assert "aten::mm" in names or "aten::relu_" in names or "aten::sum" in names
    assert re.fullmatch(r"  profiled wall time \d+\.\d\d ms per call, \d+\.\d\d ms of it "
                        r"outside the operators", lines[-1])


def test_fwp_forms_profile_prints_a_table_under_each_form(capsys):
    forms(["--T", "24", "--H", "2", "--D", "4", "--repeats", "1", "--chunk-sizes", "8",
          "--modes", "chunk", "--profile", "--profile-top", "3"])
    out = capsys.readouterr().out.splitlines()
    for op in ("delta_rule", "linear_attn"):
        at = next(i for i, line in enumerate(out) if line.startswith(f"{op}[chunk C=8]"))
        table = out[at + 1:at + 8]
        assert table[0].split()[0] == "operator"
        assert len(_rows("\n".join(table))) == 5  # 3 operators, the rest, the total
        assert table[-1].startswith("  profiled wall time")


@pytest.mark.parametrize("flag", ["--profile-top", "--repeats"])
def test_fwp_forms_rejects_non_positive_counts(flag, capsys):
    assert main(["bench", "fwp-forms", "--T", "8", flag, "0"]) == 2
    assert flag in capsys.readouterr().err
