"""``graph_capture.captured``: a failed capture is logged with what runs eagerly."""

from __future__ import annotations

import logging

from pagedserve.engine.graph_capture import captured


def test_a_failed_capture_logs_its_reason_and_reports_false(caplog) -> None:
    def fail() -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    with caplog.at_level(logging.WARNING, logger="pagedserve.engine.graph_capture"):
        assert not captured(fail, "verify CUDA graph capture failed, verify steps run eagerly")
    assert ("verify CUDA graph capture failed, verify steps run eagerly: operation not "
            "permitted when stream is capturing") in caplog.text


def test_a_capture_that_runs_reports_true() -> None:
    ran = []
    assert captured(lambda: ran.append(1), "unused")
    assert ran == [1]
