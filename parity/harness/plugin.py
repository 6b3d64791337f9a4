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

from vllm_parity.errors import ParityInputError
from vllm_parity.harness import progress, summary
from vllm_parity.harness.items import MODEL_CHECKS, ParityCollector, ParityItem
from vllm_parity.harness.session import CANDIDATES, DEVICES, LEVELS, MODES, SERVING_DTYPES, Finished, Options, ParitySession
from vllm_parity.harness.taps import level_of

# Every option once: (flag, the Options field it sets, or None for the plugin's own; addoption's arguments).
OPTIONS: tuple[tuple[str, str | None, dict], ...] = (
    ("--parity-level", "level", dict(
        choices=LEVELS, default=None, help="run only parity items, every level up to this one (op -> block -> model)")),
    ("--parity-no-funnel", None, dict(action="store_true", help="run every level even when a lower level failed")),
    ("--parity-model", "model", dict(
        default=None, metavar="DIR",
        help="checkpoint directory of shared FORMATS.md (default: the embedded default model)")),
    ("--parity-candidate", "candidate", dict(
        choices=CANDIDATES, default="vllm",
        help="vllm: the real engine with the plugin; kernels: the reference's modeling code with the kernel "
             "linears (no vLLM needed)")),
    ("--parity-dtype", "dtype", dict(
        choices=SERVING_DTYPES, default="float32",
        help="the candidate's dtype, as it is served (the reference stays fp32); the default tolerances follow it")),
    ("--parity-device", "device", dict(
        choices=DEVICES, default="cpu",
        help="where the reference and the kernels candidate run (cuda: a GPU; the vLLM candidate runs where its "
             "engine runs)")),
    ("--parity-mode", "mode", dict(
        choices=MODES, default="auto",
        help="propagated: both sides run free from the same token ids; isolated: besides, every candidate layer "
             "is fed the reference's input for it, and a tap fails on its own error; auto (default): isolated "
             "for a half-precision candidate or a format that quantizes activations, else propagated")),
    ("--parity-prompts", "prompts", dict(
        default=None, metavar="FILE", help="JSON array of token-id arrays (default fixtures/prompts/default.json)")),
    ("--parity-taps", "taps", dict(default=None, metavar="GLOB", help="compare only taps matching GLOB")),
    ("--parity-tolerances", "tolerances", dict(default=None, metavar="FILE", help="TOML file of per-tap tolerances")),
    ("--parity-dump-dir", "dump_dir", dict(
        default=None, metavar="DIR",
        help="keep both sides' dumps in DIR/reference and DIR/candidate (default: a temporary dir)")),
    ("--parity-snapshot-dir", "snapshot_dir", dict(
        default=".parity/snapshots", metavar="DIR", help="where failing taps are kept (default .parity/snapshots)")),
    ("--parity-report", "report_dir", dict(
        default=None, metavar="DIR", help="report directory (default reports/<run-id>)")),
    ("--parity-keep", "keep", dict(type=int, default=20, metavar="N", help="keep the newest N snapshot runs")),
    ("--parity-snapshot-max-gb", "snapshot_max_gb", dict(
        type=float, default=2.0, metavar="GB", help="keep snapshots under this many GB")),
    ("--parity-tp", "tensor_parallel_size", dict(
        type=int, default=1, metavar="N", help="tensor-parallel size of the vLLM candidate (ranks' taps are gathered)")),
    ("--parity-against", "against", dict(
        choices=("live", "golden"), default="live",
        help="compare with the live fp32 reference, or with the golden dumps in references/golden/<fixture>/ "
             "(the fp32 reference is never built; a missing golden is written and fails)")),
    ("--parity-update-golden", "update_golden", dict(
        action="store_true", help="regenerate the golden reference of the model from the live fp32 reference")),
    ("--parity-trend", "trend", dict(
        default=None, metavar="FILE",
        help="append the run's minimum passing tolerance per tap to FILE (JSON Lines; `parity trend`)")),
    ("--parity-calibrate", "calibrate", dict(
        default=None, metavar="FILE",
        help="measure each tap's spread between correct implementations (the reference in fp64, with sdpa "
             "attention, with reversed summation; the candidate against itself), write the tolerances with "
             "headroom to FILE (TOML, for --parity-tolerances) and use them")),
    ("--parity-headroom", "headroom", dict(
        type=float, default=10.0, metavar="X", help="calibrated tolerance = X times the measured spread (default 10)")),
    ("--parity-compiled", "compiled", dict(
        action="store_true",
        help="run the engine compiled (not eager): module hooks do not fire, so only the model level runs, on "
             "vLLM's own outputs (greedy tokens, prompt log-probs)")),
    ("--parity-pdb", None, dict(
        action="store_true",
        help="stop in the debugger at the first source of a divergence, with `ref`, `cand`, `diff` and `hints` "
             "loaded")),
    ("--parity-decode-steps", "decode_steps", dict(
        type=int, default=2, metavar="N",
        help="greedy decode steps after each prompt's prefill whose taps are compared too, against the reference "
             "over the prompt and the tokens the candidate generated (default 2; 0: the prefill only)")),
    ("--parity-prefix-caching", "prefix_caching", dict(
        action="store_true",
        help="start the engine with prefix caching on (32-token blocks): each prompt's prefill runs once to fill "
             "the cache, then again, its taps computed only after the cached blocks (the rest from the first run)")),
    ("--parity-chunked-prefill", "chunked_prefill", dict(
        type=int, default=0, metavar="TOKENS",
        help="start the engine with chunked prefill on, at most TOKENS tokens a step: longer prefills run in "
             "chunks, assembled per prompt (default 0: off)")),
    ("--parity-greedy-tokens", "greedy_tokens", dict(
        type=int, default=8, metavar="N", help="tokens of greedy continuation compared at the model level")),
)


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("parity", "layer-by-layer parity of a quantized model: reference vs vLLM")
    for flag, _, kwargs in OPTIONS:
        g.addoption(flag, **kwargs)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "parity(level): a parity item at level op, block or model")
    config._parity_state = _State(config) if config.getoption("--parity-level") else None


def _options(config: pytest.Config) -> Options:
    from vllm_parity.harness.tolerances import load

    values = {field: config.getoption(flag) for flag, field, _ in OPTIONS if field is not None}
    values["tolerances"] = load(values["tolerances"], Path(config.rootpath) / "pyproject.toml")
    return Options(**values, root=str(config.rootpath), command=["pytest", *config.invocation_params.args])


class _State:
    def __init__(self, config: pytest.Config):
        self.config = config
        self.session: ParitySession | None = None
        self.finished: Finished | None = None
        self.finish_error: Exception | None = None  # what stopped the record from being written
        self.failures: list[tuple[str, str]] = []
        self.debugged = False  # --parity-pdb stops at the first source only

    def parity(self) -> ParitySession:
        if self.session is None:
            self.session = ParitySession(_options(self.config))
            self.session.progress = progress.for_pytest(self.config)
        return self.session


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
    try:
        parity = state.parity()
        taps, _ = parity.taps(), parity.format  # the architecture and the format are known, or say what to add
    except ParityInputError as exc:  # the checkpoint or the options: the message says what to fix
        raise pytest.UsageError(f"parity: {exc}") from None
    parent = ParityCollector.from_parent(session, name="parity", path=Path(__file__), nodeid="parity")
    builtin = [ParityItem.from_parent(parent, name=f"test_parity[{level_of(t)}-{t}]", check=t, level=level_of(t))
               for t in taps]
    builtin += [ParityItem.from_parent(parent, name=f"test_parity[op-{c}]", check=c, level="op")
                for c in parity.op_checks()]
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
        try:
            state.finished = state.session.finish()
        except Exception as exc:  # noqa: BLE001 - the terminal summary still comes, and says what it was
            state.finish_error = exc
        written = state.finished.written if state.finished is not None else None
        if (state.finish_error is not None or (written is not None and written.failed)) \
                and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # the record asked for is not on disk


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    state: _State | None = config._parity_state
    if state is None:
        return
    terminalreporter.section("parity")
    for text, markup in summary.lines(state.finished, state.failures):
        terminalreporter.write_line(text, **markup)
    if state.finish_error is not None:
        terminalreporter.write_line(f"the parity run's record was not written: {state.finish_error!r}", red=True)


@pytest.fixture(scope="session")
def parity_run(pytestconfig) -> ParitySession:
    """The session's parity run (model, prompts, both dumps, results); needs ``--parity-level``."""
    state: _State | None = pytestconfig._parity_state
    if state is None:
        pytest.skip("parity fixtures need --parity-level")
    return state.parity()


@pytest.fixture(scope="session")
def parity_reference(parity_run):
    """The reference's dump (``DumpReader``)."""
    return parity_run.capture().reference


@pytest.fixture(scope="session")
def parity_candidate(parity_run):
    """The candidate's dump (``DumpReader``)."""
    return parity_run.capture().candidate
