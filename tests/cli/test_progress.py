"""The progress printer on a terminal: one bar per stream of counted messages, closed when all finish."""

from __future__ import annotations

import io

from rich.console import Console

import tsrl_cli.console as tc


def _printer(monkeypatch) -> tuple[tc._BarPrinter, io.StringIO]:
    buf = io.StringIO()
    monkeypatch.setattr(tc, "err_console", Console(file=buf, force_terminal=True, width=120))
    return tc._BarPrinter(), buf


def test_a_changing_tail_updates_its_bar(monkeypatch):
    p, _ = _printer(monkeypatch)
    for i in range(1, 4):  # what follows the count changes with every message
        p(f"student sft: step {i}/5, loss {1 / i:.3f}")
        p(f"pulled {i}/3 images: registry.local/img{i}:latest ({i * 7} s)")
    assert p._progress is not None and len(p._tasks) == 2
    assert sorted(t.completed for t in p._progress.tasks) == [3, 3]
    (pulls,) = [t for t in p._progress.tasks if t.total == 3]
    assert pulls.finished and "img3" in pulls.description  # the newest message is shown
    for i in (4, 5):
        p(f"student sft: step {i}/5, loss {1 / i:.3f}")
    assert p._progress is None  # both streams finished: the bars are closed


def test_distinct_streams_get_distinct_bars(monkeypatch):
    # control: different text before the count, or a different word after it, is a different stream
    p, _ = _printer(monkeypatch)
    p("terminal: validated 1/4 tasks")
    p("repair: validated 1/4 tasks")
    p("evaluated 1/4 trajectories")
    p("evaluated 1/4 tasks")
    assert len(p._tasks) == 4
    p._progress.stop()


def test_a_message_without_a_count_is_a_line(monkeypatch):
    p, buf = _printer(monkeypatch)
    p("building images")
    assert p._progress is None and "building images" in buf.getvalue()
