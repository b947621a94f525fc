"""The ledger's event log is bounded: readers take a mark before a run and read what came after it; counts per kind
cover every event ever noted, the dropped ones too."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from vramgraph.graph.engine.ledger import Event, EventLog


def _ev(i: int, kind: str = "load") -> Event:
    return Event(kind, f"m{i}", "file", 0.0, i)


def test_since_a_mark_gives_exactly_the_events_after_it() -> None:
    log = EventLog(kept=8)
    for i in range(3):
        log.note(_ev(i))
    mark = log.mark()
    assert mark == 3 and log.since(mark) == []
    log.note(_ev(3, "unload"))
    log.note(_ev(4))
    assert [e.model for e in log.since(mark)] == ["m3", "m4"]
    assert [e.model for e in log.since(0)] == ["m0", "m1", "m2", "m3", "m4"]
    assert log.count("load") == 4 and log.count("unload") == 1 and log.count("pin") == 0


def test_the_log_keeps_only_the_last_events_and_says_when_a_reader_lost_some(caplog: pytest.LogCaptureFixture) -> None:
    log = EventLog(kept=4)
    for i in range(10):
        log.note(_ev(i, "load" if i % 2 else "unload"))
    assert len(log) == 4 and [e.model for e in log] == ["m6", "m7", "m8", "m9"]
    assert log.mark() == 10 and log.count("load") == 5 and log.count("unload") == 5
    assert [e.model for e in log.since(8)] == ["m8", "m9"]
    with caplog.at_level(logging.WARNING, logger="vramgraph.ledger"):
        assert [e.model for e in log.since(2)] == ["m6", "m7", "m8", "m9"]
    assert "8 ledger events since mark 2, only the last 4 kept" in caplog.text
    with pytest.raises(ValueError, match="mark 11 is after the 10 events noted"):
        log.since(11)


def test_a_session_reports_the_moves_of_each_image_only(tiny_models: Path, tmp_path: Path) -> None:
    """cli/session.py reads the ledger by mark: the first image loads the three models, the second moves none."""
    from vramgraph.api.pipeline import Pipeline
    from vramgraph.cli.session import Session

    pipe = Pipeline(tiny_models, input=tmp_path / "input", output=tmp_path / "output")
    session = Session(pipe, width=64, height=64, steps=2, save_dir=tmp_path / "saved")
    said: list[str] = []
    session.handle("a red fox", said.append)
    session.handle("a red fox", said.append)
    first, second = said
    assert first.endswith("loaded text encoder, transformer, vae"), first
    assert second.endswith("no model moved"), second
