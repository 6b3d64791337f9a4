"""The parity items: one per canonical tap, one per model-level check, each reading the session's results."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_parity.harness.session import ParitySession

MODEL_CHECKS = ("greedy", "topk", "logprobs")
OP_CHECKS = ("routing",)  # judged on op-level taps (ParitySession.op_checks says where they apply)


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
        if self.check in MODEL_CHECKS or self.check in OP_CHECKS:
            result = session.check(self.check)
            for k in ("agree", "total", "k", "positions", "max_abs", "fraction", "ties"):
                if k in result:
                    self.user_properties.append((k, result[k]))
            if not result["passed"]:
                raise TapFailure(_describe_check(self.check, result))
            return
        # the prefill's, then each decode step's; isolated mode: the tap's own error decides
        phases = [_isolated_view(r) if r.isolated is not None else r for r in session.judgement().phases(self.check)]
        r = phases[0]
        if r.metrics is not None:
            for k, v in r.as_dict()["metrics"].items():
                self.user_properties.append((k, v))
            self.user_properties += [("min_atol", r.metrics.min_atol), ("min_row_rtol", r.metrics.min_row_rtol),
                                     ("margin", r.metrics.margin)]
        self.user_properties += [("atol", r.tolerance.atol), ("row_rtol", r.tolerance.row_rtol),
                                 ("token_rtol", r.tolerance.token_rtol)]
        r = next((f for f in phases if not f.passed), r)  # the first phase that fails
        if not r.passed:
            state = self.config._parity_state
            if self.config.getoption("--parity-pdb") and r.role == "source" and not state.debugged:
                state.debugged = True
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
    ref, cand = session.capture().at(result.step).pair(result.name)
    diff = cand - ref
    hints = [h.as_dict() for h in session.diagnosis().of(result.name)]
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\nparity: first source {result.label}: {result.message}\n"
              f"  ref, cand: {tuple(ref.shape)} (rows = prompts' positions in order), diff = cand - ref; "
              f"hints: {hints or 'none'}\n  worst element {result.metrics.worst_index} (prompt, position, feature)")
    breakpoint()  # pytest suspends output capture for its debugger
    del ref, cand, diff, hints


def _isolated_view(r):
    iso = r.isolated
    note = f" (propagated: {'pass' if r.passed else 'fail'}, role {r.role})"
    return dataclasses.replace(iso, message=(iso.message + note) if iso.message else "", isolated=None)


def _describe_check(check: str, result: dict) -> str:
    if check == "greedy":
        bad = [r for r in result["prompts"] if r["first_mismatch"] is not None and not r.get("tie")]
        r = bad[0]
        i = r["first_mismatch"]
        margin = f", the reference's logit {r['margin']:.3g} above the candidate's token, beyond the tie " \
                 f"{result.get('tie', 0.0):.3g}" if "margin" in r else ""
        return (f"greedy continuation differs for {len(bad)} prompt(s); prompt {r['prompt']} first at step {i}: "
                f"reference {r['reference'][i]}, candidate {r['candidate'][i]}{margin} "
                f"(reference {r['reference']}, candidate {r['candidate']})")
    if check == "logprobs":
        return (f"prompt log-probs: {len(result['mismatches'])}+ of {result['positions']} positions differ "
                f"(max abs {result['max_abs']:.3g}, atol {result['atol']:g}); first: {result['mismatches'][:3]}")
    if check == "routing":
        d = result["first_disagreement"]
        return (f"routing: {result['agree']}/{result['total']} tokens routed to the reference's top-{result['k']} "
                f"experts ({result['ties']} more at a tie); first disagreement at layer {d['layer']}, prompt "
                f"{d['prompt']}, position {d['position']}: reference experts {d['reference']}, candidate "
                f"{d['candidate']} (per layer: {result['layers']})")
    return (f"top-{result['k']} agreement {result['agree']}/{result['total']} positions; "
            f"disagreeing at {result['disagree_at']}")
