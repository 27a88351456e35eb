"""The progress bar draws only on a terminal, only after the delay, and ends its line."""

from __future__ import annotations

import io

from trainmem.report.progress import Progress, progress


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_silent_when_not_a_terminal_or_quick():
    out = io.StringIO()
    assert list(progress(range(3), "x", stream=out)) == [0, 1, 2]
    assert out.getvalue() == ""
    tty, clock = Tty(), Clock()
    with Progress("quick", 3, stream=tty, clock=clock) as bar:
        bar.advance()  # t = 0: under the one-second delay
    assert tty.getvalue() == ""


def test_draws_after_the_delay_and_ends_the_line():
    tty, clock = Tty(), Clock()
    with Progress("sweep", 4, stream=tty, clock=clock) as bar:
        clock.t = 1.5
        bar.advance(note="seq=1024")
        clock.t = 1.55
        bar.advance()  # throttled: under 0.1 s since the last draw
        clock.t = 2.0
        bar.advance(2)
    text = tty.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n")
    assert "sweep [#######.......................]  25% 1/4 seq=1024" in text
    assert "100% 4/4" in text


def test_tracer_callback_signature():
    tty, clock = Tty(), Clock()
    bar = Progress("tracing", stream=tty, clock=clock, delay=0)
    bar(0.5, "backward")
    bar.close()
    assert "tracing [###############...............]  50% backward" in tty.getvalue()
