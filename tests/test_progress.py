"""The run's stages and steps on pytest's terminal: shown in a normal run, not under -q."""

import pytest

from vllm_parity.fixtures.checkpoints import Dims, make_fixture
from vllm_parity.harness.progress import Progress, TerminalProgress

pytest_plugins = ["pytester"]
TINY = Dims(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, vocab=1024)


class _Reporter:
    """What pytest's terminal reporter was asked to write, a rewritten line as the text it ends with."""

    def __init__(self):
        self.out = ""

    def write_line(self, line, **markup):
        self.out += ("" if not self.out or self.out.endswith("\n") else "\n") + line + "\n"

    def rewrite(self, line, erase=False):
        self.out = self.out[: self.out.rfind("\n") + 1] + line

    def write(self, text):
        self.out += text


def test_on_a_terminal_each_step_rewrites_one_line():
    tr = _Reporter()
    p = TerminalProgress(tr, tty=True, clock=iter(range(100)).__next__)
    p.stage("compare", "3 taps")
    tick = p.steps(3, "taps")
    tick()
    tick()
    assert tr.out.splitlines() == ["parity: compare (3 taps)", "parity: compare 2/3 taps"]
    tick()
    p.stage("write")
    p.done()
    assert tr.out == "parity: compare (3 taps)\nparity: compare 3/3 taps (3.0 s)\nparity: write\n"


def test_in_a_log_steps_are_written_every_few_seconds_and_the_last_always():
    tr, now = _Reporter(), [0.0]
    p = TerminalProgress(tr, tty=False, every=5.0, clock=lambda: now[0])
    p.stage("reference capture")
    for i in range(1, 11):
        now[0] = 2.0 * i
        p.step(i, 10, "layer forwards")
    assert tr.out.splitlines() == ["parity: reference capture", "parity: reference capture 3/10 layer forwards",
                                   "parity: reference capture 6/10 layer forwards",
                                   "parity: reference capture 9/10 layer forwards",
                                   "parity: reference capture 10/10 layer forwards (20.0 s)"]


def test_the_silent_progress_counts_nothing_and_removes_its_hooks():
    torch = pytest.importorskip("torch")
    layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
    seen = []

    class Seen(Progress):
        def step(self, i, n, what=""):
            seen.append((i, n))
    with Seen().layers(layers, forwards=2):
        for _ in range(2):
            for m in layers:
                m(torch.zeros(1, 2))
    layers[0](torch.zeros(1, 2))
    assert seen == [(i, 6) for i in range(1, 7)]
    Progress().step(1, 2)  # says nothing, fails on nothing


@pytest.mark.slow
def test_a_run_shows_its_stages_and_q_hides_them(pytester, tmp_path):
    try:  # the run reads vLLM's version; vLLM registers its torch types once a process, and in-process runs
        import vllm  # noqa: F401  # of pytester keep only what was imported before them
    except ImportError:
        pass
    model = make_fixture("hf-bitnet", tmp_path / "m", dims=TINY)
    args = ["-p", "no:cacheprovider", "--parity-level=block", "--parity-candidate=kernels", "--parity-mode=isolated",
            f"--parity-model={model}", f"--parity-report={tmp_path / 'report'}",
            f"--parity-snapshot-dir={tmp_path / 'snap'}"]
    # in a process of its own, as pytest captures an item's output when it is the only pytest there
    result = pytester.runpytest_subprocess(*args, f"--junitxml={tmp_path / 'junit.xml'}", "-o", "junit_logging=all")
    result.assert_outcomes(passed=1 + 2 * 11 + 2)
    result.stdout.fnmatch_lines([
        "parity: candidate capture (kernels, 4 prompts)",  # first: the reference runs over its decode tokens
        "parity: candidate capture */* layer forwards (*s)",
        "parity: reference build (ternary, 2 layers)",
        "parity: reference build 14/14 projections decoded (*s)",
        "parity: reference capture (4 prompts, 2 decode steps in one forward)",
        "parity: reference capture 2/2 layer forwards (*s)",  # one forward of every prompt, 2 layers
        "parity: candidate isolated capture (kernels, 4 prompts)",
        "parity: compare (* taps, propagated and isolated, at the prefill and 2 decode step(s))",
        "parity: compare */* taps (*s)",
        "parity: diagnose (0 source(s))",
        "parity: write (*report)",
    ])
    # the terminal's, not an item's captured output, which the XML holds
    assert "parity:" not in (tmp_path / "junit.xml").read_text()
    quiet = pytester.runpytest(*args, "-q")
    quiet.assert_outcomes(passed=1 + 2 * 11 + 2)
    assert "parity:" not in quiet.stdout.str()
