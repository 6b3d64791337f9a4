"""pytest plugin: the ``--parity-*`` options, the per-tap items, the op -> block -> model funnel.

With ``--parity-level=L`` only parity items run: one built-in item per canonical tap up to level L
(``test_parity[block-layers.3.output]``), the model-level checks, and user tests marked
``@pytest.mark.parity(level=...)``, ordered op -> block -> model. A level whose lower level failed is
skipped with a reason naming the first failure below it (``--parity-no-funnel`` runs them all).
Without ``--parity-level`` pytest runs as usual.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parity.session import CANDIDATES, LEVELS, Options, ParitySession
from parity.taps import level_of

MODEL_CHECKS = ("greedy", "topk", "logprobs")


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("parity", "layer-by-layer parity of a quantized model: reference vs vLLM")
    g.addoption("--parity-level", choices=LEVELS, default=None,
                help="run only parity items, every level up to this one (op -> block -> model)")
    g.addoption("--parity-no-funnel", action="store_true",
                help="run every level even when a lower level failed")
    g.addoption("--parity-model", default=None, metavar="DIR",
                help="checkpoint directory of shared FORMATS.md (default: the embedded default model)")
    g.addoption("--parity-candidate", choices=CANDIDATES, default="vllm",
                help="vllm: the real engine with the plugin; kernels: the reference's modeling code with "
                     "the kernel linears (no vLLM needed)")
    g.addoption("--parity-mode", choices=("propagated", "isolated"), default="propagated",
                help="propagated: both sides run free from the same token ids; isolated: besides, every "
                     "candidate layer is fed the reference's input for it, and a tap fails on its own error")
    g.addoption("--parity-prompts", default=None, metavar="FILE",
                help="JSON array of token-id arrays (default fixtures/prompts/default.json)")
    g.addoption("--parity-taps", default=None, metavar="GLOB", help="compare only taps matching GLOB")
    g.addoption("--parity-tolerances", default=None, metavar="FILE", help="TOML file of per-tap tolerances")
    g.addoption("--parity-dump-dir", default=None, metavar="DIR",
                help="keep both sides' dumps in DIR/reference and DIR/candidate (default: a temporary dir)")
    g.addoption("--parity-snapshot-dir", default=".parity/snapshots", metavar="DIR",
                help="where failing taps are kept (default .parity/snapshots)")
    g.addoption("--parity-report", default=None, metavar="DIR", help="report directory (default reports/<run-id>)")
    g.addoption("--parity-keep", type=int, default=20, metavar="N", help="keep the newest N snapshot runs")
    g.addoption("--parity-snapshot-max-gb", type=float, default=2.0, metavar="GB",
                help="keep snapshots under this many GB")
    g.addoption("--parity-tp", type=int, default=1, metavar="N",
                help="tensor-parallel size of the vLLM candidate (ranks' taps are gathered)")
    g.addoption("--parity-against", choices=("live", "golden"), default="live",
                help="compare with the live fp32 reference, or with the golden dumps in references/golden/"
                     "<fixture>/ (the fp32 reference is never built; a missing golden is written and fails)")
    g.addoption("--parity-update-golden", action="store_true",
                help="regenerate the golden reference of the model from the live fp32 reference")
    g.addoption("--parity-trend", default=None, metavar="FILE",
                help="append the run's minimum passing tolerance per tap to FILE (JSON Lines; `parity trend`)")
    g.addoption("--parity-calibrate", default=None, metavar="FILE",
                help="measure each tap's spread between correct implementations (the reference in fp64, with sdpa "
                     "attention, with reversed summation; the candidate against itself), write the tolerances "
                     "with headroom to FILE (TOML, for --parity-tolerances) and use them")
    g.addoption("--parity-headroom", type=float, default=10.0, metavar="X",
                help="calibrated tolerance = X times the measured spread (default 10)")
    g.addoption("--parity-compiled", action="store_true",
                help="run the engine compiled (not eager): module hooks do not fire, so only the model level "
                     "runs, on vLLM's own outputs (greedy tokens, prompt log-probs)")
    g.addoption("--parity-pdb", action="store_true",
                help="stop in the debugger at the first source of a divergence, with `ref`, `cand`, `diff` "
                     "and `hints` loaded")
    g.addoption("--parity-greedy-tokens", type=int, default=8, metavar="N",
                help="tokens of greedy continuation compared at the model level")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "parity(level): a parity item at level op, block or model")
    config._parity_state = _State(config) if config.getoption("--parity-level") else None


def _options(config: pytest.Config) -> Options:
    from parity.tolerances import load

    opt = config.getoption
    return Options(
        model=opt("--parity-model"), prompts=opt("--parity-prompts"), level=opt("--parity-level"),
        mode=opt("--parity-mode"), taps=opt("--parity-taps"), candidate=opt("--parity-candidate"),
        tolerances=load(opt("--parity-tolerances"), Path(config.rootpath) / "pyproject.toml"),
        dump_dir=opt("--parity-dump-dir"), report_dir=opt("--parity-report"),
        snapshot_dir=opt("--parity-snapshot-dir"), keep=opt("--parity-keep"),
        snapshot_max_gb=opt("--parity-snapshot-max-gb"), greedy_tokens=opt("--parity-greedy-tokens"),
        tensor_parallel_size=opt("--parity-tp"), compiled=opt("--parity-compiled"),
        calibrate=opt("--parity-calibrate"), headroom=opt("--parity-headroom"),
        against=opt("--parity-against"), update_golden=opt("--parity-update-golden"), trend=opt("--parity-trend"),
        root=str(config.rootpath), command=["pytest", *config.invocation_params.args],
    )


class _State:
    def __init__(self, config: pytest.Config):
        self.config = config
        self.session: ParitySession | None = None
        self.failures: list[tuple[str, str]] = []

    def parity(self) -> ParitySession:
        if self.session is None:
            self.session = ParitySession(_options(self.config))
        return self.session


class ParityCollector(pytest.Collector):
    def collect(self):
        return []


class TapFailure(AssertionError):
    pass


class ParityItem(pytest.Item):
    """One canonical tap (or one model-level check) of the run."""

    def __init__(self, *, check: str, level: str, **kwargs):
        super().__init__(**kwargs)
        self.check, self.level = check, level
        self.add_marker(pytest.mark.parity(level=level))

    def runtest(self) -> None:
        session = self.config._parity_state.parity()
        if self.check in MODEL_CHECKS:
            result = getattr(session, self.check)()
            for k in ("agree", "total", "k", "positions", "max_abs"):
                if k in result:
                    self.user_properties.append((k, result[k]))
            if not result["passed"]:
                raise TapFailure(_describe_check(self.check, result))
            return
        r = session.run()[self.check]
        if r.isolated is not None:  # isolated mode: the tap's own error decides
            r = _isolated_view(r)
        if r.metrics is not None:
            for k, v in r.as_dict()["metrics"].items():
                self.user_properties.append((k, v))
            self.user_properties += [("min_atol", r.metrics.min_atol), ("min_row_rtol", r.metrics.min_row_rtol),
                                     ("margin", r.metrics.margin)]
        self.user_properties += [("atol", r.tolerance.atol), ("row_rtol", r.tolerance.row_rtol),
                                 ("token_rtol", r.tolerance.token_rtol)]
        if not r.passed:
            if self.config.getoption("--parity-pdb") and r.role == "source" and not session.debugged:
                session.debugged = True
                _debug_source(self.config, session, r)
            raise TapFailure(r.message)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, TapFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"parity {self.check}"


def _debug_source(config: pytest.Config, session: ParitySession, result) -> None:
    """The first source of a divergence, both tensors (all prompts' rows) and their diff in reach."""
    ref, cand = session.stacked_pair(result.name)
    diff = cand - ref
    hints = [h for h in session.hints if h["tap"] == result.name]
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\nparity: first source {result.name}: {result.message}\n"
              f"  ref, cand: {tuple(ref.shape)} (rows = prompts' positions in order), diff = cand - ref; "
              f"hints: {hints or 'none'}\n  worst element {result.metrics.worst_index} (prompt, position, feature)")
    breakpoint()  # pytest suspends output capture for its debugger
    del ref, cand, diff, hints


def _isolated_view(r):
    import dataclasses

    iso = r.isolated
    note = f" (propagated: {'pass' if r.passed else 'fail'}, role {r.role})"
    return dataclasses.replace(iso, message=(iso.message + note) if iso.message else "", isolated=None)


def _describe_check(check: str, result: dict) -> str:
    if check == "greedy":
        bad = [r for r in result["prompts"] if r["first_mismatch"] is not None]
        r = bad[0]
        i = r["first_mismatch"]
        return (f"greedy continuation differs for {len(bad)} prompt(s); prompt {r['prompt']} first at step {i}: "
                f"reference {r['reference'][i]}, candidate {r['candidate'][i]} "
                f"(reference {r['reference']}, candidate {r['candidate']})")
    if check == "logprobs":
        return (f"prompt log-probs: {len(result['mismatches'])}+ of {result['positions']} positions differ "
                f"(max abs {result['max_abs']:.3g}, atol {result['atol']:g}); first: {result['mismatches'][:3]}")
    return (f"top-{result['k']} agreement {result['agree']}/{result['total']} positions; "
            f"disagreeing at {result['disagree_at']}")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    state: _State | None = config._parity_state
    if state is None:
        return
    top = LEVELS.index(config.getoption("--parity-level"))
    keep, drop = [], []
    for item in items:
        level = _level_of(item)
        (keep if level is not None and LEVELS.index(level) <= top else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    parity = state.parity()
    parent = ParityCollector.from_parent(session, name="parity", path=Path(__file__), nodeid="parity")
    builtin = [ParityItem.from_parent(parent, name=f"test_parity[{level_of(t)}-{t}]", check=t, level=level_of(t))
               for t in parity.taps()]
    if top == LEVELS.index("model") and not config.getoption("--parity-taps"):
        checks = [c for c in MODEL_CHECKS if not (config.getoption("--parity-compiled") and c == "topk")]
        if parity.opts.candidate != "vllm":
            checks = [c for c in checks if c != "logprobs"]  # vLLM's own log-prob API
        builtin += [ParityItem.from_parent(parent, name=f"test_parity[model-{c}]", check=c, level="model")
                    for c in checks]
    keep += builtin
    keep.sort(key=lambda it: LEVELS.index(_level_of(it)))  # stable: kernel tests, then taps, per level
    items[:] = keep


def _level_of(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("parity")
    if marker is None:
        return None
    level = marker.kwargs.get("level", marker.args[0] if marker.args else None)
    if level not in LEVELS:
        raise pytest.UsageError(f"{item.nodeid}: parity marker level {level!r} is not one of {LEVELS}")
    return level


def pytest_runtest_setup(item: pytest.Item) -> None:
    state: _State | None = item.config._parity_state
    if state is None or item.config.getoption("--parity-no-funnel"):
        return
    level = _level_of(item)
    below = [f for f in state.failures if LEVELS.index(f[1]) < LEVELS.index(level)]
    if below:
        nodeid, lvl = below[0]
        pytest.skip(f"funnel: level {lvl!r} failed first at {nodeid}; no {level}-level comparison "
                    f"before the levels below agree")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = yield
    state: _State | None = item.config._parity_state
    if state is not None and report.failed:
        level = _level_of(item)
        if level is not None and not any(n == item.nodeid for n, _ in state.failures):
            state.failures.append((item.nodeid, level))
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    state: _State | None = session.config._parity_state
    if state is not None and state.session is not None:
        state.session.finish()


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    state: _State | None = config._parity_state
    if state is None:
        return
    terminalreporter.section("parity")
    s = state.session
    if s is not None and s.results is not None:
        from parity.compare import first_divergence

        first = first_divergence(list(s.results.values()))
        sources = [r for r in s.results.values() if r.role == "source"]
        if first is None:
            terminalreporter.write_line(f"no divergence over {len(s.results)} taps "
                                        f"(model {s.model_dir}, candidate {s.opts.candidate})")
        else:
            terminalreporter.write_line(f"first divergence: {first.name} (layer {first.layer})", red=True)
            for r in sources:
                terminalreporter.write_line(f"  source {r.message}")
                for h in (h for h in s.hints if h["tap"] == r.name):
                    terminalreporter.write_line(f"    hint ({h['kind']}): {h['evidence']}", yellow=True)
                    terminalreporter.write_line(f"      fix: {h['fix']}", yellow=True)
            inherited = sum(1 for r in s.results.values() if r.role == "inherited")
            if inherited:
                terminalreporter.write_line(f"  {inherited} later failing tap(s) inherit from these sources")
        from parity.report import describe_separation, separation

        sep = describe_separation(separation([r.as_dict() for r in s.results.values()]))
        if sep:
            terminalreporter.write_line(f"separation: {sep}")
        for h in (h for h in s.hints if h["kind"] == "drift"):
            terminalreporter.write_line(f"hint ({h['kind']}): {h['evidence']} — {h['fix']}", yellow=True)
    elif s is not None and s.error is not None:
        terminalreporter.write_line(f"the parity run failed before comparing: {s.error!r}", red=True)
    elif state.failures:
        terminalreporter.write_line(f"first failure: {state.failures[0][0]} (level {state.failures[0][1]})")
    if s is not None and s.golden is not None:
        unused = s.unused_golden()
        if unused:
            terminalreporter.write_line(f"unused golden taps (no comparison read them): {unused[:10]}"
                                        f"{' …' if len(unused) > 10 else ''}", yellow=True)
    if s is not None and "golden_written" in s.extras:
        terminalreporter.write_line(f"golden reference written: {s.extras['golden_written']['path']}", yellow=True)
    if s is not None and s.report_dir is not None:
        terminalreporter.write_line(f"report: {s.report_dir / 'report.html'}")
    if s is not None and s.snapshot is not None:
        terminalreporter.write_line(f"snapshot of the failing taps: {s.snapshot}")


@pytest.fixture(scope="session")
def parity_run(pytestconfig) -> ParitySession:
    """The session's parity run (model, prompts, both dumps, results); needs ``--parity-level``."""
    state: _State | None = pytestconfig._parity_state
    if state is None:
        pytest.skip("parity fixtures need --parity-level")
    return state.parity()


@pytest.fixture(scope="session")
def parity_reference(parity_run):
    parity_run.run()
    return parity_run.reference


@pytest.fixture(scope="session")
def parity_candidate(parity_run):
    parity_run.run()
    return parity_run.candidate
