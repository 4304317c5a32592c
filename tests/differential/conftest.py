"""Prints the differential oracle's per-op table at the end of a run that computed it."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter) -> None:
    from tests.differential import oracle, report

    res = getattr(oracle, "LAST_RESULTS", None)
    if res:
        terminalreporter.section("differential oracle vs real ggml (7.0.0)")
        terminalreporter.write_line(report.table(res))
