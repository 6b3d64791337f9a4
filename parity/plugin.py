"""pytest plugin: the ``--parity-*`` options, level selection, the op -> block -> model funnel.

With ``--parity-level=L`` only parity items run: tests marked ``@pytest.mark.parity(level=...)`` at
level L or below, ordered op -> block -> model. A level whose lower level failed is skipped with a
reason naming the first failure below it (``--parity-no-funnel`` runs them all regardless). Each run
writes ``summary.md`` and ``results.json`` under ``--parity-report`` (default ``reports/<run-id>/``).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest

LEVELS = ("op", "block", "model")


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("parity", "layer-by-layer parity of a quantized model: reference vs vLLM")
    g.addoption("--parity-level", choices=LEVELS, default=None,
                help="run only parity items, every level up to this one (op -> block -> model)")
    g.addoption("--parity-no-funnel", action="store_true",
                help="run every level even when a lower level failed")
    g.addoption("--parity-model", default=None, metavar="DIR",
                help="checkpoint directory of shared FORMATS.md (default: the embedded default model)")
    g.addoption("--parity-format", default=None, help="override the checkpoint's quantization format")
    g.addoption("--parity-mode", choices=("propagated", "isolated"), default="propagated",
                help="propagated: both sides run free; isolated: each layer gets the reference's input")
    g.addoption("--parity-prompts", default=None, metavar="FILE",
                help="JSON array of token-id arrays (default fixtures/prompts/default.json)")
    g.addoption("--parity-taps", default=None, metavar="GLOB", help="compare only taps matching GLOB")
    g.addoption("--parity-against", choices=("live", "golden"), default="live",
                help="compare with the live fp32 reference or with stored golden dumps")
    g.addoption("--parity-tolerances", default=None, metavar="FILE", help="TOML file of per-tap tolerances")
    g.addoption("--parity-snapshot-dir", default=".parity/snapshots", metavar="DIR",
                help="where failing taps are kept (default .parity/snapshots)")
    g.addoption("--parity-report", default=None, metavar="DIR", help="report directory (default reports/<run-id>)")
    g.addoption("--parity-keep", type=int, default=20, metavar="N", help="keep the newest N snapshot runs")
    g.addoption("--parity-snapshot-max-gb", type=float, default=2.0, metavar="GB",
                help="keep snapshots under this many GB")
    g.addoption("--parity-pdb", action="store_true", help="stop at the first divergence with both tensors loaded")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "parity(level): a parity item at level op, block or model")
    config._parity = _ParityRun(config) if config.getoption("--parity-level") else None


def _level_of(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("parity")
    if marker is None:
        return None
    level = marker.kwargs.get("level", marker.args[0] if marker.args else None)
    if level not in LEVELS:
        raise pytest.UsageError(f"{item.nodeid}: parity marker level {level!r} is not one of {LEVELS}")
    return level


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run: _ParityRun | None = config._parity
    if run is None:
        return
    top = LEVELS.index(config.getoption("--parity-level"))
    keep, drop = [], []
    for item in items:
        level = _level_of(item)
        (keep if level is not None and LEVELS.index(level) <= top else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    keep.sort(key=lambda it: LEVELS.index(_level_of(it)))  # stable: file order within a level
    items[:] = keep


def pytest_runtest_setup(item: pytest.Item) -> None:
    run: _ParityRun | None = item.config._parity
    if run is None or item.config.getoption("--parity-no-funnel"):
        return
    level = _level_of(item)
    below = [f for f in run.failures if LEVELS.index(f[1]) < LEVELS.index(level)]
    if below:
        nodeid, lvl = below[0]
        pytest.skip(f"funnel: level {lvl!r} failed first at {nodeid}; no {level}-level comparison "
                    f"before the levels below agree")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = yield
    run: _ParityRun | None = item.config._parity
    if run is not None and (report.when == "call" or report.failed or report.skipped):
        run.record(item, report)
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    run: _ParityRun | None = session.config._parity
    if run is not None:
        run.write()


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    run: _ParityRun | None = config._parity
    if run is None:
        return
    terminalreporter.section("parity")
    if run.failures:
        nodeid, level = run.failures[0]
        terminalreporter.write_line(f"first divergence: {nodeid} (level {level})")
    else:
        terminalreporter.write_line(f"no divergence up to level {config.getoption('--parity-level')!r}")
    if run.report_dir is not None:
        terminalreporter.write_line(f"report: {run.report_dir}")


class _ParityRun:
    """Outcomes of the parity items of one session, in run order."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self.started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.results: dict[str, dict] = {}
        self.failures: list[tuple[str, str]] = []
        self.report_dir: Path | None = None

    def record(self, item: pytest.Item, report: pytest.TestReport) -> None:
        level = _level_of(item)
        outcome = "skipped" if report.skipped else report.outcome
        entry = self.results.setdefault(item.nodeid, {"level": level, "outcome": outcome, "duration_s": 0.0})
        entry["duration_s"] += report.duration
        if report.failed:
            entry["outcome"] = "failed"
            entry["message"] = str(report.longrepr)[-2000:]
            if not any(n == item.nodeid for n, _ in self.failures):
                self.failures.append((item.nodeid, level))
        elif report.skipped and entry["outcome"] != "failed":
            entry["outcome"] = "skipped"
            entry["message"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""

    def write(self) -> None:
        opt = self.config.getoption
        root = Path(opt("--parity-report") or Path(self.config.rootpath) / "reports" / self.id)
        root.mkdir(parents=True, exist_ok=True)
        data = {
            "run": {"id": self.id, "started": self.started, "level": opt("--parity-level"),
                    "model": opt("--parity-model") or "embedded-default", "mode": opt("--parity-mode")},
            "items": self.results,
            "first_failure": ({"nodeid": self.failures[0][0], "level": self.failures[0][1]}
                              if self.failures else None),
            "passed": not self.failures,
        }
        tmp = root / f".results.json.{os.getpid()}"
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, root / "results.json")
        lines = [f"# parity run {self.id}", "", f"level: {data['run']['level']} · model: {data['run']['model']}",
                 "", "| level | item | outcome | seconds |", "| --- | --- | --- | --- |"]
        for nodeid, r in self.results.items():
            lines.append(f"| {r['level']} | `{nodeid}` | {r['outcome']} | {r['duration_s']:.2f} |")
        if self.failures:
            lines += ["", f"First failure: `{self.failures[0][0]}` ({self.failures[0][1]})"]
        (root / "summary.md").write_text("\n".join(lines) + "\n")
        self.report_dir = root
