"""Hints at the taps that are no projection: a norm's epsilon, attention's rotary embedding, MoE routing.

Each cause is a concrete prediction computed from the reference's own dumps (the norm's input, attention's
q, k and v, the router's logits) and compared with the candidate; a cause is named only when its prediction
leaves at most a tenth of the candidate's deviation from the reference unexplained. A failing tap of these
kinds for which no prediction holds gets a hint saying what was checked and ruled out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, NamedTuple

import torch

from vllm_parity.harness.diagnosis import (EXPLAINED, MATCH_REL, Hint, _g, _pct, _single_threaded, _suffix,
                                           ruled_out)

EPS_KEYS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_eps")
THETA_GRID = (1e4, 5e4, 1e5, 5e5, 1e6, 1e7)  # rope bases models ship with
LOG_THETA = (2.0, 9.0)  # the bases a solved theta is searched among (log10)
SIGNATURE_ZERO = 0.01  # position 0's error, at most this share of the worst position's: rope is the identity there
SIGNATURE_GROWTH = 2.0  # the later half's mean error against the first quarter's


class Checked(NamedTuple):
    """A cause tested and how much of the deviation its best prediction left (``math.inf``: none could be made)."""

    kind: str
    share: float
    note: str


def _share(cand: torch.Tensor, ref: torch.Tensor, pred: torch.Tensor) -> float:
    """The part of the candidate's deviation from the reference that ``pred`` leaves unexplained."""
    dev = float((cand - ref).norm())
    return float((cand - pred).norm()) / dev if dev > 0 else math.inf


# -- a norm's epsilon ----------------------------------------------------------------------------


@dataclass(frozen=True)
class NormContext:
    """What is known of the RMSNorm behind a tap (None where unknown)."""

    module: str  # e.g. "model.layers.1.post_attention_layernorm"
    eps: float  # the configured epsilon (the reference's own may differ: solved where the input is known)
    key: str = "rms_norm_eps"  # the config key it comes from
    weight: torch.Tensor | None = None  # the effective scale per feature (Gemma: 1 + w)
    x: torch.Tensor | None = None  # the norm's input, rows as the tap's


def _groups(t: torch.Tensor, width: int) -> torch.Tensor:
    return t.reshape(-1, width)


def _base_from_input(ref: torch.Tensor, ctx: NormContext, width: int) -> tuple | None:
    """(ms, the input times the weight, how, the reference's own epsilon): when the norm's input is known and
    normalizing it reproduces the reference."""
    if ctx.x is None or ctx.x.dim() != 2 or ctx.x.shape[0] != ref.shape[0] or ctx.x.shape[1] < ref.shape[1]:
        return None
    # a wider input: the norm reads its leading features (MLA's kv latent, before the rope part split off)
    x = _groups(ctx.x[:, : ref.shape[1]].to(torch.float64), width)
    ms = x.pow(2).mean(-1)
    w = ctx.weight.to(torch.float64) if ctx.weight is not None else torch.ones(width, dtype=torch.float64)
    u = x * w
    r = _groups(ref, width)
    eps = _solve_eps(r, u, ms, ctx.eps)
    if eps is None:
        return None
    pred = u / (ms + eps).clamp_min(1e-300).sqrt()[:, None]
    if float((pred - r).norm()) > 1e-3 * float(r.norm()):
        return None  # not this norm's input (a scaled residual, another layout)
    return ms, u, "from the norm's input", eps


def _base_from_output(ref: torch.Tensor, ctx: NormContext, width: int) -> tuple | None:
    """The same recovered from the reference's output and the norm weight, with the configured epsilon:
    mean((r / w)²) = ms / (ms + eps)."""
    if ctx.weight is None or ctx.weight.numel() != width:
        return None
    w = ctx.weight.to(torch.float64)
    if float(w.abs().min()) <= 1e-6 * float(w.abs().max()):
        return None  # a feature scaled by zero hides its input
    r = _groups(ref, width)
    m = (r / w).pow(2).mean(-1).clamp(max=1 - 1e-12)
    ms = ctx.eps * m / (1 - m)
    return ms, r * (ms + ctx.eps).sqrt()[:, None], ("recovered from the reference's output and the norm weight, "
                                                    "the reference's epsilon taken as configured"), ctx.eps


def _solve_eps(y: torch.Tensor, u: torch.Tensor, ms: torch.Tensor, scale: float) -> float | None:
    """The epsilon with ``y ≈ u / sqrt(ms + eps)`` row by row: each row's factor by least squares, each row's
    epsilon from it, weighted by its precision (a factor known to a relative error e gives its epsilon to
    2 e (ms + eps)); a value within a thousandth of ``scale`` of zero is none at all."""
    g = (y * u).sum(-1) / u.pow(2).sum(-1).clamp_min(1e-300)
    ok = torch.isfinite(g) & (g > 0) & torch.isfinite(y).all(-1)
    if not bool(ok.any()):
        return None
    a = 1.0 / g.pow(2).clamp_min(1e-300) - ms
    wt = torch.where(ok, 1.0 / (ms + scale).pow(2), torch.zeros_like(ms))
    eps = float((wt * torch.where(ok, a, torch.zeros_like(a))).sum() / wt.sum())
    return 0.0 if abs(eps) <= 1e-3 * scale else eps


def norm_epsilon(tap: str, ref: torch.Tensor, cand: torch.Tensor,
                 ctx: NormContext) -> tuple[Hint | None, Checked | None]:
    """The candidate as the norm's input normalized with another epsilon, ``cand = x·w / sqrt(ms_t + eps')`` per
    row (per head for a per-head norm), ``eps'`` solved by weighted least squares over the rows (and the
    reference's own epsilon likewise, where the input is known). Returns the hint (None: it does not hold) and
    what was checked."""
    width = ctx.weight.numel() if ctx.weight is not None else ref.shape[-1]
    r, c = ref.detach().to(torch.float64), cand.detach().to(torch.float64)
    if r.shape[-1] % width:
        return None, Checked("norm_epsilon", math.inf, f"another epsilon: the norm weight's {width} features do not "
                                                          f"tile the tap's {r.shape[-1]}")
    got = _base_from_input(r, ctx, width) or _base_from_output(r, ctx, width)
    if got is None:
        return None, Checked("norm_epsilon", math.inf,
                             "another epsilon: not solvable (neither the norm's input nor a usable norm weight)")
    ms, u, how, eps_ref = got
    rg, cg = _groups(r, width), _groups(c, width)
    eps = _solve_eps(cg, u, ms, ctx.eps)
    if eps is None:
        return None, Checked("norm_epsilon", math.inf,
                             "another epsilon: the candidate's rows are not positive multiples of the reference's")
    ok = torch.isfinite(cg).all(-1)[:, None].expand_as(rg)
    pred = u / (ms + eps).clamp_min(1e-300).sqrt()[:, None]
    share = _share(cg[ok], rg[ok], pred[ok])
    checked = Checked("norm_epsilon", share, f"another epsilon (solved {eps:.3g} against {ctx.key} {ctx.eps:g}): the "
                                             f"per-row model leaves {_g(share)} of the deviation")
    if not (share <= EXPLAINED and eps >= 0 and math.isfinite(eps)):
        return None, checked
    factors = ((ms + eps_ref) / (ms + eps).clamp_min(1e-300)).sqrt()
    heads = r.shape[-1] // width
    per = "row" if heads == 1 else f"row and head ({heads} heads of {width})"
    ref_own = not math.isclose(eps_ref, ctx.eps, rel_tol=0.05)
    own = f"the reference's own epsilon, solved alike, {eps_ref:.4g}; " if ref_own else ""
    evidence = (f"{tap} ({ctx.module}): candidate ≡ x·w / sqrt(ms + eps) per {per}, x the norm's input and ms its "
                f"mean square ({how}), with eps = {eps:.4g} solved by least squares over {int(ok[:, 0].sum())} rows "
                f"against {ctx.key} = {ctx.eps:g} ({own}the model leaves {_g(share)} of the deviation unexplained); "
                f"candidate / reference {float(factors.min()):.6g} to {float(factors.max()):.6g} per row")
    if ref_own and math.isclose(eps, ctx.eps, rel_tol=0.05):
        fix = (f"the candidate normalizes {ctx.module} with the configured {ctx.key} = {ctx.eps:g}, the reference "
               f"with {eps_ref:.3g} (its modeling class builds this norm with its own default): make the two agree "
               f"(the checkpoint's config, or the reference's norm)")
    else:
        fix = (f"normalize {ctx.module} with the configured {ctx.key} = {ctx.eps:g} (the candidate's norm uses about "
               f"{eps:.3g}): check the epsilon its RMSNorm is built with (variance_epsilon)")
    return Hint(tap, "norm_epsilon", evidence, fix), checked


# -- attention's rotary embedding ---------------------------------------------------------------


@dataclass(frozen=True)
class Rope:
    """How q and k are rotated: the base, the scaling of the configured type, the pair layout."""

    theta: float
    rope_type: str = "default"
    params: Mapping[str, Any] | None = None  # the rest of rope_parameters (factor, ...)
    neox: bool = True  # rotate halves (neox) or adjacent pairs (gptj)

    def describe(self) -> str:
        scaling = "no scaling" if self.rope_type == "default" else \
            f"{self.rope_type} scaling (factor {(self.params or {}).get('factor')})"
        return f"rope_theta {self.theta:.6g}, {scaling}, {'neox' if self.neox else 'gptj'} pairs"


@dataclass(frozen=True)
class AttentionContext:
    """One layer's attention as the reference computes it, from config.json."""

    heads: int
    kv_heads: int
    head_dim: int
    rope: Rope
    config: Mapping[str, Any]  # config.json (for transformers' rope functions)
    scale: float  # on q·k
    softcap: float | None = None
    window: int | None = None  # sliding window, in tokens
    rotary_dim: int | None = None
    module: str = "the attention"

    @classmethod
    def of(cls, config: Mapping[str, Any], layer: int, module: str) -> AttentionContext:
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        types = config.get("layer_types")
        kind = types[layer] if types and layer < len(types) else None
        params = dict(config.get("rope_parameters") or {})
        if kind in params and isinstance(params[kind], Mapping):  # one rope per attention kind (Gemma3)
            params = dict(params[kind])
        if not params:
            params = {"rope_theta": config.get("rope_theta", 10000.0), **(config.get("rope_scaling") or {})}
        theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
        rope_type = str(params.pop("rope_type", params.pop("type", "default")))
        partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
        qpas = config.get("query_pre_attn_scalar")
        window = config.get("sliding_window") if kind == "sliding_attention" else None
        return cls(heads, int(config.get("num_key_value_heads") or heads), head_dim,
                   Rope(theta, rope_type, params), config, float(qpas if qpas else head_dim) ** -0.5,
                   config.get("attn_logit_softcapping"), int(window) if window else None,
                   int(head_dim * partial), module)

    def inv_freq(self, rope: Rope) -> tuple[torch.Tensor, float]:
        dim = self.rotary_dim or self.head_dim
        if rope.rope_type == "default":
            return 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)), 1.0
        from transformers import AutoConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        keys = {k: v for k, v in self.config.items() if k not in ("model_type", "rope_scaling", "rope_theta")}
        cfg = AutoConfig.for_model(self.config["model_type"], **{
            **keys, "rope_parameters": {"rope_theta": rope.theta, "rope_type": rope.rope_type, **(rope.params or {})}})
        inv, scaling = ROPE_INIT_FUNCTIONS[rope.rope_type](cfg, "cpu")
        return inv.to(torch.float64), float(scaling)

    def context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope,
                freqs: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """One prompt's attention output ``(tokens, heads · head_dim)`` from its q, k, v rows, causal;
        ``freqs``: ``inv_freq(rope)``, when the caller has it."""
        t, d = q.shape[0], self.head_dim
        q = q.to(torch.float64).reshape(t, self.heads, d).transpose(0, 1)
        k = k.to(torch.float64).reshape(t, self.kv_heads, d).transpose(0, 1)
        v = v.to(torch.float64).reshape(t, self.kv_heads, d).transpose(0, 1)
        inv, scaling = freqs if freqs is not None else self.inv_freq(rope)
        angle = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
        q, k = _rotate(q, angle, scaling, rope.neox), _rotate(k, angle, scaling, rope.neox)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        s = q @ k.transpose(1, 2) * self.scale
        if self.softcap:
            s = torch.tanh(s / self.softcap) * self.softcap
        i = torch.arange(t)
        mask = i[None, :] <= i[:, None]
        if self.window:
            mask &= i[:, None] - i[None, :] < self.window
        s = s.masked_fill(~mask, -math.inf)
        return (torch.softmax(s, -1) @ v).transpose(0, 1).reshape(t, self.heads * d)


def _rotate(x: torch.Tensor, angle: torch.Tensor, scaling: float, neox: bool) -> torch.Tensor:
    half = angle.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half:]
    cos, sin = angle.cos() * scaling, angle.sin() * scaling
    if neox:
        a, b = rot[..., :half], rot[..., half:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    return torch.cat([out, rest], -1)


def _position_errors(refs: list[torch.Tensor], cands: list[torch.Tensor]) -> torch.Tensor:
    """The token relative error at each position, the worst over the prompts."""
    t = max(r.shape[0] for r in refs)
    err = torch.zeros(t, dtype=torch.float64)
    for r, c in zip(refs, cands):
        r, c = r.to(torch.float64), c.to(torch.float64)
        e = (c - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)
        e = torch.nan_to_num(e, nan=math.inf)
        err[: len(e)] = torch.maximum(err[: len(e)], e)
    return err


def _signature(err: torch.Tensor) -> tuple[bool, str]:
    """Zero at position 0 (where rope is the identity and a token attends to itself only), growing after."""
    n = len(err)
    if n < 8 or not bool(torch.isfinite(err).all()):
        return False, "too few positions (or non-finite values) to read a growth with position"
    worst = float(err.max())
    early, late = float(err[1: max(2, n // 4)].mean()), float(err[n // 2:].mean())
    holds = float(err[0]) <= SIGNATURE_ZERO * worst and late >= SIGNATURE_GROWTH * early
    text = (f"relative error {_g(float(err[0]))} at position 0, {_g(early)} on average over positions "
            f"1..{max(1, n // 4 - 1)}, {_g(late)} over positions {n // 2}..{n - 1} (worst {_g(worst)} at position "
            f"{int(err.argmax())})")
    return holds, text


@_single_threaded
def rope_mismatch(tap: str, qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], refs: list[torch.Tensor],
                  cands: list[torch.Tensor], attn: AttentionContext,
                  inputs: str = "q, k and v") -> tuple[Hint | None, Checked | None]:
    """Attention recomputed from the reference's q, k, v per prompt under other rotary embeddings: a base from
    a grid of common ones or solved, the configured scaling dropped or another applied, the other pair layout;
    the one that reproduces the candidate's context, else the position signature of a rope error."""
    err = _position_errors(refs, cands)
    sig, sig_text = _signature(err)
    ref_all, cand_all = torch.cat(refs).to(torch.float64), torch.cat(cands).to(torch.float64)
    conf = attn.rope

    def predict(rope: Rope) -> torch.Tensor:
        freqs = attn.inv_freq(rope)
        return torch.cat([attn.context(q, k, v, rope, freqs) for q, k, v in qkv])

    checked: list[str] = []
    best: tuple[float, Rope] | None = None
    least = math.inf
    try:
        own = predict(conf)
    except Exception as exc:  # a rope type transformers cannot build from this config: the signature only
        own, checked = None, [f"attention recomputed from q, k, v ({type(exc).__name__}: {exc})"]
    if own is not None and float((own - ref_all).norm()) > 1e-3 * float(ref_all.norm()):
        checked.append("attention recomputed from q, k, v: it does not reproduce the reference's own context "
                       f"({_g(float((own - ref_all).norm() / ref_all.norm()))} off), so no rope could be tested")
        own = None
    if own is not None:
        hyps: list[tuple[str, Rope]] = [(f"rope_theta {t:.6g}", replace(conf, theta=t)) for t in THETA_GRID
                                        if not math.isclose(t, conf.theta, rel_tol=1e-6)]
        if conf.rope_type != "default":
            hyps.append((f"the configured {conf.rope_type} scaling dropped", replace(conf, rope_type="default",
                                                                                  params={})))
            factor = (conf.params or {}).get("factor")
            if factor and conf.rope_type != "linear":
                hyps.append((f"linear scaling by {factor} in place of {conf.rope_type}",
                             replace(conf, rope_type="linear", params={"factor": factor})))
        else:
            hyps += [(f"linear scaling by {f} applied where the config has none",
                      replace(conf, rope_type="linear", params={"factor": float(f)})) for f in (2, 4, 8)]
        hyps.append(("the other pair layout (" + ("gptj" if conf.neox else "neox") + ")",
                     replace(conf, neox=not conf.neox)))
        scores = []
        for what, rope in hyps:
            try:
                share = _share(cand_all, ref_all, predict(rope))
            except Exception:  # noqa: BLE001 - a scaling transformers refuses for this config is not a cause
                continue
            scores.append((share, what, rope))
        solved, solved_share = _solve_theta(lambda t: _share(cand_all, ref_all, predict(replace(conf, theta=t))))
        scores.append((solved_share, f"rope_theta {solved:.6g} (solved)", replace(conf, theta=solved)))
        scores.sort(key=lambda s: s[0])
        share, what, rope = scores[0]
        least = share
        if share <= EXPLAINED:
            best = (share, rope)
            grid_hit = [s for s in scores if s[0] <= EXPLAINED and "(solved)" not in s[1]]
            if grid_hit:  # a round base that holds reads better than the solved one
                share, what, rope = grid_hit[0]
                best = (share, rope)
        checked.append("attention recomputed from the reference's q, k, v under " +
                       ", ".join(f"{w} (residual {_g(s)})" for s, w, _ in scores))
    fix = (f"build the rotary embedding of {attn.module} from config.json: {conf.describe()} "
           f"(check the base and scaling its cos/sin cache was computed with, and is_neox_style)")
    if best is not None:
        share, rope = best
        return Hint(tap, "rope",
                    f"{tap} ({attn.module}): attention recomputed from the reference's q, k, v with {rope.describe()} "
                    f"in place of the configured {conf.describe()} reproduces the candidate's context, leaving "
                    f"{_g(share)} of the deviation unexplained; {inputs} pass; {sig_text}", fix), \
            Checked("rope", share, "; ".join(checked))
    if own is not None:  # the softmax scale also leaves position 0 alone (it attends to itself only)
        d, freqs = attn.head_dim, attn.inv_freq(conf)
        for f, what in ((d ** -0.5, "1/head_dim in place of 1/√head_dim"), (d ** 0.5, "no scale"),
                        (2.0, "doubled"), (0.5, "halved")):
            other = replace(attn, scale=attn.scale * f)
            share = _share(cand_all, ref_all, torch.cat([other.context(q, k, v, conf, freqs) for q, k, v in qkv]))
            if share <= EXPLAINED:
                checked.append(f"the softmax scale {what} reproduces the candidate's context (residual {_g(share)}): "
                               f"not a rope error")
                return None, Checked("rope", least, "; ".join(checked))
    if sig:
        ruled = "; ".join(checked) or "no recomputation"
        return Hint(tap, "rope",
                    f"{tap} ({attn.module}): position-dependent error in attention while {inputs} pass — {sig_text}: "
                    f"the signature of a rotary embedding mismatch, not reproduced by any hypothesis tried ({ruled})",
                    fix), Checked("rope", least, ruled)
    checked.append(f"a rope signature (zero at position 0, growing with position): not seen, {sig_text}")
    return None, Checked("rope", least, "; ".join(checked))


def _solve_theta(share: Callable[[float], float]) -> tuple[float, float]:
    """The base minimizing ``share``: a scan of log10 θ, then a golden-section search around its best."""
    lo, hi = LOG_THETA
    grid = [lo + 0.25 * j for j in range(int((hi - lo) / 0.25) + 1)]
    vals = [share(10 ** g) for g in grid]
    j = min(range(len(grid)), key=vals.__getitem__)
    a, b = grid[max(0, j - 1)], grid[min(len(grid) - 1, j + 1)]
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = share(10 ** c), share(10 ** d)
    for _ in range(30):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = share(10 ** c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = share(10 ** d)
    x = 10 ** ((a + b) / 2)
    rounded = float(f"{x:.3g}")  # reads as a base; kept where it explains as much
    fx, fr = share(x), share(rounded)
    return (rounded, fr) if fr <= max(fx, EXPLAINED * 0.1) else (x, fx)


# -- MoE routing --------------------------------------------------------------------------------


def routing_disagreement(tap: str, ref: torch.Tensor, cand: torch.Tensor, k: int,
                         module: str = "the router") -> tuple[Hint | None, Checked | None]:
    """Which experts the candidate's router logits choose in place of the reference's top-``k``, on how many
    tokens; whether the candidate's logits are the reference's with the experts renumbered, or the
    disagreements are all near-ties of the reference."""
    r, c = ref.detach().to(torch.float64), cand.detach().to(torch.float64)
    tokens, experts = r.shape
    k = min(k, experts)
    rk, ck = r.topk(k, -1).indices, c.topk(k, -1).indices
    rs = torch.zeros_like(r, dtype=torch.bool).scatter_(1, rk, True)
    cs = torch.zeros_like(c, dtype=torch.bool).scatter_(1, ck, True)
    bad = (rs != cs).any(-1)
    nbad = int(bad.sum())
    if nbad == 0:
        return None, Checked("routing", 1.0, f"a routing disagreement: every token of {tokens} routes to the "
                                             f"reference's top-{k}")
    pairs: dict[tuple[int, int], int] = {}
    for t in bad.nonzero().flatten().tolist():
        chosen = (cs[t] & ~rs[t]).nonzero().flatten().tolist()
        dropped = (rs[t] & ~cs[t]).nonzero().flatten().tolist()
        dropped.sort(key=lambda e: -float(r[t, e]))
        chosen.sort(key=lambda e: -float(c[t, e]))
        for a, b in zip(chosen, dropped):
            pairs[(a, b)] = pairs.get((a, b), 0) + 1
    top = sorted(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
    listed = "; ".join(f"expert {a} chosen in place of {b} on {n} of {tokens} tokens" for (a, b), n in top[:4])
    more = f" (and {len(top) - 4} more pairs)" if len(top) > 4 else ""
    perm = _renumbering(r, c)
    # a near-tie: the reference's k-th and next logits closer than the candidate's error on that token
    tied = 0
    if k < experts:
        vals = r.topk(k + 1, -1).values
        gap = vals[:, k - 1] - vals[:, k]
        err = (c - r).abs().amax(-1)
        tied = int((bad & (gap <= 2 * err) & (err <= 0.1 * r.abs().amax(-1).clamp_min(1e-30))).sum())
    head = f"{tap} ({module}): routing disagrees on {_pct(nbad, tokens)} tokens: {listed}{more}"
    if perm is not None:
        moved = ", ".join(f"{j}←{i}" for j, i in enumerate(perm) if j != i)
        return Hint(tap, "routing",
                    f"{head}; the candidate's router logits are the reference's with the experts renumbered "
                    f"(candidate expert ← reference expert: {moved}; every column within {MATCH_REL:g} of its match)",
                    f"keep the checkpoint's order of the experts: check the row order of the router's weight "
                    f"({module}) and the expert ids the experts' weights are loaded under"), None
    if tied == nbad:
        return Hint(tap, "routing",
                    f"{head}; on each of them the reference's k-th and next expert are within twice the candidate's "
                    f"logit error: near-ties, decided otherwise by a small error in the router's logits",
                    f"the routing follows from a small error of the router's logits ({module}): make them match "
                    f"(its weight's precision, the input norm) and the ties resolve as the reference's"), None
    return Hint(tap, "routing",
                f"{head}; not a renumbering of the experts, {tied} of the {nbad} are near-ties",
                f"check {module}: its weight (rows per expert) and the input it reads; the top-{k} choice follows "
                f"its logits"), None


def _renumbering(r: torch.Tensor, c: torch.Tensor) -> list[int] | None:
    """perm with candidate column j ≡ reference column perm[j] for every j (not the identity), else None."""
    n = r.norm(dim=0).clamp_min(1e-30)
    d = torch.cdist(c.t(), r.t())  # (cand expert, ref expert)
    best = d.argmin(1)
    ok = d[torch.arange(len(best)), best] <= MATCH_REL * n[best]
    perm = best.tolist()
    if not bool(ok.all()) or len(set(perm)) != len(perm) or perm == list(range(len(perm))):
        return None
    return perm


# -- from the dumps -----------------------------------------------------------------------------


def _checkpoint_tensor(ckpt, name: str) -> torch.Tensor | None:
    try:
        return ckpt.tensor(name) if name in ckpt else None
    except Exception:  # noqa: BLE001 - a weight the diagnosis cannot read leaves the hint unsolved, not the run
        return None


def _eps_of(config: Mapping[str, Any]) -> tuple[float, str]:
    for key in EPS_KEYS:
        if config.get(key) is not None:
            return float(config[key]), key
    return 1e-6, "rms_norm_eps (absent: transformers' default 1e-6)"


def _stack(reader, taps: list[str]) -> torch.Tensor | None:
    if not taps or not all(t in reader.taps() for t in taps):
        return None
    parts = [reader.stacked(t)[0].to(torch.float64) for t in taps]
    if any(p.shape != parts[0].shape for p in parts):
        return None
    return sum(parts[1:], parts[0])


def _norm_context(tap: str, reference, ckpt, arch, num_layers: int) -> NormContext:
    from vllm_parity.harness.taps import inputs_of

    found = arch.point(tap)
    module = found[1] if found else tap
    eps, key = _eps_of(ckpt.config)
    w = _checkpoint_tensor(ckpt, f"{module}.weight")
    weight = None if w is None else arch.norm_offset + w.to(torch.float64).flatten()
    try:
        sources = inputs_of(tap, num_layers, arch)
    except KeyError:
        sources = []
    return NormContext(module, eps, key, weight, _stack(reference, sources))


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def _qkv_taps(tap: str, arch) -> list[str]:
    from vllm_parity.harness.taps import inputs_of

    try:
        sources = inputs_of(tap, 1 << 30, arch)
    except KeyError:
        return []
    q = next((s for s in sources if s.endswith(("attn.q_norm", "attn.q"))), None)
    k = next((s for s in sources if s.endswith(("attn.k_norm", "attn.k"))), None)
    v = next((s for s in sources if s.endswith("attn.v")), None)
    return [q, k, v] if q and k and v else []


@_single_threaded
def op_hints(tap: str, reference, candidate, ckpt, arch) -> list[Hint]:
    """The hints of a failing source ``tap`` that is a norm, attention's context or a router, from both dumps
    (``reference``, ``candidate``: DumpReaders) and the checkpoint's config; [] for any other tap."""
    suffix = _suffix(tap)
    config = getattr(ckpt, "config", None)
    if not (suffix.endswith("norm") or suffix in ("attn.context", "moe.router")) or not config:
        return []
    try:
        return _op_hints(tap, suffix, reference, candidate, ckpt, arch)
    except (RuntimeError, KeyError, IndexError, TypeError) as exc:  # what the dumps or config do not allow
        raise ValueError(f"{tap}: {type(exc).__name__}: {exc}") from exc


def _op_hints(tap: str, suffix: str, reference, candidate, ckpt, arch) -> list[Hint]:
    from vllm_parity.harness.taps import layer_of

    num_layers = int(ckpt.config["num_hidden_layers"])
    ref, cand = reference.stacked(tap)[0], candidate.stacked(tap)[0]
    if ref.shape != cand.shape:
        return []
    if suffix.endswith("norm"):
        ctx = _norm_context(tap, reference, ckpt, arch, num_layers)
        hint, checked = norm_epsilon(tap, ref, cand, ctx)
        return [hint or _ruled_out(tap, ctx.module, checked)]
    if suffix == "attn.context":
        taps = _qkv_taps(tap, arch)
        if not taps or not all(t in reference.taps() for t in taps):
            return []
        found = arch.point(tap)
        module = found[1].rsplit(".", 1)[0] if found else tap
        attn = AttentionContext.of(ckpt.config, layer_of(tap) or 0, module)
        prompts = reference.prompts(tap)
        qkv = [tuple(_rows_of(reference.get(t, p)) for t in taps) for p in prompts]
        refs = [_rows_of(reference.get(tap, p)) for p in prompts]
        cands = [_rows_of(candidate.get(tap, p)) for p in prompts]
        if any(q.shape[-1] != attn.heads * attn.head_dim or r.shape[-1] != attn.heads * attn.head_dim
               for (q, _, _), r in zip(qkv, refs)):
            return []  # another attention (latent, ...): nothing of this model to test
        names = [_suffix(t).removeprefix("attn.") for t in taps]
        hint, checked = rope_mismatch(tap, qkv, refs, cands, attn, f"{names[0]}, {names[1]} and {names[2]}")
        return [hint or _ruled_out(tap, module, checked)]
    if suffix == "moe.router":
        k = ckpt.config.get("num_experts_per_tok")
        if not k:
            return []
        found = arch.point(tap)
        module = found[1] if found else tap
        vllm_module = ".".join(arch.renames.get(p, p) for p in module.split("."))
        where = module if vllm_module == module else f"{module}, vLLM's {vllm_module}"
        hint, checked = routing_disagreement(tap, ref, cand, int(k), where)
        return [hint or _ruled_out(tap, where, checked)]
    return []


@_single_threaded
def kv_cache(tap: str, step: int, references: list, candidates: list, ckpt, arch) -> Hint:
    """The hint of attention's output failing at decode step ``step`` (``references``, ``candidates``: the
    prefill's DumpReader, then each decode step's). The attention is recomputed, causal over every position so
    far, from the candidate's own q, k and v (its prefill's rows and its decode steps' up to this one): when that
    gives the reference's output and not the candidate's, the attention read keys or values other than those its
    projections made, i.e. what the KV cache held."""
    taps = _qkv_taps(tap, arch)
    found = arch.point(tap)
    module = found[1].rsplit(".", 1)[0] if found else tap
    what = f"decode step {step} ({module})"
    config = getattr(ckpt, "config", None)
    if not config or not taps or not all(t in c.taps() for c in candidates[: 2 + step] for t in taps):
        return _ruled_out(tap, what, Checked("kv_cache", math.inf, "no q, k, v taps or config to recompute it from"))
    try:
        return _kv_cache(tap, step, references, candidates, config, taps, module, what)
    except (RuntimeError, KeyError, IndexError, TypeError) as exc:  # what the dumps or config do not allow
        raise ValueError(f"{tap}: {type(exc).__name__}: {exc}") from exc


def _kv_cache(tap: str, step: int, references: list, candidates: list, config, taps: list[str], module: str,
              what: str) -> Hint:
    from vllm_parity.harness.taps import layer_of

    attn = AttentionContext.of(config, layer_of(tap) or 0, module)
    freqs = attn.inv_freq(attn.rope)
    preds, refs, cands = [], [], []
    for p in candidates[1 + step].prompts(tap):
        qkv = [torch.cat([_rows_of(d.get(t, p)) for d in candidates[: 2 + step]]) for t in taps]
        if qkv[0].shape[-1] != attn.heads * attn.head_dim:
            return _ruled_out(tap, what, Checked("kv_cache", math.inf, "another attention than the one recomputed"))
        preds.append(attn.context(*qkv, attn.rope, freqs)[-1:])
        refs.append(_rows_of(references[1 + step].get(tap, p)))
        cands.append(_rows_of(candidates[1 + step].get(tap, p)))
    pred, ref, cand = (torch.cat(x).to(torch.float64) for x in (preds, refs, cands))
    dev = float((cand - ref).norm())
    to_ref, to_cand = float((pred - ref).norm()) / max(dev, 1e-300), float((pred - cand).norm()) / max(dev, 1e-300)
    if to_ref > EXPLAINED or not math.isfinite(to_ref):
        return _ruled_out(tap, what, Checked("kv_cache", to_ref, (
            f"attention recomputed from the candidate's own q, k and v is {_g(to_ref)} of the deviation away from "
            f"the reference's output: the error is not only in what the cache held")))
    names = ", ".join(_suffix(t).removeprefix("attn.") for t in taps)
    return Hint(tap, "kv_cache", (
        f"{tap} at decode step {step}: attention recomputed from the candidate's own {names} (its prefill's rows "
        f"and its decode steps' up to this one, every one of them passing) leaves {_g(to_ref)} of the deviation "
        f"from the reference's output and is {_g(to_cand)} of it away from the candidate's (deviation norm "
        f"{_g(dev)}), while the same tap passes at the prefill: the attention read keys or values other than "
        f"those its projections made"), (
        f"check the KV cache of {module}: what is written to it at the prefill (slot mapping, the key/value "
        f"layout, the cache dtype and its scales) and what the decode reads back (block table, positions)"))


def _ruled_out(tap: str, module: str, checked: Checked) -> Hint:
    return ruled_out(tap, [(checked.kind, checked.share)], why=f" ({module}): {checked.note}",
                     criterion=f"a cause holds when it leaves at most {EXPLAINED} of the tap's deviation", next_step=(
        f"the error of {module} has none of the checked shapes: open its snapshot (parity debug, --parity-pdb) "
        f"and compare it with the reference's, row by row and feature by feature"))
