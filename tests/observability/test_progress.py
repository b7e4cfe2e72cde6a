"""Progress during rollout and eval, and the per-step line's step k/N, elapsed time and ETA."""

from __future__ import annotations

import io
import time

from slime_rl.observability import Progress, StepClock, format_duration, summary_line


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_format_duration():
    assert format_duration(4.25) == "4.2s" and format_duration(59.9) == "59.9s"
    assert format_duration(75) == "1m15s" and format_duration(3599.4) == "59m59s"
    assert format_duration(3725) == "1h02m"


def test_not_a_terminal_prints_a_line_every_interval_with_an_eta():
    out, clock = io.StringIO(), FakeClock()
    bar = Progress(100, "rollout 3/10", stream=out, interval_s=10.0, clock=clock)
    clock.t += 4
    bar.update(20)
    assert out.getvalue() == ""  # less than an interval: nothing yet
    clock.t += 6  # 10 s in, 40 of 100 done: 0.25 s each, 60 left -> 15 s
    bar.update(20)
    bar.note("4/10 groups kept")
    assert out.getvalue() == "rollout 3/10: 40/100 samples (40%) | 10.0s elapsed, ETA 15.0s\n"
    clock.t += 5
    bar.update(10)  # 5 s after the line: still quiet
    assert out.getvalue().count("\n") == 1
    clock.t += 5  # 20 s, 50 done -> 20 s left
    bar.update(0)
    assert out.getvalue().splitlines()[-1] == ("rollout 3/10: 50/100 samples (50%) | 20.0s elapsed, ETA 20.0s"
                                               " | 4/10 groups kept")
    bar.update(50)
    bar.close()  # it printed before: the closing line says it ended
    assert out.getvalue().splitlines()[-1].startswith("rollout 3/10: 100/100 samples (100%) | 20.0s elapsed, ETA -")


def test_a_short_run_prints_nothing_and_disabled_prints_nothing():
    out, clock = io.StringIO(), FakeClock()
    with Progress(8, "eval digits", stream=out, clock=clock) as bar:
        bar.update(8)
    assert out.getvalue() == ""
    quiet = Progress(8, "x", stream=out, interval_s=0.0, enabled=False, clock=clock)
    clock.t += 60
    quiet.update(8)
    quiet.close()
    assert out.getvalue() == ""


def test_add_total_grows_what_is_left():
    out, clock = io.StringIO(), FakeClock()
    bar = Progress(16, "rollout", stream=out, interval_s=1.0, clock=clock)
    bar.add_total(8)  # a filtered group of 8 must be replaced
    clock.t += 2
    bar.update(12)  # 12 of 24 in 2 s -> 2 s left
    assert out.getvalue() == "rollout: 12/24 samples (50%) | 2.0s elapsed, ETA 2.0s\n"


def test_a_terminal_gets_a_rewriting_bar():
    term = Terminal()
    bar = Progress(10, "rollout 1/5", stream=term)
    time.sleep(0.6)  # tqdm redraws at most every 0.5 s
    bar.update(3)
    bar.close()
    text = term.getvalue()
    assert "\r" in text and "rollout 1/5" in text and "3/10" in text
    assert "\n" not in text.rstrip("\n")  # redrawn in place, not one line per update


def test_step_clock_eta_is_the_mean_of_recent_steps_times_steps_left():
    clock = FakeClock()
    sc = StepClock(total_steps=10, window=3, clock=clock)
    clock.t += 5
    assert sc.step_done(0, 5.0) == {"elapsed_s": 5.0, "eta_s": 5.0 * 9}
    sc.step_done(1, 1.0)
    sc.step_done(2, 3.0)
    clock.t += 9
    # window 3: steps 1..3 -> (1 + 3 + 2) / 3 = 2 s, 6 steps left
    assert sc.step_done(3, 2.0) == {"elapsed_s": 14.0, "eta_s": 12.0}
    assert sc.step_done(9, 2.0)["eta_s"] == 0.0


def test_summary_line_counts_steps_from_one_of_n_and_ends_with_elapsed_and_eta():
    row = {"step": 6, "rollout/reward_mean": 0.5, "perf/step_s": 1.5}
    line = summary_line(row, 100, elapsed_s=75.0, eta_s=3725.0)
    assert line.startswith("step   7/100 | reward 0.500 |")
    assert line.endswith("| 1m15s elapsed, ETA 1h02m")
    assert summary_line(row).startswith("step    6 | reward 0.500")  # without the total: as before
