"""Progress lines say what they measure: s/step and tok/s over the steps a line names (the steps since the previous
line), target tokens counted; the warm-up steps each on a line of their own; a resume names where it resumed and
starts its windows there; ``q38 --help`` keeps each command's whole first sentence."""

import re

import pytest

from q38.train.run.metrics import PROGRESS_LEGEND, Throughput
from q38.train.run.trainer import train
from tests.run_utils import metrics, run_config

WINDOW = re.compile(r"\| (?:step (\d+)|steps (\d+)-(\d+)): ([\d.]+) s/step, tok/s ([\d,]+)")


def _lines(printed: str) -> dict[int, str]:
    return {int(m.group(1)): ln for ln in printed.splitlines() if (m := re.match(r"step (\d+) \|", ln))}


def _check_windows(lines: dict[int, str], recs: dict[int, dict], warm: set[int]) -> list[int]:
    """Each line's figures against the records' own step times and target tokens; the steps covered, in order."""
    covered = []
    for step, ln in sorted(lines.items()):
        if step in warm:
            assert f"{recs[step]['step_time']:.2f} s/step warm-up" in ln, ln
            assert "tok/s" not in ln, ln
            covered.append(step)
            continue
        m = WINDOW.search(ln)
        assert m, ln
        lo, hi = (int(m.group(1)),) * 2 if m.group(1) else (int(m.group(2)), int(m.group(3)))
        assert hi == step, ln
        span = range(lo, hi + 1)
        secs = sum(recs[s]["step_time"] for s in span)
        toks = sum(recs[s]["tokens"] for s in span)  # target tokens: the labels the loss counts
        assert float(m.group(4)) == pytest.approx(secs / len(span), abs=0.006), ln
        assert int(m.group(5).replace(",", "")) == pytest.approx(toks / secs, abs=0.51), ln
        covered += list(span)
    return covered


def test_throughput_window_is_the_steps_since_the_last_line():
    t = Throughput(warmup=1, flops_per_token=2.0, peak_flops=100.0, devices=1)
    t.update(1, 999, 9.0)  # warm-up: left out
    assert t.warming and t.tokens_per_s is None and t.seconds_per_step is None
    for step, (tok, sec) in enumerate([(10, 1.0), (30, 3.0), (0, 0.0), (60, 2.0)], start=2):
        t.update(step, tok, sec)
    assert not t.warming and (t.first, t.last) == (2, 5) and t.steps == 3  # the zero-time step is not counted
    assert t.tokens_per_s == 100 / 6 and t.seconds_per_step == 2.0 and t.mfu == pytest.approx(100 / 6 * 2 / 100)
    t.reset()
    t.update(6, 5, 0.5)
    assert (t.first, t.last, t.tokens_per_s) == (6, 6, 10.0)


def test_a_run_logs_its_warmup_steps_and_windows_then_a_resume_starts_its_own(tmp_path, capsys):
    out = tmp_path / "run"
    first = train(run_config(out, steps=7, run={"log_every": 3, "warmup_log_steps": 2}))
    printed = capsys.readouterr().out
    assert PROGRESS_LEGEND in printed and "target tokens" in PROGRESS_LEGEND
    recs = {r["step"]: r for r in first}
    lines = _lines(printed)
    assert sorted(lines) == [1, 2, 3, 6, 7]
    assert _check_windows(lines, recs, warm={1, 2}) == list(range(1, 8))  # every step's time on some line
    assert recs[1]["tokens_per_s"] is None and recs[3]["tokens_per_s"] == pytest.approx(
        recs[3]["tokens"] / recs[3]["step_time"])  # metrics.jsonl: each step's own

    again = train(run_config(out, steps=12, run={"log_every": 3, "warmup_log_steps": 2}))
    printed = capsys.readouterr().out
    assert re.search(r"resumed from \S+step_000007 \(step 7\); training steps 8-12", printed), printed
    recs = {r["step"]: r for r in again}
    lines = _lines(printed)
    assert sorted(lines) == [8, 9, 12]  # the resumed process's own warm-up, then steps 10-12
    assert _check_windows(lines, recs, warm={8, 9}) == list(range(8, 13))
    assert [r["step"] for r in metrics(out)] == list(range(1, 13))


def test_top_level_help_keeps_the_whole_first_sentence(capsys):
    from q38.cli import first_sentence, main

    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "torchrun for q38 commands, e.g. q38 launch --standalone --nproc-per-node 2 train CONFIG." in text
    assert first_sentence("Does X, e.g. a b. Then Y.") == "Does X, e.g. a b."
    assert first_sentence("Reads `x` (i.e. y). Writes z") == "Reads `x` (i.e. y)."
    assert first_sentence("One line") == "One line."
