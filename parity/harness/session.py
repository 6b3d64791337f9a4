"""One parity run: the model, the prompts, both sides' dumps, the comparison, the report.

Everything is computed lazily and once: the pytest items of a session share one ``ParitySession``
(and so one vLLM engine), and the dumps are made the first time an item asks for a result.
"""

from __future__ import annotations

import collections
import fnmatch
import functools
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_parity.fixtures.prompts import DEFAULT, load_prompts, prompts_sha256
from vllm_parity.harness import report as report_mod
from vllm_parity.harness import snapshots
from vllm_parity.harness.compare import TapResult, compare_dumps, first_divergence, merge_isolated
from vllm_parity.harness.dumps import DumpReader
from vllm_parity.harness.taps import canonical_order, level_of
from vllm_parity.harness.tolerances import ToleranceTable
from vllm_parity.architectures import of_config
from vllm_parity.reference.checkpoint import Checkpoint

LEVELS = ("op", "block", "model")
CANDIDATES = ("vllm", "kernels")
CACHE_DECODED_BYTES = 1 << 30


@dataclass
class Options:
    model: str | None = None
    prompts: str | None = None
    level: str = "block"
    mode: str = "propagated"
    taps: str | None = None
    candidate: str = "vllm"
    tolerances: ToleranceTable = field(default_factory=ToleranceTable)
    dump_dir: str | None = None
    report_dir: str | None = None
    snapshot_dir: str = ".parity/snapshots"
    keep: int = 20
    snapshot_max_gb: float = 2.0
    tensor_parallel_size: int = 1
    compiled: bool = False  # the engine's compiled graph: no module hooks, model-level checks only
    calibrate: str | None = None  # write measured tolerances to this TOML file and use them
    against: str = "live"  # or "golden": the committed reference dumps, no fp32 reference built
    update_golden: bool = False
    trend: str | None = None  # append each run's minimum passing tolerances to this JSON Lines file
    headroom: float = 10.0
    greedy_tokens: int = 8
    top_k: int = 5
    command: list[str] = field(default_factory=lambda: list(sys.argv))
    root: str = "."


class ParitySession:
    def __init__(self, opts: Options):
        self.opts = opts
        self.id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self.started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.model_dir = Path(opts.model) if opts.model else _default_model()
        self.ckpt = Checkpoint(self.model_dir)
        self.arch = of_config(self.ckpt.config, f"{self.model_dir}/config.json")
        self.num_layers = int(self.ckpt.config["num_hidden_layers"])
        self.prompts = load_prompts(opts.prompts or DEFAULT, vocab_size=int(self.ckpt.config["vocab_size"]))
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._dump_root: Path | None = None
        self.results: dict[str, TapResult] | None = None
        self.error: BaseException | None = None
        self.extras: dict[str, dict[str, Any]] = {}
        self._llm = None
        self.timings: dict[str, float] = {}
        self.report_dir: Path | None = None
        self.snapshot: Path | None = None
        self.hints: list[dict] = []
        self.golden = None
        self.golden_error: Exception | None = None
        self._reference_model = None
        self._reference_tokens: list[list[int]] | None = None

    # -- what runs ------------------------------------------------------------------------------

    def taps(self) -> list[str]:
        if self.opts.compiled:
            return []  # hooks do not fire inside the compiled graph
        top = LEVELS.index(self.opts.level)
        taps = [t for t in canonical_order(self.num_layers, self.arch) if LEVELS.index(level_of(t)) <= top
                and not t.endswith(".input")]
        if self.opts.taps:
            taps = [t for t in taps if fnmatch.fnmatchcase(t, self.opts.taps)]
        return taps

    @functools.cached_property
    def model_sha256(self) -> str:
        from vllm_parity.fixtures.default_model import checkpoint_sha256

        return checkpoint_sha256(self.model_dir)

    @property
    def format(self) -> str:
        return self.ckpt.spec.quant_method if self.ckpt.spec is not None else "fp"

    def dump_root(self) -> Path:
        if self._dump_root is None:
            if self.opts.dump_dir:
                root = Path(self.opts.dump_dir)
                for side in ("reference", "candidate"):
                    if (root / side / "manifest.json").exists():
                        raise FileExistsError(f"{root / side}: already holds a dump; choose an empty "
                                              f"--parity-dump-dir")
            else:
                self._tmp = tempfile.TemporaryDirectory(prefix="parity-dumps-")
                root = Path(self._tmp.name)
            self._dump_root = root
        return self._dump_root

    def meta(self, side: str) -> dict[str, Any]:
        import transformers

        versions = {"torch": torch.__version__, "transformers": transformers.__version__}
        try:
            import vllm

            versions["vllm"] = vllm.__version__
        except ImportError:
            pass
        return {"side": side, "model": str(self.model_dir), "model_sha256": self.model_sha256,
                "prompts_sha256": prompts_sha256(self.prompts), "format": self.format, "versions": versions,
                "architecture": self.arch.model_type}

    def capture_taps(self) -> list[str]:
        """The compared taps plus every layer's input (what isolated runs and diagnosis read)."""
        wanted = set(self.taps()) | ({"logits"} if self.opts.level == "model" and not self.opts.taps else set())
        return [t for t in canonical_order(self.num_layers, self.arch) if t in wanted or t.endswith(".input")]

    def wanted(self, tap: str) -> bool:
        return tap in set(self.capture_taps())

    # -- the two sides --------------------------------------------------------------------------

    def reference_dump(self, variant: str | None = None) -> DumpReader:
        """The fp32 reference's dump; ``variant`` (calibration) is one of ``vllm_parity.harness.calibrate.VARIANTS``:
        the same model in another precision, attention implementation or summation order."""
        import contextlib

        from vllm_parity.harness import calibrate, reference_side
        from vllm_parity.reference.model import build_reference_model

        t0 = time.perf_counter()
        dtype = torch.float64 if variant == "fp64" else torch.float32
        # Decoded fp32 weights of a large model would dominate memory: decode them per forward instead.
        decoded = 4 * sum(n * k for n, k in self.ckpt.linear_shapes().values())
        model = build_reference_model(self.ckpt, dtype=dtype, cache=decoded <= CACHE_DECODED_BYTES,
                                      attn_implementation="sdpa" if variant == "sdpa" else "eager")
        name = "reference" if variant is None else f"reference-{variant}"
        order = calibrate.reversed_summation() if variant == "reversed" else contextlib.nullcontext()
        with order:
            dump = reference_side.capture(model, self.arch, self.prompts, self.dump_root() / name,
                                          {**self.meta("reference"), "dtype": str(dtype).removeprefix("torch."),
                                           **({"variant": variant} if variant else {})},
                                          wanted=self.wanted)
        if variant is None:
            self._reference_model = model
            if self.opts.level == "model":
                self._reference_tokens = self.reference_greedy()
        self._reference_model = None  # the dump holds what later checks read: free the weights
        del model
        self.timings[f"{name.replace('-', '_')}_s"] = time.perf_counter() - t0
        return dump

    def calibrate(self) -> None:
        """Measure every tap's spread between correct implementations and make the tolerances from it
        this run's table."""
        from vllm_parity.harness import calibrate

        t0 = time.perf_counter()
        variants = {name: self.reference_dump(variant=name) for name in calibrate.VARIANTS}
        again = self.candidate_dump(repeat=True)
        table, notes = calibrate.calibrate(self.ckpt, self.arch, self.capture_taps(), self.reference, variants, self.candidate,
                                           again, headroom=self.opts.headroom,
                                           max_growth=self.opts.tolerances.max_growth)
        calibrate.write(table, notes, self.opts.calibrate, self.opts.headroom)
        self.opts.tolerances = table
        widest = dict(collections.Counter(n["widest"] for n in notes.values()))
        self.extras["calibration"] = {"passed": True, "file": str(self.opts.calibrate),
                                      "capped": sorted(t for t, n in notes.items() if n["capped"]),
                                      "widest_spread": widest}
        self.timings["calibrate_s"] = time.perf_counter() - t0

    def llm(self):
        if self._llm is None:
            from vllm_parity.harness.engine import make_llm

            t0 = time.perf_counter()
            max_len = max(256, max(len(p) for p in self.prompts) + self.opts.greedy_tokens + 8)
            seqs = max(4, len(self.prompts))
            self._llm = make_llm(self.model_dir, max_model_len=max_len, max_num_seqs=seqs,
                                 kv_cache_bytes=self.kv_cache_bytes(max_len * seqs),
                                 tensor_parallel_size=self.opts.tensor_parallel_size,
                                 enforce_eager=not self.opts.compiled)
            self.timings["engine_start_s"] = time.perf_counter() - t0
        return self._llm

    def kv_cache_bytes(self, tokens: int) -> int:
        """Room for every prompt at once, twice over, at least 64 MiB: not vLLM's default gibibyte."""
        c = self.ckpt.config
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
        per_token = 2 * self.num_layers * int(c.get("num_key_value_heads") or heads) * head_dim * 4
        return max(64 << 20, 2 * per_token * tokens)

    def candidate_dump(self, isolated: bool = False, repeat: bool = False) -> DumpReader:
        if self.opts.candidate == "vllm":
            self.llm()  # the engine's start is timed on its own
        t0 = time.perf_counter()
        out = self.dump_root() / ("candidate-isolated" if isolated else "candidate-repeat" if repeat else "candidate")
        feed = self.reference if isolated else None
        meta = {**self.meta("candidate"), "mode": "isolated" if isolated else "propagated"}
        if self.opts.candidate == "vllm":
            from vllm_parity.harness import vllm_side

            dump = vllm_side.capture(self.llm(), self.arch, self.prompts, out, meta, taps=self.capture_taps(),
                                     isolate_from=feed)
        elif self.opts.candidate == "kernels":
            from vllm_parity.harness import reference_side

            dump = reference_side.capture(self._kernel_model(), self.arch, self.prompts, out, meta, wanted=self.wanted,
                                          isolate_from=feed)
        else:
            raise ValueError(f"unknown candidate {self.opts.candidate!r}; choose one of {CANDIDATES}")
        self.timings[out.name.replace("-", "_") + "_s"] = time.perf_counter() - t0
        return dump

    def _compare(self, cand: DumpReader) -> list[TapResult]:
        """Every captured tap, layer inputs included (they decide source against inherited)."""
        return compare_dumps(self.reference, cand, self.capture_taps(), self.opts.tolerances, self.num_layers, self.arch)

    def run(self) -> dict[str, TapResult]:
        """Make both dumps and compare every tap (once); an error is kept and re-raised per item."""
        if self.results is None and self.error is None:
            try:
                self.reference = self.acquire_reference()
                if self.opts.compiled:
                    self.results = {}
                    return self.results
                self.candidate = self.candidate_dump()
                if self.opts.calibrate:
                    self.calibrate()
                t0 = time.perf_counter()
                results = self._compare(self.candidate)
                if self.opts.mode == "isolated":
                    self.candidate_isolated = self.candidate_dump(isolated=True)
                    merge_isolated(results, self._compare(self.candidate_isolated))
                self.timings["compare_s"] = time.perf_counter() - t0
                shown = set(self.taps())
                self.results = {r.name: r for r in results if r.name in shown}
                t0 = time.perf_counter()
                self.hints = self.diagnose()
                self.timings["diagnose_s"] = time.perf_counter() - t0
                if self.golden_error is not None:
                    raise self.golden_error
            except BaseException as exc:  # noqa: BLE001 - reported by every item that needs it
                self.error = exc
        if self.error is not None:
            raise self.error
        return self.results

    def diagnose(self) -> list[dict]:
        """Hints for every source of a divergence, and for drift across the layers' outputs."""
        from vllm_parity.harness.diagnosis import (DRIFT_MIN_GROWTH, DRIFT_MIN_GROWTH_RELATIVE, LinearContext, diagnose_depth,
                                      diagnose_tap)
        from vllm_parity.reference.linear import ReferenceLinear, read_stored

        cand = self.candidate_isolated if self.opts.mode == "isolated" else self.candidate
        hints = []
        for r in self.results.values():
            if r.role != "source" or r.metrics is None:
                continue
            ref_t, cand_t = self.reference.stacked(r.name)[0], cand.stacked(r.name)[0]
            linear = None
            projection = self.arch.projection(r.name, self.ckpt.linear_shapes())
            spec = self.ckpt.spec
            if projection is not None and spec is not None and not spec.is_ignored(projection[0]):
                module, input_tap = projection
                n, k = self.ckpt.linear_shapes()[module]
                ref_linear = ReferenceLinear(module, spec, read_stored(self.ckpt, module, spec, n, k), n, k)
                linear = LinearContext(module, self.reference.stacked(input_tap)[0], ref_linear)
            # What the candidate's side recorded of its own layout: fused layers and tensor-parallel spread.
            group = [t for t in cand.manifest.get("fused", {}).get(r.name, []) if t in self.reference.taps()]
            siblings = {t: (self.reference.stacked(t)[0], cand.stacked(t)[0]) for t in group} \
                if len(group) > 1 else None
            try:
                found = diagnose_tap(r.name, ref_t, cand_t, linear, tp_size=self.opts.tensor_parallel_size,
                                     siblings=siblings, parallel=cand.manifest.get("parallel", {}).get(r.name))
            except ValueError as exc:  # a shape the diagnosis cannot read is not a reason to lose the run
                found = []
                self.extras.setdefault("diagnosis_errors", {"passed": True, "errors": []})["errors"].append(
                    f"{r.name}: {exc}")
            hints += [h.as_dict() for h in found]
        outputs = [r for r in self.results.values() if r.name.endswith(".output") and r.metrics is not None]
        if outputs:
            tol = outputs[-1].tolerance
            if tol.elementwise_only:
                errors, bound = [(r.name, r.metrics.max_abs) for r in outputs], (tol.atol, "max_abs", "atol")
                growth = DRIFT_MIN_GROWTH
            else:
                errors = [(r.name, r.metrics.token_rel) for r in outputs]
                bound = (tol.token_rtol, "token relative error", "token_rtol")
                growth = DRIFT_MIN_GROWTH_RELATIVE
            hints += [h.as_dict() for h in diagnose_depth(errors, *bound, min_growth=growth)]
        return hints

    def golden_dir(self, writing: bool = False) -> Path:
        from vllm_parity.harness import golden

        return golden.golden_path(Path(self.opts.root), golden.fixture_name(self.opts.model), writing=writing)

    def acquire_reference(self) -> DumpReader:
        """The live fp32 reference, or the golden one (written, and the run failed, when missing)."""
        from vllm_parity.harness import golden

        if self.opts.against != "golden" and not self.opts.update_golden:
            return self.reference_dump()
        dest = self.golden_dir(writing=True)
        if self.opts.against == "golden" and not self.opts.update_golden:
            try:
                g = golden.load_golden(self.golden_dir(), self.model_sha256, prompts_sha256(self.prompts))
                self.golden = g
                return g
            except golden.GoldenMissing as exc:
                self.golden_error = golden.GoldenMissing(
                    f"{exc}; it was written now from the live reference, and this run checked nothing "
                    f"against it: commit {dest} and run again")
        if self.opts.level != "model" or self.opts.taps or self.opts.compiled:
            raise golden.GoldenError("a golden reference holds every tap: write it with --parity-level=model and "
                                     "neither --parity-taps nor --parity-compiled")
        live = self.reference_dump()
        golden.write_golden(live, dest, extras={"greedy": self.reference_greedy()})
        self.extras["golden_written"] = {"passed": self.golden_error is None, "path": str(dest)}
        return live

    def reference_greedy(self) -> list[list[int]]:
        if self.golden is not None:
            from vllm_parity.harness import golden

            tokens = golden.extras_of(self.golden).get("greedy")
            if tokens is None or len(tokens) != len(self.prompts) or \
                    any(len(t) < self.opts.greedy_tokens for t in tokens):
                raise golden.GoldenError(f"{self.golden.root}: holds no greedy continuation of "
                                         f"{self.opts.greedy_tokens} tokens; regenerate it with "
                                         f"--parity-update-golden")
            return [t[: self.opts.greedy_tokens] for t in tokens]
        if self._reference_tokens is not None:
            return self._reference_tokens
        return [_greedy(self._reference_model, ids, self.opts.greedy_tokens) for ids in self.prompts]

    def unused_golden(self) -> list[str]:
        """Golden taps this run never read (reported only when every tap was compared)."""
        from vllm_parity.harness import golden

        if self.golden is None or self.opts.level != "model" or self.opts.taps or self.opts.compiled:
            return []
        return golden.unused_taps(self.golden, golden.read_taps(self.golden))

    # -- model-level extras ---------------------------------------------------------------------

    def greedy(self) -> dict[str, Any]:
        """vLLM's greedy continuation against the reference's, token by token."""
        if "greedy" not in self.extras:
            self.run()
            from vllm_parity.harness import model_checks

            if self.opts.candidate == "vllm":
                from vllm_parity.harness.engine import generate

                outs = generate(self.llm(), self.prompts, max_tokens=self.opts.greedy_tokens)
                candidate = [list(o.outputs[0].token_ids) for o in outs]
            else:
                candidate = [_greedy(self._kernel_model(), ids, self.opts.greedy_tokens) for ids in self.prompts]
            self.extras["greedy"] = model_checks.greedy(self.reference_greedy(), candidate)
        return self.extras["greedy"]

    def topk(self) -> dict[str, Any]:
        if "topk" not in self.extras:
            self.run()
            from vllm_parity.harness import model_checks

            self.extras["topk"] = model_checks.topk(self.reference, self.candidate, self.opts.top_k)
        return self.extras["topk"]

    def logprobs(self) -> dict[str, Any]:
        if "logprobs" not in self.extras:
            self.run()
            from vllm_parity.harness import model_checks
            from vllm_parity.harness.engine import generate

            k = self.opts.top_k
            outs = generate(self.llm(), self.prompts, max_tokens=1, prompt_logprobs=k)
            returned = [[None if e is None else {tok: lp.logprob for tok, lp in e.items()}
                         for e in (o.prompt_logprobs or [])] for o in outs]
            self.extras["logprobs"] = model_checks.logprobs(self.reference, returned, k,
                                                            self.opts.tolerances.resolve("logprobs", torch.float32))
        return self.extras["logprobs"]

    def _kernel_model(self):
        from vllm_parity.harness.kernel_candidate import build_kernel_model

        if not hasattr(self, "_kmodel"):
            self._kmodel = build_kernel_model(self.ckpt)
        return self._kmodel

    # -- end of run -----------------------------------------------------------------------------

    def finish(self) -> Path | None:
        """Write the report (and a snapshot when a tap failed); close the engine and temp dumps."""
        try:
            if self.results is not None:
                self.write_report()
        finally:
            if self._llm is not None:
                from vllm_parity.harness.engine import close_llm

                close_llm(self._llm)
                self._llm = None
            if self._tmp is not None:
                self._tmp.cleanup()
        return self.report_dir

    def write_report(self) -> Path:
        t0 = time.perf_counter()
        results = list(self.results.values())
        first = first_divergence(results)
        run = {"id": self.id, "started": self.started, "model": str(self.model_dir), "format": self.format,
               "level": self.opts.level, "mode": self.opts.mode, "prompts_sha256": prompts_sha256(self.prompts),
               "versions": self.reference.manifest.get("versions", {}), "candidate": self.opts.candidate,
               "timings": self.timings, "extras": self.extras, "against": self.opts.against,
               "model_sha256": self.meta("reference")["model_sha256"]}
        if self.golden is not None:
            from vllm_parity.harness import golden

            run["golden"] = golden.describe(self.golden)
            run["unused_golden_taps"] = self.unused_golden()
        rep = report_mod.build(run, [r.as_dict() for r in results],
                               {"name": first.name, "layer": first.layer} if first else None, hints=self.hints)
        if self.extras:
            rep["passed"] = rep["passed"] and all(e["passed"] for e in self.extras.values())
        heat = None
        failing = [r for r in results if not r.passed and r.metrics is not None]
        if failing:
            f = first or failing[0]
            heat = report_mod.heatmap_of(f.name, *self.stacked_pair(f.name))
        root = Path(self.opts.report_dir) if self.opts.report_dir else Path(self.opts.root) / "reports" / self.id
        self.timings["report_s"] = time.perf_counter() - t0  # the report's own write is not in it
        self.report_dir = report_mod.write(root, rep, heat)
        if self.opts.trend:
            from vllm_parity.harness import trend

            trend.append(self.opts.trend, rep, model_sha256=run["model_sha256"])
        if failing:
            self.snapshot = self.write_snapshot(failing)
        return self.report_dir

    def stacked_pair(self, tap: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.reference.stacked(tap)[0], self.candidate.stacked(tap)[0]

    def write_snapshot(self, failing: list[TapResult]) -> Path | None:
        ref, cand, diff = {}, {}, {}
        for r in failing:
            for p in self.reference.prompts(r.name):
                ref[f"{r.name}@{p}"] = self.reference.get(r.name, p)
                cand[f"{r.name}@{p}"] = self.candidate.get(r.name, p)
            diff[r.name] = r.as_dict()
        meta = {"run": self.id, "model": str(self.model_dir), "format": self.format, "level": self.opts.level,
                "command": " ".join(self.opts.command), "report": str(self.report_dir),
                "prompts_sha256": prompts_sha256(self.prompts)}
        try:
            path = snapshots.write(self.opts.snapshot_dir, self.id, ref, cand, diff, meta)
        except snapshots.SnapshotError as exc:
            self.extras.setdefault("snapshot_error", {"passed": False, "message": str(exc)})
            return None
        snapshots.prune(self.opts.snapshot_dir, self.opts.keep, self.opts.snapshot_max_gb, protect=path)
        return path


def _greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(x, use_cache=False).logits[0, -1].argmax())
            out.append(nxt)
            x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    return out


def _default_model() -> Path:
    from vllm_parity.fixtures.default_model import default_model_dir

    return default_model_dir()

