"""One parity run: its options, the model, the prompts, and its stages.

Each stage runs lazily and once, and returns a record (``vllm_parity.harness.records``): the pytest items of
a session share one ``ParitySession`` (and so one vLLM engine), and the dumps are made the first time an
item asks for a result.
"""

from __future__ import annotations

import collections
import contextlib
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
from vllm_parity.harness import stages
from vllm_parity.harness.dumps import DumpReader
from vllm_parity.harness.progress import Progress
from vllm_parity.harness.records import Capture, Diagnosis, Judgement, RunRecord
from vllm_parity.harness.stages import Written
from vllm_parity.harness.taps import canonical_order, level_of
from vllm_parity.harness.tolerances import ToleranceTable
from vllm_parity.architectures import of_config
from vllm_parity.reference.checkpoint import Checkpoint

LEVELS = ("op", "block", "model")
CANDIDATES = ("vllm", "kernels")
SERVING_DTYPES = ("float32", "bfloat16", "float16")
MODES = ("auto", "propagated", "isolated")
DEVICES = ("cpu", "cuda")
CACHE_DECODED_BYTES = 1 << 30


@dataclass
class Options:
    model: str | None = None
    prompts: str | None = None
    level: str = "block"
    mode: str = "auto"  # "propagated", "isolated", or auto: isolated where the candidate's rounding grows (ParitySession.mode)
    taps: str | None = None
    candidate: str = "vllm"
    dtype: str = "float32"  # the candidate's serving dtype; the reference stays fp32 (fp64 calibrating)
    device: str = "cpu"  # where the reference and the kernels candidate run
    tolerances: ToleranceTable = field(default_factory=ToleranceTable)
    dump_dir: str | None = None
    report_dir: str | None = None
    snapshot_dir: str = ".parity/snapshots"
    keep: int = 20
    snapshot_max_gb: float = 2.0
    tensor_parallel_size: int = 1
    compiled: bool = False  # the engine's compiled graph: no module hooks, model-level checks only
    prefix_caching: bool = False  # the engine's prefix caching on (vllm_side.capture: a warming pass first)
    chunked_prefill: int = 0  # > 0: the engine's chunked prefill on, at most this many tokens a step
    calibrate: str | None = None  # write measured tolerances to this TOML file and use them
    against: str = "live"  # or "golden": the committed reference dumps, no fp32 reference built
    update_golden: bool = False
    trend: str | None = None  # append each run's minimum passing tolerances to this JSON Lines file
    headroom: float = 10.0
    greedy_tokens: int = 8
    # greedy decode steps after each prefill whose taps are compared too (the pytest face's default: 2)
    decode_steps: int = 0
    top_k: int = 5
    command: list[str] = field(default_factory=lambda: list(sys.argv))
    root: str = "."


@dataclass(frozen=True)
class Finished:
    """How a run ended: its record (None when it failed before comparing), the error that stopped it,
    where the record was written."""

    record: RunRecord | None = None
    error: BaseException | None = None
    written: Written | None = None


class ParitySession:
    """One run's inputs, and its stages run lazily and once: :meth:`capture`, :meth:`judgement`,
    :meth:`diagnosis`, :meth:`check`, :meth:`record`, each returning a record (``vllm_parity.harness.records``)."""

    def __init__(self, opts: Options, llm=None):
        """``llm``: an engine already started on this checkpoint with these options (the run closes it)."""
        self.opts = opts
        self.id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self.started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.model_dir = Path(opts.model) if opts.model else _default_model()
        self.ckpt = Checkpoint(self.model_dir)
        self.arch = of_config(self.ckpt.config, f"{self.model_dir}/config.json")
        self.num_layers = self.ckpt.config_int("num_hidden_layers")
        self.prompts = load_prompts(opts.prompts or DEFAULT, vocab_size=self.ckpt.config_int("vocab_size"))
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._dump_root: Path | None = None
        self._llm = llm
        self._kmodel = None
        self.progress = Progress()  # says nothing; the pytest plugin gives its terminal's
        self._seconds: dict[str, float] = {}  # each step's time, for the record's timings
        # The stages' records, each made once.
        self._capture: Capture | None = None
        self._judgement: Judgement | None = None
        self._diagnosis: Diagnosis | None = None
        self._calibration: tuple[ToleranceTable, dict[str, Any]] | None = None
        self._checks: dict[str, dict[str, Any]] = {}
        self._error: BaseException | None = None
        self._golden = None
        self._golden_error: Exception | None = None
        self._reference_tokens: list[list[int]] | None = None
        self._reference_logits: list[list[torch.Tensor]] | None = None  # at each greedy step

    # -- what runs ------------------------------------------------------------------------------

    def taps(self) -> list[str]:
        if self.opts.compiled:
            return []  # hooks do not fire inside the compiled graph
        top = LEVELS.index(self.opts.level)
        taps = [t for t in canonical_order(self.num_layers, self.arch, self.ckpt.config)
                if LEVELS.index(level_of(t)) <= top and not t.endswith(".input")]
        if self.opts.taps:
            taps = [t for t in taps if fnmatch.fnmatchcase(t, self.opts.taps)]
        return taps

    @property
    def decode_steps(self) -> int:
        """The decode steps compared: none where the taps are not hooked or where no live reference runs (a golden
        holds the prefill's)."""
        if self.why_no_decode():
            return 0
        if self._golden is not None:  # as many as the golden holds
            return min(self.opts.decode_steps, int(self._golden.manifest.get("decode", {}).get("steps", 0)))
        return self.opts.decode_steps

    def why_no_decode(self) -> str | None:
        if self.opts.decode_steps < 0:
            raise ValueError(f"--parity-decode-steps {self.opts.decode_steps}: a count of steps, 0 or more")
        if self.opts.decode_steps == 0:
            return None
        if self.opts.compiled:
            return "the compiled engine runs no hooks"
        if self.opts.candidate == "kernels":
            from vllm_parity.harness.kernel_decode import why_no_static_decode

            if reason := why_no_static_decode(self.ckpt.config):
                return reason
        if self._golden is not None and not self._golden.manifest.get("decode", {}).get("steps"):
            return f"the golden reference {self._golden.root} holds no decode steps (regenerate it with " \
                   f"--parity-update-golden)"
        return None

    @functools.cached_property
    def model_sha256(self) -> str:
        from vllm_parity.fixtures.default_model import checkpoint_sha256

        return checkpoint_sha256(self.model_dir)

    @property
    def format(self) -> str:
        return self.ckpt.spec.quant_method if self.ckpt.spec is not None else "fp"

    @property
    def mode(self) -> str:
        """The mode the run judges in: ``--parity-mode``, or for auto, isolated when :meth:`why_isolated`."""
        if self.opts.mode not in MODES:
            raise ValueError(f"unknown mode {self.opts.mode!r}; choose one of {MODES}")
        if self.opts.mode != "auto":
            return self.opts.mode
        return "isolated" if self.why_isolated() else "propagated"

    def why_isolated(self) -> str | None:
        """Why errors propagated from layer to layer cannot tell a fault from a correct candidate here (None:
        they can). A half-precision candidate rounds every tap (a 30-layer model's propagated error reaches
        50-70 of its unit roundoffs), and a format that quantizes activations flips a code wherever fp32
        noise meets a rounding boundary, and the flip propagates: each tap is judged fed the reference's input."""
        reasons = [f"the candidate computes in {self.opts.dtype}"] if self.opts.dtype != "float32" else []
        quantizers = self.activation_quantizers()
        if quantizers:
            reasons.append(f"{self.format} quantizes activations ({', '.join(quantizers)})")
        return "; ".join(reasons) or None

    def activation_quantizers(self) -> tuple[str, ...]:
        """The quantizers of the format's activations, over every quantized projection (read once: the mode
        asks on every stage)."""
        return self._activation_quantizers

    @functools.cached_property
    def _activation_quantizers(self) -> tuple[str, ...]:
        spec = self.ckpt.spec
        if spec is None:
            return ()
        return tuple(sorted({q for m in self.ckpt.linear_shapes() if not spec.is_ignored(m)
                             for q in [spec.activation_of(m)] if q is not None}))

    @property
    def tolerances(self) -> ToleranceTable:
        """The table the run judges with: the calibrated one, when this run calibrated."""
        return self._calibration[0] if self._calibration is not None else self.opts.tolerances

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
        return [t for t in canonical_order(self.num_layers, self.arch, self.ckpt.config)
                if t in wanted or t.endswith(".input")]

    def wanted(self, tap: str) -> bool:
        return tap in set(self.capture_taps())

    # -- capture ----------------------------------------------------------------------------------

    def capture(self) -> Capture:
        """Both sides' dumps (once); with ``--parity-calibrate`` the tolerances are measured here too."""
        if self._capture is None:
            self._capture = self._remembered(self._make_capture)
        return self._capture

    def _make_capture(self) -> Capture:
        if self.opts.compiled:
            return Capture(self.acquire_reference()[0], seconds=dict(self._seconds))
        if self.opts.against == "golden" or self.opts.update_golden:
            # A golden's decode steps ran the reference's own greedy tokens: the candidate is made to run them.
            reference, references = self.acquire_reference()
            candidate = self.candidate_dump(forced=reference.manifest.get("decode", {}).get("tokens"))
        else:
            # The candidate first: the reference then runs once over each prompt and the tokens the candidate's
            # decode steps ran, and no reference model is alive while the engine runs.
            candidate = self.candidate_dump()
            reference, references = self.acquire_reference(candidate.manifest.get("decode", {}).get("tokens"))
        if self.opts.calibrate:
            self._calibration = self.calibrate(reference, candidate)
        isolated = None
        if self.mode == "isolated":
            isolated = self.candidate_dump(isolated=True, feed=reference, feed_steps=references,
                                           forced=candidate.manifest.get("decode", {}).get("tokens"))
        isolated_steps = isolated.steps() if isolated is not None else [None] * len(references)
        steps = tuple(Capture(r, c, i) for r, c, i in zip(references, candidate.steps(), isolated_steps))
        return Capture(reference, candidate, isolated, dict(self._seconds), steps)  # the record keeps its own copy

    def _remembered(self, stage):
        """A stage's record; an error is kept and raised again for every item that needs it."""
        if self._error is None:
            try:
                return stage()
            except BaseException as exc:  # noqa: BLE001 - reported by every item that needs it
                self._error = exc
        raise self._error

    def reference_dump(self, variant: str | None = None) -> DumpReader:
        """The fp32 reference's dump; ``variant`` (calibration) is one of ``vllm_parity.harness.calibrate.VARIANTS``
        or ``SERVING_VARIANTS``: the same model in another precision, attention implementation or summation order."""
        return self._reference(variant)[0]

    def _reference(self, variant: str | None = None, tokens: list[list[int]] | None = None,
                   own_steps: int = 0) -> tuple[DumpReader, list[DumpReader]]:
        """The reference's dump, and with ``tokens`` (each prompt's decode-step tokens) each decode step's, all
        from one forward; ``own_steps``: that many decode steps over its own greedy tokens (a golden's)."""
        from vllm_parity.harness import calibrate, reference_side

        t0 = time.perf_counter()
        dtype = torch.float64 if variant == "fp64" else getattr(torch, variant) \
            if variant in calibrate.SERVING_VARIANTS else torch.float32
        name = "reference" if variant is None else f"reference-{variant}"
        model = self._build_reference(dtype, name, "sdpa" if variant == "sdpa" else "eager")
        order = calibrate.reversed_summation() if variant == "reversed" else contextlib.nullcontext()
        if variant is None and self.opts.level == "model":
            n = max(self.opts.greedy_tokens, own_steps)
            self.progress.stage("reference greedy", f"{n} tokens after each of {len(self.prompts)} prompts")
            with self.progress.layers(_decoder_layers(model), n):
                self._reference_tokens, self._reference_logits = _greedy_batch(model, self.prompts, n)
        if own_steps:
            tokens = [t[:own_steps] for t in self.reference_greedy(own_steps)]
        steps = f", {len(tokens[0])} decode steps" if tokens else ""
        self.progress.stage(f"{name} capture", f"{len(self.prompts)} prompts{steps} in one forward")
        with order, self.progress.layers(_decoder_layers(model), 1):
            dump, decoded = reference_side.capture_batch(
                model, self.arch, self.prompts, self.dump_root() / name,
                {**self.meta("reference"), "dtype": str(dtype).removeprefix("torch."),
                 **({"variant": variant} if variant else {})}, wanted=self.wanted, tokens=tokens)
        del model  # the dump holds what later checks read: free the weights
        self._seconds[f"{name.replace('-', '_')}_s"] = time.perf_counter() - t0
        return dump, decoded

    def _build_reference(self, dtype: torch.dtype, name: str = "reference", attention: str = "eager"):
        from vllm_parity.reference.model import build_reference_model

        # Decoded fp32 weights of a large model would dominate memory: decode them per forward instead.
        decoded = 4 * sum(n * k for n, k in self.ckpt.linear_shapes().values())
        self.progress.stage(f"{name} build", f"{self.format}, {self.num_layers} layers")
        served = getattr(torch, self.opts.dtype)
        rounded = served if name == "reference" and served != torch.float32 else None  # what quantizers take
        model = build_reference_model(self.ckpt, dtype=dtype, cache=decoded <= CACHE_DECODED_BYTES,
                                      attn_implementation=attention, activations_in=rounded,
                                      on_decoded=lambda i, n, _: self.progress.step(i, n, "projections decoded"))
        return model if self.opts.device == "cpu" else model.to(self.opts.device)

    def calibrate(self, reference: DumpReader, candidate: DumpReader) -> tuple[ToleranceTable, dict[str, Any]]:
        """Every tap's spread between correct implementations, and the tolerance table made from it (written
        to ``--parity-calibrate``), with the check that reports it."""
        from vllm_parity.harness import calibrate

        t0 = time.perf_counter()
        variants = {name: self.reference_dump(variant=name) for name in calibrate.variants_for(self.opts.dtype)}
        again = self.candidate_dump(repeat=True)
        table, notes = calibrate.calibrate(self.ckpt, self.arch, self.capture_taps(), reference, variants, candidate,
                                           again, headroom=self.opts.headroom,
                                           max_growth=self.opts.tolerances.max_growth)
        calibrate.write(table, notes, self.opts.calibrate, self.opts.headroom)
        widest = dict(collections.Counter(n["widest"] for n in notes.values()))
        self._seconds["calibrate_s"] = time.perf_counter() - t0
        return table, {"passed": True, "file": str(self.opts.calibrate),
                       "capped": sorted(t for t, n in notes.items() if n["capped"]), "widest_spread": widest}

    def llm(self):
        if self._llm is None:
            from vllm_parity.harness.engine import make_run_llm

            t0 = time.perf_counter()
            self.progress.stage("engine start", f"vLLM, tensor parallel {self.opts.tensor_parallel_size}")
            with self._explained():
                self._llm = make_run_llm(self.model_dir, self.ckpt.config, self.prompts,
                                         max(self.opts.greedy_tokens, 1 + self.decode_steps),
                                         tensor_parallel_size=self.opts.tensor_parallel_size,
                                         compiled=self.opts.compiled, dtype=self.opts.dtype,
                                         prefix_caching=self.opts.prefix_caching,
                                         chunked_prefill=self.opts.chunked_prefill)
            self._seconds["engine_start_s"] = time.perf_counter() - t0
        return self._llm

    @contextlib.contextmanager
    def _explained(self):
        """vLLM's refusal to serve this checkpoint here (a kernel its build lacks, a dtype), said as such."""
        from vllm_parity.harness.engine import explain

        try:
            yield
        except Exception as exc:
            what = f"this {self.format} checkpoint ({self.model_dir})"
            explained = explain(exc, what, self.opts.dtype)
            if explained is None:
                raise
            raise explained from exc

    def hand_over(self):
        """The engine, no longer this run's to close: a second run on the same checkpoint takes it."""
        llm, self._llm = self.llm(), None
        return llm

    def candidate_dump(self, isolated: bool = False, repeat: bool = False, feed: DumpReader | None = None,
                       feed_steps: list[DumpReader] = (), forced: list[list[int]] | None = None) -> DumpReader:
        """The candidate's dump (its decode steps': ``DumpReader.steps``); ``isolated``: every layer fed ``feed``'s
        input for it (``feed_steps``: at each decode step), the decode steps running the ``forced`` tokens."""
        if self.opts.candidate not in CANDIDATES:
            raise ValueError(f"unknown candidate {self.opts.candidate!r}; choose one of {CANDIDATES}")
        if self.opts.candidate == "vllm":
            self.llm()  # the engine's start is timed on its own
        t0 = time.perf_counter()
        out = self.dump_root() / ("candidate-isolated" if isolated else "candidate-repeat" if repeat else "candidate")
        meta = {**self.meta("candidate"), "mode": "isolated" if isolated else "propagated", "dtype": self.opts.dtype}
        self.progress.stage(f"{out.name.replace('-', ' ')} capture",
                            f"{self.opts.candidate}, {len(self.prompts)} prompts")
        if self.opts.candidate == "vllm":
            from vllm_parity.harness import vllm_side

            llm = self.llm()
            with self._explained():
                dump = vllm_side.capture(llm, self.arch, self.prompts, out, meta, taps=self.capture_taps(),
                                         isolate_from=None if feed is None else [feed, *feed_steps],
                                         decode_steps=self.decode_steps, forced=forced)
        else:
            from vllm_parity.harness import kernel_decode

            model = self._kernel_model()
            forwards = kernel_decode.forwards(len(self.prompts), self.decode_steps, self.opts.device == "cuda")
            with self.progress.layers(_decoder_layers(model), forwards):
                dump = kernel_decode.capture(model, self.arch, self.prompts, out, meta, wanted=self.wanted,
                                             decode_steps=self.decode_steps, forced=forced,
                                             isolate_from=None if feed is None else [feed, *feed_steps])
        self._seconds[out.name.replace("-", "_") + "_s"] = time.perf_counter() - t0
        return dump

    # -- judge, diagnose ----------------------------------------------------------------------------

    def judgement(self) -> Judgement:
        """A verdict per tap (once). A golden written by this run fails it after the comparison."""
        if self._judgement is None and self._error is None:
            capture = self.capture()
            self._judgement = self._remembered(lambda: self._judge(capture))
        if self._error is not None:
            raise self._error
        return self._judgement


    def _judge(self, capture: Capture) -> Judgement:
        if self.opts.compiled:
            judgement = Judgement([])
        else:
            taps = self.capture_taps()
            runs = (1 + (capture.isolated is not None)) * (1 + len(capture.steps))
            self.progress.stage("compare", f"{len(taps)} taps" + (", propagated and isolated" if capture.isolated
                                                                   is not None else "")
                                + (f", at the prefill and {len(capture.steps)} decode step(s)" if capture.steps
                                   else ""))
            judgement = stages.judge(capture, taps, self.taps(), self.tolerances, self.num_layers, self.arch,
                                     on_tap=self.progress.steps(runs * len(taps), "taps"))
            self.progress.stage("diagnose", f"{sum(r.role == 'source' for r in judgement.taps)} source(s)")
            self._diagnosis = stages.diagnose(judgement, capture, self.ckpt, self.arch,
                                              self.opts.tensor_parallel_size)
        if self._golden_error is not None:
            self._judgement = judgement  # the record still reports what was compared
            raise self._golden_error
        return judgement

    def diagnosis(self) -> Diagnosis:
        self.judgement()
        return self._diagnosis if self._diagnosis is not None else Diagnosis()

    # -- the golden reference -------------------------------------------------------------------

    def golden_dir(self, writing: bool = False) -> Path:
        from vllm_parity.harness import golden

        return golden.golden_path(Path(self.opts.root), golden.fixture_name(self.opts.model), writing=writing)

    def acquire_reference(self, tokens: list[list[int]] | None = None) -> tuple[DumpReader, list[DumpReader]]:
        """The live fp32 reference (with ``tokens``, its decode steps over them too), or the golden one with its
        decode steps over the reference's own greedy tokens (written, and the run failed, when missing)."""
        from vllm_parity.harness import golden

        if self.opts.against != "golden" and not self.opts.update_golden:
            return self._reference(tokens=tokens)
        dest = self.golden_dir(writing=True)
        if self.opts.against == "golden" and not self.opts.update_golden:
            try:
                self._golden = golden.load_golden(self.golden_dir(), self.model_sha256, prompts_sha256(self.prompts))
                return self._golden, self._golden.steps()[: self.decode_steps]
            except golden.GoldenMissing as exc:
                self._golden_error = golden.GoldenMissing(
                    f"{exc}; it was written now from the live reference, and this run checked nothing "
                    f"against it: commit {dest} and run again")
        if self.opts.level != "model" or self.opts.taps or self.opts.compiled:
            raise golden.GoldenError("a golden reference holds every tap: write it with --parity-level=model and "
                                     "neither --parity-taps nor --parity-compiled")
        live, steps = self._reference(own_steps=self.decode_steps)
        golden.write_golden(live, dest, extras={"greedy": self.reference_greedy()})
        self._checks["golden_written"] = {"passed": self._golden_error is None, "path": str(dest)}
        return live, steps

    def reference_greedy(self, n: int | None = None) -> list[list[int]]:
        """The reference's ``n`` (default ``--parity-greedy-tokens``) greedy tokens after each prompt."""
        n = self.opts.greedy_tokens if n is None else n
        if self._golden is not None:
            from vllm_parity.harness import golden

            tokens = golden.extras_of(self._golden).get("greedy")
            if tokens is None or len(tokens) != len(self.prompts) or any(len(t) < n for t in tokens):
                raise golden.GoldenError(f"{self._golden.root}: holds no greedy continuation of {n} tokens; "
                                         f"regenerate it with --parity-update-golden")
            return [t[:n] for t in tokens]
        if self._reference_tokens is None:
            raise RuntimeError("the reference's greedy continuation is made with its dump at --parity-level=model")
        return [t[:n] for t in self._reference_tokens]

    def unused_golden(self) -> list[str]:
        """Golden taps this run never read (reported only when every tap was compared)."""
        from vllm_parity.harness import golden

        if self._golden is None or self.opts.level != "model" or self.opts.taps or self.opts.compiled:
            return []
        return golden.unused_taps(self._golden, golden.read_taps(self._golden))

    # -- model-level checks ---------------------------------------------------------------------

    def routers(self) -> dict[int, str]:
        """The compared router-logits taps of the mixture-of-experts layers, by layer."""
        return {int(t.split(".")[1]): t for t in self.taps() if t.endswith(".moe.router")}

    def op_checks(self) -> list[str]:
        """The checks judged on op-level taps: routing agreement, where the model routes tokens to experts."""
        return ["routing"] if self.routers() else []

    def check(self, name: str) -> dict[str, Any]:
        """A check's result (once): ``greedy``, ``topk``, ``logprobs`` or ``routing``."""
        if name not in self._checks:
            self.judgement()
            from vllm_parity.harness import model_checks

            made = {"greedy": self._greedy_check, "topk": self._topk_check, "logprobs": self._logprobs_check,
                    "routing": self._routing_check}
            if name not in made:
                raise KeyError(f"no model-level check {name!r}; the checks are {sorted(made)}")
            self.progress.stage(f"check {name}")
            self._checks[name] = made[name](model_checks)
        return self._checks[name]

    def _greedy_check(self, model_checks) -> dict[str, Any]:
        """vLLM's greedy continuation against the reference's, token by token."""
        if self.opts.candidate == "vllm":
            from vllm_parity.harness.engine import generate

            outs = generate(self.llm(), self.prompts, max_tokens=self.opts.greedy_tokens)
            candidate = [list(o.outputs[0].token_ids) for o in outs]
        else:
            from vllm_parity.harness.kernel_decode import greedy

            candidate = [greedy(self._kernel_model(), ids, self.opts.greedy_tokens)[0] for ids in self.prompts]
        return model_checks.greedy(self.reference_greedy(), candidate, self._reference_logits, self._logit_tie())

    def _logit_tie(self) -> float:
        """Two tokens are tied for this candidate when their reference logits are closer than twice its
        largest logit error over the prompts (0 where the logits were not compared)."""
        try:
            logits = self.judgement()["logits"]
        except KeyError:
            return 0.0
        return 0.0 if logits.metrics is None else 2.0 * float(logits.metrics.max_abs)

    def _topk_check(self, model_checks) -> dict[str, Any]:
        capture = self.capture()
        return model_checks.topk(capture.reference, capture.candidate, self.opts.top_k)

    def _routing_check(self, model_checks) -> dict[str, Any]:
        """Whether both sides route every token to the same top-k experts, from their router logits."""
        capture, routers = self.capture(), self.routers()
        if not routers:
            raise KeyError(f"{self.model_dir}: no router taps compared in this run (a mixture-of-experts model, "
                           f"with --parity-taps including layers.*.moe.router)")
        k = int(self.ckpt.config["num_experts_per_tok"])
        tol = self.tolerances.resolve(next(iter(routers.values())), torch.float32)
        return model_checks.routing(capture.reference, capture.candidate, routers, k, tol)

    def _logprobs_check(self, model_checks) -> dict[str, Any]:
        from vllm_parity.harness.engine import generate

        k = self.opts.top_k
        outs = generate(self.llm(), self.prompts, max_tokens=1, prompt_logprobs=k)
        returned = [[None if e is None else {tok: lp.logprob for tok, lp in e.items()}
                     for e in (o.prompt_logprobs or [])] for o in outs]
        tol = self.tolerances.resolve("logprobs", getattr(torch, self.opts.dtype), self.activation_quantizers())
        return model_checks.logprobs(self.capture().reference, returned, k, tol)

    def _kernel_model(self):
        from vllm_parity.harness.kernel_candidate import build_kernel_model

        if self._kmodel is None:
            # its own reading of the files: one Checkpoint's tensors are views of one mapping of each file, and a
            # candidate writing its weights in place must not write the reference's
            self._kmodel = build_kernel_model(Checkpoint(self.model_dir), dtype=getattr(torch, self.opts.dtype),
                                              device=self.opts.device)
        return self._kmodel

    # -- the record -------------------------------------------------------------------------------

    def record(self) -> RunRecord | None:
        """The run's record from the stages made so far; None when it stopped before comparing."""
        judgement = self._judgement
        if judgement is None:
            return None
        capture = self._capture
        if "routing" not in self._checks and self._error is None and self.op_checks() and capture is not None \
                and capture.candidate is not None:
            self.check("routing")  # reported even where the funnel or a failing router skipped its item
        checks = dict(self._checks)
        if self._calibration is not None:
            checks["calibration"] = self._calibration[1]
        diagnosis = self._diagnosis if self._diagnosis is not None else Diagnosis()
        timings = {**self._seconds, "compare_s": judgement.seconds, "diagnose_s": diagnosis.seconds}
        run = {"id": self.id, "started": self.started, "model": str(self.model_dir), "format": self.format,
               "architecture": self.arch.model_type,
               "level": self.opts.level, "mode": self.mode, "dtype": self.opts.dtype,
               "prompts_sha256": prompts_sha256(self.prompts),
               "versions": capture.reference.manifest.get("versions", {}), "candidate": self.opts.candidate,
               "timings": timings, "against": self.opts.against, "model_sha256": self.model_sha256}
        if self.opts.mode == "auto" and self.why_isolated():
            run["mode_reason"] = self.why_isolated()
        run["decode_steps"] = len(capture.steps) if capture is not None else 0
        if any(r.kernels for r in judgement.taps):
            from vllm_parity.harness.compare import kernel_branches

            run["kernel_branches"] = kernel_branches(judgement.taps,
                                                     capture.candidate.manifest.get("kernel_branches", {}),
                                                     capture.candidate.manifest.get("kernel_untaken"))
        manifest = capture.candidate.manifest if capture is not None else {}
        schedule = {k: manifest[k] for k in ("waves", "prefix_cached", "prefill_chunks", "engine_features")
                    if k in manifest}
        if schedule:
            run["schedule"] = schedule
        if skipped := self.why_no_decode():
            run["decode_skipped"] = skipped
        if self._golden is not None:
            from vllm_parity.harness import golden

            run["golden"] = golden.describe(self._golden)
            run["unused_golden_taps"] = self.unused_golden()
        return RunRecord(run, judgement, diagnosis, checks)

    def finish(self) -> Finished:
        """Write the record (the report, and a snapshot when a tap failed); close the engine and temp dumps."""
        try:
            record, written = self.record(), None
            if record is not None:
                root = Path(self.opts.report_dir) if self.opts.report_dir else Path(self.opts.root) / "reports" / self.id
                self.progress.stage("write", str(root))
                record, written = stages.write(record, self._capture, root, self.opts.snapshot_dir, self.opts.command,
                                               self.opts.keep, self.opts.snapshot_max_gb, self.opts.trend)
            return Finished(record, self._error, written)
        finally:
            self.progress.done()
            if self._llm is not None:
                from vllm_parity.harness.engine import close_llm

                close_llm(self._llm)
                self._llm = None
            if self._tmp is not None:
                self._tmp.cleanup()


def _greedy_batch(model, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """``n`` greedy tokens after each prompt, and the logits each was chosen from: every prompt in one forward a
    token (right-padded: under the causal mask no prompt's last row sees a padded one)."""
    seqs = [list(ids) for ids in prompts]
    steps: list[list[torch.Tensor]] = [[] for _ in seqs]
    device = next(model.parameters()).device
    with torch.no_grad():
        for _ in range(n):
            width = max(len(s) for s in seqs)
            x = torch.zeros(len(seqs), width, dtype=torch.long)
            for p, s in enumerate(seqs):
                x[p, :len(s)] = torch.tensor(s, dtype=torch.long)
            logits = model(x.to(device), use_cache=False).logits
            for p, s in enumerate(seqs):
                row = logits[p, len(s) - 1].float().cpu()
                steps[p].append(row)
                s.append(int(row.argmax()))
    return [s[len(ids):] for s, ids in zip(seqs, prompts)], steps


def _decoder_layers(model) -> list:
    """A transformers model's decoder layers (none where it keeps them elsewhere: no steps then)."""
    return list(getattr(getattr(model, "model", None), "layers", []))


def _default_model() -> Path:
    from vllm_parity.fixtures.default_model import default_model_dir

    return default_model_dir()

