"""Diagnosis hints: a likely cause for a failing tap, read from the shape of its error.

Two kinds of evidence, and a cause is claimed only with one of them:

- Concrete hypotheses for a projection tap with a :class:`LinearContext`: the weight a faulty kernel
  would use is rebuilt from the stored tensors (bit order flipped, layout swapped, another code table,
  the scale dropped, inverted or rounded, another group size, group scales in another order), or the
  output otherwise (the bias missing or another, the input quantized another way), its output computed
  from the reference's input, and compared with the candidate channel by channel. A hypothesis holds when it
  leaves at most a tenth of each output channel's deviation from the reference unexplained, for at
  least 90 % of the channels; hypotheses are screened on a sample of rows and channels first and
  only the survivors are checked on the whole tap.
- Error-shape statistics that need no weight: slices of a fused projection found elsewhere in the
  reference, an error confined to one tensor-parallel shard, an error growing steadily with depth.

A projection tap that deviates with no hypothesis holding gets one ``undecided`` hint instead: what was
checked, each with the least residual it left (:func:`ruled_out`, which other taps' hints use too).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from vllm_parity.reference.linear import ACTIVATION_QUANT, ReferenceLinear

KINDS = ("code_table", "bit_order", "pack_layout", "scale_missing", "scale_inverted", "scale_dtype",
         "group_size", "slices_swapped", "tp_shard", "drift", "int8_saturation", "scale_wrong", "scale_groups",
         "zero_point", "bias", "activation_quant", "undecided")
KINDS += ("norm_epsilon", "rope", "routing")  # the hints of norm, attention and router taps (op_hints)
KINDS += ("packing_order", "g_idx_ignored")  # 4-bit words read in another field order; g_idx read by position
KINDS += ("kv_cache",)  # keys / values attention read at a decode step that are not those its projections made

EXPLAINED = 0.1  # a channel is explained when the residual is at most this share of its deviation
MIN_SHARE = 0.9  # ... for at least this share of the channels
SCREEN = 0.3  # the sample's residual share a hypothesis must reach to be checked on the whole tap
NOISE_FLOOR = 1e-4  # relative per-channel error read as noise whatever the dtype (fp32 accumulation)
NOISE_CAP = 0.02  # an error above this is never read as noise, however noisy the tap
RECONSTRUCT = 1e-3  # relative error within which x @ W^T must reproduce the reference's own output
SCREEN_ROWS, SCREEN_CHANNELS = 64, 256
CHUNK_ELEMS = 1 << 23  # weight elements rebuilt at a time when a hypothesis is checked on every channel
MATCH_REL = 0.05  # a candidate column equals a reference column within this relative error
MATCH_COS = 0.999
SLICE_SAMPLES = 64
DRIFT_MIN_GROWTH = 2.0  # last / first error of a drift
# The same for a relative error: normalized by a signal that itself grows with depth, it grows less.
DRIFT_MIN_GROWTH_RELATIVE = 1.5
DRIFT_RISING = 0.7  # share of layer-to-layer steps that must not fall
JUMP_MIN = 2.5  # a step of at least this factor that also dwarfs the typical step is a jump
# How a tap's tensor is spread over tensor-parallel ranks (what the vLLM side records per tap): "row" outputs
# are all-reduced partial sums; the others are gathered along the features, one block per rank.
COLUMN_PARALLEL = ("column", "column_kv", "vocab")
_SLICE_ORDER = ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Hint:
    tap: str
    kind: str
    evidence: str
    fix: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"hint kind {self.kind!r} is not one of {list(KINDS)}")

    def as_dict(self) -> dict:
        return {"tap": self.tap, "kind": self.kind, "evidence": self.evidence, "fix": self.fix}


@dataclass
class LinearContext:
    """What is known about the projection behind an op tap (None where unknown)."""

    module: str | None = None  # e.g. "model.layers.3.mlp.down_proj"
    ref_input: torch.Tensor | None = None  # (rows, K): the reference's input, same rows as the tap
    linear: ReferenceLinear | None = None
    biases: dict[str, torch.Tensor] | None = None  # the other projections' biases of its layer, by module


def linear_context(ckpt, module: str, ref_input: torch.Tensor | None, served: str | None = None) -> LinearContext:
    """The reference linear of ``module`` with its float bias (where the family has one) and the biases of its
    layer's other projections (a kernel may add the wrong one); ``served``: the candidate's dtype, in which its
    activations reach their quantizer."""
    from vllm_parity.reference.linear import read_stored

    spec = ckpt.spec
    shapes = ckpt.linear_shapes()
    n, k = shapes[module]
    parent = module.rsplit(".", 2)[0]
    biases = {m: ckpt.tensor(f"{m}.bias").to(torch.float32) for m in shapes
              if m.startswith(parent + ".") and f"{m}.bias" in ckpt}
    half = served in ("bfloat16", "float16")
    lin = ReferenceLinear(module, spec, read_stored(ckpt, module, spec, n, k), n, k, bias=biases.get(module),
                          activations_in=getattr(torch, served) if half else None)
    return LinearContext(module, ref_input, lin, {m: b for m, b in biases.items() if m != module} or None)


# -- small helpers ------------------------------------------------------------------------------


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Diagnosis runs hundreds of small tensor ops; on a loaded machine every parallel region of an
    intra-op pool waits for busy cores (about 0.1 s per op on two shared cores), one thread does not."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _single_threaded(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _one_thread():
            return fn(*args, **kwargs)
    return wrapper


def _rows(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dim() == 0:
        raise ValueError(f"{what}: expected a (rows, features) tensor, got a scalar")
    t = t.detach().to(torch.float64)
    return t.reshape(-1, 1) if t.dim() == 1 else t.reshape(-1, t.shape[-1])


def _noise(*dtypes: torch.dtype) -> float:
    """Relative per-channel error that the tensors' own dtypes can produce."""
    eps = max((torch.finfo(d).eps for d in dtypes if d.is_floating_point), default=0.0)
    return max(NOISE_FLOOR, 8 * eps)


def _g(v: float) -> str:
    return f"{v:.3g}"


def _pct(part: int, whole: int) -> str:
    return f"{part} of {whole} ({math.floor(100.0 * part / max(whole, 1))} %)"  # 999 of 1000 is not 100 %


def _suffix(tap: str) -> str:
    m = _LAYER.match(tap)
    return m.group(2) if m else tap


def _sample(n: int, k: int) -> torch.Tensor:
    return torch.linspace(0, n - 1, min(n, k)).round().long().unique()


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """Inclusive (start, end) of each run of True."""
    m = torch.cat([torch.tensor([False]), mask.bool(), torch.tensor([False])]).to(torch.int8)
    edges = torch.diff(m)
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    return [(s, e - 1) for s, e in zip(starts, ends)]


def _signed(v: int | None) -> str:
    return "null" if v is None else f"{v:+d}" if v else "0"


# -- hypotheses about the weight of one projection ----------------------------------------------


@dataclass
class _Hyp:
    kind: str
    what: str  # the claim, as it reads in the evidence
    fix: str
    factor: torch.Tensor | None = None  # (N,) float64: candidate = reference x factor, per channel
    rows: Callable[[torch.Tensor], torch.Tensor] | None = None  # channel indices -> W' rows (fp32)
    # (channel indices, row indices) -> the candidate's product predicted otherwise than by a weight (float64;
    # the reference's bias is added to it)
    output: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    offset: torch.Tensor | None = None  # (N,) float64: candidate = reference + offset, on every row


@dataclass
class _Score:
    share: float  # residual / deviation, over the valid channels
    valid: int
    consistent: int
    deviating: int
    explained: int
    rel_pred: float
    rel_ref: float

    def holds(self) -> bool:
        return (self.valid > 0 and self.deviating > 0 and self.explained >= MIN_SHARE * self.deviating
                and self.consistent >= MIN_SHARE * self.valid)


class WeightProjection:
    """One projection's tap with its reference linear: builds and checks weight hypotheses. The generic
    ones are about the scale; a format's module of :mod:`vllm_parity.harness.formats` subclasses this
    with its stored scale and its own hypotheses (layouts, code tables, ...)."""

    def __init__(self, tap: str, ref: torch.Tensor, cand: torch.Tensor, ctx: LinearContext, noise: float):
        lin = ctx.linear
        self.tap, self.ref, self.cand, self.noise = tap, ref, cand, noise
        self.spec = lin.spec
        self.n, self.k = int(lin.out_features), int(lin.in_features)
        self.module = ctx.module or getattr(lin, "name", "the projection")
        if ref.shape[1] != self.n:
            raise ValueError(f"{tap}: {ref.shape[1]} features, but {self.module} has out_features {self.n}")
        self.lin = lin
        self._weight: torch.Tensor | None = None
        self._sample_idx: torch.Tensor | None = None
        self._sample_values: dict = {}
        self.x = self.post = self.x_raw = None
        bias = getattr(lin, "bias", None)
        self.bias = None if bias is None else bias.detach().reshape(-1).to(torch.float64)
        self.other_biases = {m: b.detach().reshape(-1).to(torch.float64) for m, b in (ctx.biases or {}).items()}
        self.quant = getattr(lin, "activation_quant", None)
        self.checked: list[tuple[str, float]] = []  # (hypothesis, residual share on the sample): what was ruled out
        self.reconstructed: bool | None = None
        if ctx.ref_input is not None:
            x = ctx.ref_input.detach().to(torch.float32).reshape(-1, ctx.ref_input.shape[-1])
            if tuple(x.shape) != (ref.shape[0], self.k):
                raise ValueError(f"{tap}: ref_input has shape {tuple(x.shape)}, expected "
                                 f"({ref.shape[0]}, {self.k}) (the tap's rows, in_features of {self.module})")
            if self.quant is not None and getattr(lin, "activations_in", None) is not None:
                x = x.to(lin.activations_in).to(torch.float32)  # as the reference's own quantizer takes it
            self.x_raw = x
            if self.quant is not None:
                x, self.post = ACTIVATION_QUANT[self.quant](x)
            self.x = x
        dev = cand - ref
        self.dev = torch.where(torch.isfinite(dev), dev, torch.full_like(dev, math.inf))
        self.dev_ch = self.dev.norm(dim=0)
        self.size_ch = torch.maximum(ref.norm(dim=0), torch.nan_to_num(cand, 0.0, 0.0, 0.0).norm(dim=0))
        self.size_ch = self.size_ch.clamp_min(1e-30)
        # the format's scale, as its module of vllm_parity.harness.formats reads it
        self.scale_stored: torch.Tensor = torch.ones(1)
        self.scale_mode, self.granularity = "multiply", "tensor"

    @functools.cached_property
    def scale(self) -> torch.Tensor:
        return self.scale_stored.to(torch.float32)

    @staticmethod
    def build(tap, ref, cand, ctx, noise) -> WeightProjection | None:
        """The projection of the linear's format (None: no linear); a format without a module of its own gets
        the hypotheses that need no knowledge of it (a scale off by a factor per channel)."""
        if ctx is None or ctx.linear is None:
            return None
        from vllm_parity.harness.formats import projection_for

        cls = projection_for(ctx.linear.spec.quant_method)
        return (cls or WeightProjection)(tap, ref, cand, ctx, noise)  # a format of its own: the generic hypotheses

    # -- what a format's module adds --

    def format_hypotheses(self, generic: list[_Hyp], idx: torch.Tensor, rsel: torch.Tensor) -> list[_Hyp]:
        """Every hypothesis to test, given the generic (scale) ones, when the reference is reconstructed."""
        return generic

    def decodes_alike(self, idx: torch.Tensor, w: torch.Tensor) -> bool:
        """The format module's own decoding of these channels agrees with the reference linear's weight."""
        return True

    def weight(self) -> torch.Tensor:
        if self._weight is None:
            self._weight = self.lin.weight().to(torch.float32)
        return self._weight

    # -- decoding under a hypothesis --

    # -- the hypotheses --

    def _scale_hyps(self) -> list[_Hyp]:
        mode, gran = self.scale_mode, self.granularity
        stored = str(self.scale_stored.dtype).removeprefix("torch.")
        s = self.scale.to(torch.float64)
        per = {"tensor": "for the one tensor scale", "channel": "per output channel",
               "group": "per group of inputs"}[gran]
        out = []
        missing_fix = (f"apply the weight scale ({'multiply' if mode == 'multiply' else 'divide'} by s, "
                       f"scale_mode '{mode}') in the kernel or linear method of {self.module}")
        inv_fix = (f"{'multiply by' if mode == 'multiply' else 'divide by'} the scale as scale_mode "
                   f"'{mode}' says; the kernel of {self.module} "
                   f"{'divides by' if mode == 'multiply' else 'multiplies by'} it")
        rounded = []
        for dt, name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
            r = self.scale.to(dt).to(torch.float32)
            if torch.equal(r, self.scale):
                continue  # already exact in that dtype: rounding cannot be the fault
            if rounded and torch.equal(r, rounded[-1][1]):
                rounded[-1] = (f"{rounded[-1][0]} (or {name}, the same values here)", r)
                continue
            rounded.append((name, r))
        if mode == "divide":  # a kernel that multiplies by a precomputed 1/s may keep that in half precision
            for dt, name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
                inv = (1.0 / self.scale.to(torch.float64)).to(torch.float32)
                r = (1.0 / inv.to(dt).to(torch.float64)).to(torch.float32)
                if not torch.equal(inv.to(dt).to(torch.float32), inv):
                    rounded.append((f"{name} as its reciprocal 1/s (which the kernel multiplies by)", r))
        dtype_fix = (f"keep the scale in its stored dtype ({stored}) or fp32 up to the product in "
                     f"{self.module}; the kernel rounds it to {{}}")
        if gran == "group" and not hasattr(self, "_rows_fn"):
            return out  # group scales need the format's own decoding under a hypothesis (its _rows_fn)
        if gran == "group":  # the scale varies along the input: the weight itself must be rebuilt
            out.append(_Hyp("scale_missing", "the weight decoded without its group scales", missing_fix,
                            rows=self._rows_fn(mode=None)))
            inv = "divide" if mode == "multiply" else "multiply"
            as_what = "divisors where scale_mode 'multiply' multiplies" if inv == "divide" else \
                "factors where scale_mode 'divide' divides"
            out.append(_Hyp("scale_inverted", f"the group scales applied as {as_what}", inv_fix,
                            rows=self._rows_fn(mode=inv)))
            for name, r in rounded:
                out.append(_Hyp("scale_dtype", f"the weight decoded with its {stored} group scales rounded to {name}",
                                dtype_fix.format(name.split(" ")[0]), rows=self._rows_fn(scale=r)))
            return out
        s_ch = s.reshape(1).expand(self.n) if gran == "tensor" else s
        with torch.no_grad():
            if mode == "multiply":
                facts = [("scale_missing", 1 / s_ch, "reference × 1/s", "the scale never applied"),
                         ("scale_inverted", 1 / s_ch ** 2, "reference × 1/s²",
                          "the scale applied as a divisor where scale_mode 'multiply' multiplies")]
            else:
                facts = [("scale_missing", s_ch.clone(), "reference × s", "the scale never applied"),
                         ("scale_inverted", s_ch ** 2, "reference × s²",
                          "the scale applied as a factor where scale_mode 'divide' divides")]
        for kind, f, formula, why in facts:
            out.append(_Hyp(kind, f"candidate ≡ {formula} {per} ({self._factor_range(f)}): {why}",
                            missing_fix if kind == "scale_missing" else inv_fix, factor=f))
        for name, r in rounded:
            r_ch = r.to(torch.float64)
            r_ch = r_ch.reshape(1).expand(self.n) if gran == "tensor" else r_ch
            f = r_ch / s_ch if mode == "multiply" else s_ch / r_ch
            ratio = "round(s)/s" if mode == "multiply" else "s/round(s)"
            out.append(_Hyp("scale_dtype", f"candidate ≡ reference × {ratio} {per} ({self._factor_range(f)}): "
                            f"the {stored} scale rounded to {name}", dtype_fix.format(name.split(" ")[0]),
                            factor=f))
        return out

    @staticmethod
    def _factor_range(f: torch.Tensor) -> str:
        fin = f[torch.isfinite(f)]
        if not fin.numel():
            return "factor not finite"
        lo, hi = float(fin.min()), float(fin.max())
        return f"factor {lo:.6g}" if lo == hi else f"factor {lo:.6g} to {hi:.6g}"

    # -- evaluation --

    def _product(self, rsel: torch.Tensor, w: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        """The candidate's output from weight rows ``w``; with their channel indices ``idx``, the bias added."""
        out = F.linear(self.x[rsel], w)
        if self.post is not None:
            out = out / self.post[rsel]
        return self._biased(out.to(torch.float64), idx)

    def _biased(self, out: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
        return out if self.bias is None or idx is None else out + self.bias[idx]

    def _predict(self, h: _Hyp, idx: torch.Tensor, rsel: torch.Tensor) -> torch.Tensor:
        if h.factor is not None:
            return self.ref[rsel][:, idx] * h.factor[idx]
        if h.offset is not None:
            return self.ref[rsel][:, idx] + h.offset[idx]
        if h.output is not None:
            return self._biased(h.output(idx, rsel), idx)
        step = max(1, CHUNK_ELEMS // max(self.k, 1))
        return torch.cat([self._product(rsel, h.rows(idx[i:i + step]), idx[i:i + step])
                          for i in range(0, len(idx), step)], 1)

    def _screen_sample(self, channels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.ref.shape[0]
        rsel = _sample(rows, SCREEN_ROWS)
        if len(channels) <= SCREEN_CHANNELS:
            return channels, rsel
        rel = torch.nan_to_num(self.dev_ch[channels] / self.size_ch[channels], posinf=1e300)
        top = channels[torch.topk(rel, SCREEN_CHANNELS // 2).indices]
        even = channels[_sample(len(channels), SCREEN_CHANNELS // 2)]
        return torch.unique(torch.cat([top, even])), rsel

    def _screen_share(self, pred: torch.Tensor) -> float:
        """Residual / deviation on the screening sample (its channels with a finite prediction)."""
        valid = torch.isfinite(pred).all(0)
        if int(valid.sum()) < 0.5 * pred.shape[1]:
            return math.inf
        c, r = self._sample_c[:, valid], self._sample_r[:, valid]
        dev = float((c - r).norm())
        return float((c - pred[:, valid]).norm()) / dev if dev > 0 else math.inf

    def _score(self, pred: torch.Tensor, idx: torch.Tensor) -> _Score:
        c, r = self.cand[:, idx], self.ref[:, idx]
        valid = torch.isfinite(pred).all(0) & torch.isfinite(c).all(0)
        res = (c - pred).norm(dim=0)
        dev = self.dev_ch[idx]
        size = self.size_ch[idx]
        rel_res = (res / size)[valid]
        # the tap's own noise, read off the channels this hypothesis fits best (capped: no fault hides as noise)
        noise = max(self.noise, min(3 * float(rel_res.median()) if rel_res.numel() else 0.0, NOISE_CAP))
        ok = valid & (res <= torch.maximum(EXPLAINED * dev, noise * size))
        deviating = valid & (dev > noise * size)
        v = valid
        dev_v = float(dev[v].norm())
        return _Score(
            share=float(res[v].norm()) / dev_v if dev_v > 0 else math.inf,
            valid=int(v.sum()), consistent=int(ok.sum()), deviating=int(deviating.sum()),
            explained=int((ok & deviating).sum()),
            rel_pred=float(res[v].norm() / c[:, v].norm().clamp_min(1e-300)),
            rel_ref=float(dev[v].norm() / r[:, v].norm().clamp_min(1e-300)))

    def _reconstructs(self, idx: torch.Tensor, rsel: torch.Tensor) -> bool:
        """The reference's input and weight give the reference's output (else nothing can be rebuilt)."""
        if self.x is None:
            return False
        w = self.weight()[idx]
        r = self.ref[rsel][:, idx]  # (also called before a screening sample exists)
        if float((self._product(rsel, w, idx) - r).norm()) > RECONSTRUCT * float(r.norm()):
            return False
        return self.decodes_alike(idx, w)

    def hints(self, channels: torch.Tensor | None = None, where: str = "") -> list[Hint]:
        channels = torch.arange(self.n) if channels is None else channels
        if not bool((self.dev_ch[channels] > self.noise * self.size_ch[channels]).any()):
            return []
        idx, rsel = self._screen_sample(channels)
        self._sample_idx, self._sample_values = idx, {}
        self._sample_c, self._sample_r = self.cand[rsel][:, idx], self.ref[rsel][:, idx]
        from vllm_parity.harness import hypotheses  # (it builds on this module's _Hyp)

        hyps = self._scale_hyps()
        self.reconstructed = self._reconstructs(idx, rsel)
        if self.reconstructed:
            hyps = self.format_hypotheses(hyps, idx, rsel) + hypotheses.regrouped(self, idx, rsel) \
                + hypotheses.activation(self)
        else:
            hyps = [h for h in hyps if h.factor is not None]
        hyps += hypotheses.bias(self)
        survivors = []
        for h in hyps:
            share = self._screen_share(self._predict(h, idx, rsel))
            self.checked.append((h.kind, share))
            if share <= SCREEN:
                survivors.append(h)
        rows_all = torch.arange(self.ref.shape[0])
        found = []
        for h in survivors:
            sc = self._score(self._predict(h, channels, rows_all), channels)
            if sc.holds():
                found.append((sc.share, h, sc))
        if not found:  # the candidate as the reference times a factor, or plus an offset, fitted per channel
            fitted = [self._fitted_scale_hyp(channels)]
            for h in fitted + [hypotheses.fitted_offset(self, channels)]:
                sc = None if h is None else self._score(self._predict(h, channels, rows_all), channels)
                if sc is not None and sc.holds() and sc.share <= SCREEN:  # (fitted: it must explain most of it)
                    found.append((sc.share, h, sc))
                elif sc is not None:
                    self.checked.append((h.kind, sc.share))
        found.sort(key=lambda t: t[0])
        return [Hint(self.tap, h.kind, self._evidence(h, sc, where), h.fix) for _, h, sc in found]

    def undecided(self) -> Hint | None:
        """What was ruled out, when the tap deviates and no hypothesis holds (None: nothing was checked)."""
        if not self.checked:
            return None
        why = "" if self.reconstructed else (
            "; the weight hypotheses were not checked: " + ("no input of the projection was recorded"
                                                             if self.x is None else
                                                             "the reference's input and weight do not reproduce "
                                                             "the reference's output here"))
        return ruled_out(self.tap, self.checked, why=f" ({self.module}){why}", next_step=(
            f"the error of {self.module} has none of the checked shapes: if the tap's input already differs, look "
            f"upstream (in isolated mode, fed the reference's input, is it still a source?); else open its snapshot "
            f"(parity debug, --parity-pdb) and compare the kernel's weight, scale and bias with the reference "
            f"linear's, channel by channel"))

    def _fitted_scale_hyp(self, channels: torch.Tensor) -> _Hyp | None:
        """The candidate as the reference times its own least-squares factor per output channel, when the
        channels that deviate do so by a factor (a scale loaded or applied wrong, none of the named ways)."""
        r, c = self.ref[:, channels].to(torch.float64), self.cand[:, channels].to(torch.float64)
        f = torch.ones(self.n, dtype=torch.float64)
        f[channels] = (c * r).sum(0) / (r * r).sum(0).clamp_min(1e-300)
        off = channels[(f[channels] - 1).abs() > max(self.noise, 1e-3)]
        if not len(off) or not bool(torch.isfinite(f).all()) or bool((f[off].abs() < 1e-2).any()):
            return None  # (an output zeroed or never written is no scale)
        vals = f[off]
        factor = f"× {float(vals[0]):.4g}" if float(vals.max() - vals.min()) <= 1e-3 * float(vals.abs().max()) \
            else f"× {float(vals.min()):.4g} to {float(vals.max()):.4g}"
        listed = ", ".join(str(int(i)) for i in off[:8]) + (", …" if len(off) > 8 else "")
        return _Hyp("scale_wrong",
                    f"candidate ≡ reference × a factor per output channel: {len(off)} of {len(channels)} channel(s) "
                    f"{factor} (channels {listed}), the rest × 1 — the scale applied there is not the stored one",
                    f"check how {self.module} loads and applies its weight scale for those channels (the stored "
                    f"scale times the factor is what the candidate used)", factor=f)

    def _evidence(self, h: _Hyp, sc: _Score, where: str) -> str:
        return (f"{self.tap} ({self.module}): {where}{h.what}; the candidate matches this prediction on "
                f"{_pct(sc.consistent, sc.valid)} output channels, {sc.explained} of the {sc.deviating} "
                f"deviating ones explained: relative error {_g(sc.rel_pred)} against the prediction, "
                f"{_g(sc.rel_ref)} against the reference (residual {_g(sc.share)} of the deviation)")

    # -- tensor parallelism: a row-parallel rank's partial sum --

    def partial_sum_hints(self, tp: int) -> list[Hint]:
        if self.x is None or self.k % tp:
            return []
        rows_all = torch.arange(self.ref.shape[0])
        if not self._reconstructs(_sample(self.n, SCREEN_CHANNELS), _sample(self.ref.shape[0], SCREEN_ROWS)):
            return []
        dev = self.dev
        dn = float(dev.norm())
        if not math.isfinite(dn) or dn <= self.noise * float(self.ref.norm()):
            return []
        w, width = self.weight(), self.k // tp
        best = None
        for r in range(tp):
            cols = slice(r * width, (r + 1) * width)
            out = F.linear(self.x[rows_all][:, cols], w[:, cols])
            part = (out / self.post if self.post is not None else out).to(torch.float64)
            pp = float((part * part).sum())
            if pp <= 0:
                continue
            alpha = float((dev * part).sum()) / pp
            share = float((dev - alpha * part).norm()) / dn
            if best is None or share < best[0]:
                best = (share, r, alpha)
        if best is None or best[0] > EXPLAINED or abs(best[2]) < 0.05:
            return []
        share, r, alpha = best
        a, b = r * width, (r + 1) * width - 1
        if abs(alpha + 1) < 0.05:
            what, fix = "is missing from the sum", "check that every rank's partial sum reaches the all-reduce"
        elif abs(alpha - 1) < 0.05:
            what, fix = "is counted twice", "check that the all-reduce (or the bias / residual) is applied once"
        else:
            what, fix = (f"is scaled by {1 + alpha:.4g}", f"check rank {r}'s weight shard and scale "
                         f"(input features {a}..{b} of {self.module})")
        return [Hint(self.tap, "tp_shard",
                     f"{self.tap} ({self.module}, row-parallel, tp {tp}): candidate − reference ≡ {alpha:+.4g} × "
                     f"rank {r}'s partial sum (input features {a}..{b}) with residual {_g(share)} of the "
                     f"deviation: that rank's contribution {what}",
                     f"{fix}; rank {r} of {tp}, {self.module}")]


def ruled_out(tap: str, checked: list[tuple[str, float]], why: str = "", next_step: str = "",
              criterion: str = f"a cause holds at {EXPLAINED} on {MIN_SHARE:.0%} of the channels") -> Hint:
    """The ``undecided`` hint of a failing tap no hypothesis explains: each checked kind with the least
    residual any of its hypotheses left (a share of the deviation: 0 explains it, 1 explains nothing)."""
    best: dict[str, float] = {}
    for kind, share in checked:
        share = float(share) if math.isfinite(float(share)) else math.inf
        best[kind] = min(best.get(kind, math.inf), share)
    listed = ", ".join(f"{k} {_g(v) if math.isfinite(v) else 'no finite prediction'}"
                       for k, v in sorted(best.items(), key=lambda t: (t[1], t[0])))
    return Hint(tap, "undecided",
                f"{tap}: no checked cause explains the error{why}; ruled out, with the least residual each left "
                f"(share of the deviation; {criterion}): "
                f"{listed or 'nothing could be checked'}",
                next_step or f"look at the kernel behind {tap}: none of the checked causes holds")


# -- error shapes that need no weight -----------------------------------------------------------


def _column_shard_hints(tap: str, ref: torch.Tensor, cand: torch.Tensor, tp: int,
                        noise: float) -> tuple[list[Hint], list[tuple[int, torch.Tensor]]]:
    """The error confined to some (not all) of ``tp`` contiguous blocks of the features."""
    rows, n = ref.shape
    if tp <= 1 or n % tp or n < tp:
        return [], []
    w = n // tp
    dev = cand - ref
    dev = torch.where(torch.isfinite(dev), dev, torch.full_like(dev, math.inf))
    err = dev.reshape(rows, tp, w).pow(2).sum(dim=(0, 2)).sqrt()
    size = torch.maximum(ref.reshape(rows, tp, w).pow(2).sum(dim=(0, 2)),
                         torch.nan_to_num(cand, 0.0, 0.0, 0.0).reshape(rows, tp, w).pow(2).sum(dim=(0, 2)))
    rel = err / size.sqrt().clamp_min(1e-30)
    worst = float(rel.max())
    if not worst > noise:
        return [], []
    if math.isfinite(worst):
        bad = rel > max(noise, 0.01 * worst)
    else:  # non-finite values: the other shards are clean only when near the reference
        bad = ~torch.isfinite(rel) | (rel > max(noise, NOISE_CAP))
    nbad = int(bad.sum())
    if nbad == 0 or nbad == tp:
        return [], []
    clean = float(rel[~bad].max())
    hints, shards = [], []
    finite_energy = torch.nan_to_num(err, posinf=1e300).pow(2)
    for r in bad.nonzero().flatten().tolist():
        a, b = r * w, (r + 1) * w
        cols = torch.arange(a, b)
        c, rr = cand[:, a:b], ref[:, a:b]
        note = ""
        if bool(torch.isfinite(c).all()):
            if float(c.abs().max()) == 0.0:
                note = "; the candidate's shard is all zeros (never written or not gathered)"
            else:
                for q in range(tp):
                    other = ref[:, q * w:(q + 1) * w]
                    if q != r and float((c - other).norm()) <= MATCH_REL * float(other.norm()):
                        note = f"; it holds rank {q}'s values (the gather order is wrong)"
                        break
                if not note and float((rr * rr).sum()) > 0:
                    alpha = float((c * rr).sum() / (rr * rr).sum())
                    if float((c - alpha * rr).norm()) <= EXPLAINED * float((c - rr).norm()):
                        note = f"; it is the reference's shard × {alpha:.4g}"
        else:
            note = f"; {int((~torch.isfinite(c)).sum())} non-finite values there"
        share = float(finite_energy[r] / finite_energy.sum()) if float(finite_energy.sum()) > 0 else 1.0
        hints.append(Hint(
            tap, "tp_shard",
            f"{tap}: the error is confined to features {a}..{b - 1}, rank {r} of {tp}'s shard: relative "
            f"error {_g(float(rel[r]))} there, at most {_g(clean)} in the {tp - nbad} clean shard(s) "
            f"({100 * share:.1f} % of the error energy){note}",
            f"check rank {r}'s shard: the weight loader's offset and size along the output features "
            f"(for a packed output axis, bytes hold 4 channels and a blocked layout does not shard "
            f"contiguously), its scales, and the order in which ranks' outputs are gathered"))
        shards.append((r, cols))
    return hints, shards


def _slice_key(tap: str) -> int:
    s = _suffix(tap)
    return _SLICE_ORDER.index(s) if s in _SLICE_ORDER else len(_SLICE_ORDER)


def _slices_hints(tap: str, ref: torch.Tensor, cand: torch.Tensor,
                  siblings: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> list[Hint]:
    """Candidate columns that equal other columns of the fused reference [q | k | v] or [gate | up]; the
    slices are in the order of ``siblings`` when it lists ``tap`` too, else in the vocabulary's order."""
    rows, w = cand.shape
    ordered = tap in siblings
    refs = {tap: ref}
    for name, pair in siblings.items():
        if name == tap:
            continue  # its reference is ``ref``
        r = _rows(pair[0], f"sibling {name}")
        if r.shape[0] != rows:
            raise ValueError(f"sibling {name} has {r.shape[0]} rows, {tap} has {rows}")
        refs[name] = r
    if rows < 4 or len(refs) < 2:
        return []  # too few rows to tell columns apart
    names = [nm for nm in siblings if nm in refs] if ordered else sorted(refs, key=lambda t: (_slice_key(t), t))
    starts, pos = {}, 0
    for nm in names:
        starts[nm] = pos
        pos += refs[nm].shape[1]
    fused = torch.cat([refs[nm] for nm in names], dim=1)
    own = starts[tap]
    f_norm = fused.norm(dim=0)
    tiny = 1e-12 * float(f_norm.max()) if f_norm.numel() else 0.0
    js = _sample(w, SLICE_SAMPLES)
    cs = torch.nan_to_num(cand[:, js], 0.0, 0.0, 0.0)
    c_norm = cs.norm(dim=0)
    live = c_norm > tiny
    cos = (cs / c_norm.clamp_min(1e-300)).t() @ (fused / f_norm.clamp_min(1e-300))
    cos = torch.where((f_norm > tiny)[None, :], cos, torch.full_like(cos, -2.0))
    best_cos, best = cos.max(dim=1)
    own_cos = cos[torch.arange(len(js)), own + js]
    best = torch.where(own_cos >= best_cos - 1e-9, own + js, best)
    close = (cs - fused[:, best]).norm(dim=0) <= MATCH_REL * f_norm[best]
    matched = live & (best_cos >= MATCH_COS) & close
    offsets = best - (own + js)
    moved = matched & (offsets != 0)
    if not bool(moved.any()):
        return []
    segments = []  # (cand start, cand end, fused offset)
    for off in sorted(set(offsets[moved].tolist())):
        jj = torch.arange(w)
        src = own + jj + off
        inside = (src >= 0) & (src < fused.shape[1])
        ok = torch.zeros(w, dtype=torch.bool)
        ji, si = jj[inside], src[inside]
        diff = (torch.nan_to_num(cand[:, ji], 0.0, 0.0, 0.0) - fused[:, si]).norm(dim=0)
        ok[ji] = (diff <= MATCH_REL * f_norm[si]) & (f_norm[si] > tiny)
        hit = set(js[moved & (offsets == off)].tolist())
        segments += [(a, b, off) for a, b in _runs(ok) if any(a <= j <= b for j in hit)]
    if not segments:
        return []
    parts, covered, worst = [], 0, 0.0
    for a, b, off in sorted(segments):
        covered += b - a + 1
        src = torch.arange(a, b + 1) + own + off
        err = (torch.nan_to_num(cand[:, a:b + 1], 0.0, 0.0, 0.0) - fused[:, src]).norm(dim=0) / f_norm[src]
        worst = max(worst, float(err.max()))
        # name the source per reference tap: a run may cross from one slice into the next
        for nm in names:
            lo, hi = starts[nm], starts[nm] + refs[nm].shape[1] - 1
            sa, sb = max(a + own + off, lo), min(b + own + off, hi)
            if sa > sb:
                continue
            ca, cb = sa - own - off, sb - own - off
            parts.append(f"columns {ca}..{cb} ≡ reference {_suffix(nm)} columns {sa - lo}..{sb - lo}")
    fused_name = "qkv_proj [q | k | v]" if _suffix(tap).startswith("attn.") else "gate_up_proj [gate | up]"
    sizes = ", ".join(f"{_suffix(nm)} {refs[nm].shape[1]}" for nm in names)
    return [Hint(
        tap, "slices_swapped",
        f"{tap}: {covered} of {w} candidate columns are other columns of the fused reference "
        f"{fused_name} (relative error at most {_g(worst)} per column): " + "; ".join(parts),
        f"check the order and sizes of the slices of the fused {fused_name} in the weight loader and in "
        f"the split of its output (sizes {sizes})")]


# -- public API ---------------------------------------------------------------------------------


@_single_threaded
def diagnose_tap(tap: str, ref: torch.Tensor, cand: torch.Tensor, linear: LinearContext | None = None,
                 tp_size: int = 1, siblings: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                 parallel: str | None = None) -> list[Hint]:
    """Likely causes of one failing tap, most specific first; [] when no cause has evidence.

    ``ref``/``cand``: (rows, features) (leading axes are flattened into rows). ``linear``: the
    projection behind an op tap. ``siblings``: the other slices of the same fused projection
    ({tap: (ref, cand)}), to find swapped or mis-sized slices. ``parallel``: how the candidate spread the
    tap over ``tp_size`` ranks ("column", "column_kv", "vocab", "row"; None: replicated).
    """
    r, c = _rows(ref, f"{tap} reference"), _rows(cand, f"{tap} candidate")
    if r.shape != c.shape:
        raise ValueError(f"{tap}: reference {tuple(r.shape)} and candidate {tuple(c.shape)} differ in shape")
    if r.numel() == 0:
        return []
    noise = _noise(ref.dtype, cand.dtype)
    hints: list[Hint] = []
    if siblings:
        hints += _slices_hints(tap, r, c, siblings)
    proj = WeightProjection.build(tap, r, c, linear, noise)
    if proj is not None:
        hints += proj.hints()
    if tp_size > 1:
        if proj is not None and parallel == "row":
            hints += proj.partial_sum_hints(tp_size)
        shard_hints, shards = _column_shard_hints(tap, r, c, tp_size, noise) \
            if parallel in COLUMN_PARALLEL else ([], [])
        hints += shard_hints
        if proj is not None and not any(h.kind not in ("tp_shard", "slices_swapped") for h in hints):
            for rank, cols in shards:  # why that rank is wrong, when a weight hypothesis says so
                where = f"within rank {rank}'s shard (features {int(cols[0])}..{int(cols[-1])}), "
                hints += proj.hints(cols, where)
    if proj is not None and not hints:  # last, and only when nothing holds: what was checked
        undecided = proj.undecided()
        hints += [undecided] if undecided is not None else []
    return hints


@_single_threaded
def diagnose_depth(errors: list[tuple[str, float]], tolerance_atol: float, what: str = "max_abs",
                   bound: str = "atol", min_growth: float = DRIFT_MIN_GROWTH,
                   rounding: bool = False) -> list[Hint]:
    """A small error growing steadily with depth (drift), told apart from a jump at one layer.

    ``errors``: (``layers.{i}.output``, error) in layer order; ``what`` names the error (``max_abs``,
    ``token relative error``) and ``bound`` the tolerance it is held to (``atol``, ``token_rtol``).
    ``rounding``: the candidate rounds every tap (half precision), so its error grows with depth by itself:
    only a drift that leaves the tolerance is one.
    """
    if len(errors) < 4 or not all(math.isfinite(float(e)) and float(e) >= 0 for _, e in errors):
        return []
    floor = max(1e-12, 1e-4 * tolerance_atol)  # errors below this are noise, not a trend
    e = torch.tensor([max(float(v), floor) for _, v in errors], dtype=torch.float64)
    growth = float(e[-1] / e[0])
    # small at the first layer (a few atol at most), rising from there, and large enough to matter
    if growth < min_growth or float(e[0]) > 3 * tolerance_atol or float(e.max()) < 0.1 * tolerance_atol:
        return []
    if rounding and float(e.max()) <= tolerance_atol:
        return []
    logs = e.log()
    steps = torch.diff(logs)
    rising = int((steps >= math.log(0.95)).sum())
    if rising < DRIFT_RISING * len(steps):
        return []
    largest = float(steps.max())
    typical = max(float(steps.median()), 0.0)
    if math.exp(largest) >= max(JUMP_MIN, math.exp(3 * typical)) or \
            (largest > 0.6 * math.log(growth) and math.exp(largest) >= JUMP_MIN):
        return []  # one layer adds most of the error: a source, not a drift
    i = torch.arange(len(e), dtype=torch.float64)
    slope = float(((i - i.mean()) * (logs - logs.mean())).sum() / ((i - i.mean()) ** 2).sum())
    above = [k for k, v in enumerate(e.tolist()) if v > tolerance_atol]
    first, last = errors[0][0], errors[-1][0]
    cross = f"first above {bound} {tolerance_atol:g} at {errors[above[0]][0]}" if above else \
        f"still inside {bound} {tolerance_atol:g}"
    tap = errors[above[0]][0] if above else last
    return [Hint(
        tap, "drift",
        f"{what} of the layer outputs grows steadily from {_g(float(e[0]))} ({first}) to {_g(float(e[-1]))} "
        f"({last}) over {len(e)} layers: ×{math.exp(slope):.3g} per layer (log-linear fit), rising in "
        f"{rising} of {len(steps)} steps, largest single step ×{math.exp(largest):.3g}; {cross}",
        "no single layer is the source: look for a small systematic error in every layer — the RMSNorm "
        "epsilon (config rms_norm_eps against the kernel's) or a reduced-precision accumulator (fp16/bf16 "
        "accumulation in the GEMM or the norm); in isolated mode each layer's own error should then be "
        "similar and small")]
