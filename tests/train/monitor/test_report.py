"""The run's lines on a terminal: a status line (the progress bar) rewritten in place, replaced by the next line
of the run; in a log file or a pipe, no status line at all."""

from __future__ import annotations

import io

from train.monitor import report


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_status_line_is_rewritten_in_place_and_cleared_before_the_next_line(monkeypatch):
    screen = Terminal()
    monkeypatch.setattr("sys.stdout", screen)
    report.status("step 2/9 [##......]")
    report.status("step 3/9 [###.....]")
    report.say("step 4/9 | loss 7.1")
    report.status("step 5/9 [#####...]", speaks=False)  # another rank: nothing
    assert screen.getvalue() == ("\rstep 2/9 [##......]\033[K\rstep 3/9 [###.....]\033[K"
                                 "\r\033[Kstep 4/9 | loss 7.1\n")


def test_a_log_file_gets_no_status_line(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr("sys.stdout", log)
    report.status("step 2/9 [##......]")
    report.say("step 3/9 | loss 7.1")
    assert log.getvalue() == "step 3/9 | loss 7.1\n"
