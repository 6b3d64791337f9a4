"""The ``parity`` command: inspect checkpoints, make fixtures, compare dumps, browse snapshots,
re-render reports, follow the nightly trend."""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
from pathlib import Path
from typing import Any

from vllm_parity.harness.report import json_clean, tap_key
from vllm_parity.errors import ParityInputError


def _make_fixture(args: argparse.Namespace) -> int:
    from vllm_parity.fixtures.checkpoints import Dims, make_fixture

    dims = Dims(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                intermediate=args.intermediate, vocab=args.vocab)
    out = make_fixture(args.format, args.out, seed=args.seed, dims=dims, dtype=args.dtype, arch=args.arch)
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from vllm_parity.fixtures.checkpoints import FORMATS, Dims, fixture_families
    from vllm_parity.tools import inspect as inspect_cmd

    parser = argparse.ArgumentParser(prog="parity", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-fixture", help="write a deterministic tiny checkpoint")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--arch", default="llama", choices=fixture_families(),
                   help="the model family (transformers' class of its config; default llama)")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--seed", type=int, default=0)
    d = Dims()
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads)
    p.add_argument("--intermediate", type=int, default=d.intermediate)
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="dtype of the floating-point tensors (embeddings, norms, lm_head)")
    p.set_defaults(func=_make_fixture)

    p = sub.add_parser("inspect", help="reverse-engineer a checkpoint's format")
    inspect_cmd.add_arguments(p)
    p.set_defaults(func=inspect_cmd.run)

    _add_debug_commands(sub)
    return parser


# -- diff ---------------------------------------------------------------------------------------


def _warn(command: str, msg: str) -> None:
    print(f"parity {command}: warning: {msg}", file=sys.stderr)


def _open_dump(path: str) -> Any:
    from vllm_parity.harness.dumps import DumpReader

    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{p}: not a directory (a dump is a directory holding manifest.json)")
    try:
        return DumpReader(p)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None


def _architecture(dump: Any):
    """The architecture a dump was taken from (dumps that do not say are Llama's)."""
    from vllm_parity.architectures import lookup

    return lookup(dump.manifest.get("architecture", "llama"), f"{dump.root}/manifest.json")


def _forward_order(taps: list[str], arch: Any) -> list[str]:
    """Canonical forward order (growth and attribution walk it); unknown names keep their place at the end."""
    from vllm_parity.harness.taps import canonical_order, layer_of

    n = 1 + max((layer_of(t) for t in taps if layer_of(t) is not None), default=-1)
    rank = {t: i for i, t in enumerate(canonical_order(n, arch))}
    pos = {t: i for i, t in enumerate(taps)}
    return sorted(taps, key=lambda t: (rank.get(t, len(rank)), pos[t]))


def _g(v: Any, spec: str = ".3g") -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def _columns(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in [head, ["-" * w for w in widths], *rows])


def _result_cell(t: dict) -> str:
    if t["passed"]:
        return "pass"
    if t.get("role") == "inherited":
        return f"FAIL inherited ({', '.join(t.get('fed_by') or []) or 'earlier failure'})"
    return f"FAIL {t.get('role') or ''}".rstrip()


def _tap_rows(taps: list[dict]) -> list[list[str]]:
    rows = []
    for t in taps:
        m = t.get("metrics") or {}
        mt = t.get("min_tolerance") or {}
        # report JSON holds an infinite SQNR (identical tensors) as null
        sqnr = "inf" if m.get("sqnr_db") is None and m.get("max_abs") == 0 else _g(m.get("sqnr_db"), ".1f")
        tol = t["tolerance"]
        rows.append([t["name"], _g(m.get("token_rel")), _g(tol.get("token_rtol")), _g(mt.get("row_rtol")),
                     _g(tol.get("row_rtol")), _g(m.get("max_abs")), _g(m.get("cosine"), ".6f"), sqnr,
                     _g(tol["atol"]), _g(mt.get("atol")), _g(t.get("margin")), _result_cell(t)])
    return rows


TAP_HEAD = ["tap", "token rel", "token_rtol", "min passing row_rtol", "row_rtol", "max_abs", "cosine", "SQNR dB",
            "atol", "min passing atol", "margin", "result"]


def _dump_info(d: Any) -> dict:
    return {"path": str(d.root), **{k: d.manifest.get(k) for k in ("side", "model", "model_sha256",
                                                                  "prompts_sha256", "format", "versions")}}


def _diff(args: argparse.Namespace) -> int:
    from safetensors import SafetensorError

    from vllm_parity.harness.compare import compare_dumps, first_divergence
    from vllm_parity.harness.tolerances import load

    a, b = _open_dump(args.dump_a), _open_dump(args.dump_b)
    warnings = []
    for field in ("prompts_sha256", "model_sha256"):
        va, vb = a.manifest.get(field), b.manifest.get(field)
        if va != vb:
            what = "prompt sets" if field == "prompts_sha256" else "models"
            warnings.append(f"the dumps were made from different {what}: {field} {va} ({a.root}) vs {vb} ({b.root})")
    common = [t for t in a.taps() if t in set(b.taps())]
    only_a, only_b = [t for t in a.taps() if t not in common], [t for t in b.taps() if t not in set(a.taps())]
    if not common:
        raise ValueError(f"no common taps: {a.root} holds {a.taps()[:4]}…, {b.root} holds {b.taps()[:4]}…")
    selected = [t for t in common if fnmatch.fnmatchcase(t, args.taps or "*")]
    if not selected:
        raise ValueError(f"--taps {args.taps!r} matches none of the {len(common)} common taps "
                         f"(e.g. {', '.join(common[:3])})")
    if only_a or only_b:
        warnings.append(f"taps in one dump only, not compared: {len(only_a)} only in {a.root} {only_a[:3]}, "
                        f"{len(only_b)} only in {b.root} {only_b[:3]}")
    # layer inputs are compared (they decide source against inherited) but shown only when a glob asks
    shown = selected if args.taps else [t for t in selected if not t.endswith(".input")]
    arch = _architecture(a)
    compared = _forward_order(selected, arch)
    table = load(args.tolerances, Path.cwd() / "pyproject.toml")
    try:
        results = compare_dumps(a, b, compared, table, arch=arch)
    except (OSError, KeyError) as exc:
        raise ValueError(f"cannot read the dumps: {exc}") from None
    except SafetensorError as exc:
        raise ValueError(f"a tensor file of {a.root} or {b.root} is damaged: {exc}") from None
    keep = set(shown)
    results = [r for r in results if r.name in keep]
    first = first_divergence(results) or next((r for r in results if not r.passed), None)
    taps = [r.as_dict() for r in results]
    passed = all(r.passed for r in results)
    for w in warnings:
        _warn("diff", w)
    if args.json:
        out = {"schema": "parity-diff/1", "a": _dump_info(a), "b": _dump_info(b), "tolerances": table.source,
               "warnings": warnings, "taps": taps,
               "first_divergence": None if first is None else {"name": first.name, "layer": first.layer,
                                                               "message": first.message},
               "passed": passed}
        print(json.dumps(json_clean(out), indent=1, allow_nan=False))
        return 0 if passed else 1
    print(f"A (reference): {a.root}\nB (candidate): {b.root}\ntolerances: {table.source}\n")
    print(_columns(TAP_HEAD, _tap_rows(taps)))
    print()
    failing = [r for r in results if not r.passed]
    if first is None:
        print(f"all {len(results)} taps pass")
    else:
        print(f"first divergence: {first.name}" + (f" (layer {first.layer})" if first.layer is not None else ""))
        print(f"  {first.message}")
        print(f"{len(failing)} of {len(results)} taps fail "
              f"({sum(r.role == 'source' for r in failing)} source, {sum(r.role == 'inherited' for r in failing)} "
              f"inherited)")
    return 0 if passed else 1


# -- snapshots ----------------------------------------------------------------------------------


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: missing") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def _snapshot(root: Path, sid: str) -> Path:
    from vllm_parity.harness import snapshots

    known = snapshots.runs(root)
    for d in known:
        if d.name == sid:
            return d
    prefixed = [d for d in known if d.name.startswith(sid)]
    if len(prefixed) == 1:
        return prefixed[0]
    names = ", ".join(d.name for d in known[-5:]) or "none"
    why = f"{len(prefixed)} snapshots start with it" if prefixed else "no such snapshot"
    raise ValueError(f"{root}: {sid!r}: {why} (newest: {names})")


def _failing(diff: dict) -> list[dict]:
    return [{"name": name, **t} for name, t in diff.items()]


def _snapshots(args: argparse.Namespace) -> int:
    from vllm_parity.harness import snapshots

    root = Path(args.dir)
    if args.action == "list":
        runs = snapshots.runs(root)
        if not runs:
            print(f"no snapshots under {root}")
            return 0
        rows = []
        for d in reversed(runs):  # newest first
            meta = _read_json(d / "meta.json")
            try:
                fails = _failing(_read_json(d / "diff.json"))
                sources = [t["name"] for t in fails if t.get("role") == "source"]
                failing = f"{len(fails)}" + (f" (source {sources[0]}" + (f" +{len(sources) - 1}" if len(sources) > 1
                                                                          else "") + ")" if sources else "")
            except ValueError as exc:
                failing = "? (diff.json unreadable)"
                _warn("snapshots", str(exc))
            rows.append([d.name, str(meta.get("written", "?")), Path(str(meta.get("model", "?"))).name,
                         str(meta.get("level", "?")), failing, _human(snapshots.size_of(d))])
        print(_columns(["id", "written", "model", "level", "failing taps", "size"], rows))
        return 0
    if args.action == "show":
        d = _snapshot(root, args.id)
        meta = _read_json(d / "meta.json")
        fails = _failing(_read_json(d / "diff.json"))
        print(f"snapshot {d.name}  ({d})")
        for k in ("run", "written", "model", "format", "level", "report", "prompts_sha256"):
            print(f"  {k:<15}{meta.get(k, '—')}")
        print(f"\nfailing taps ({len(fails)}):")
        print(_columns(TAP_HEAD, _tap_rows(fails)))
        for t in fails:  # the worst element of each source; inherited taps only echo it
            if t.get("message") and t.get("role") != "inherited":
                print(f"  {t['message']}")
        print(f"\ntensors: {d / 'reference.safetensors'}, {d / 'candidate.safetensors'} "
              f"({_count_tensors(d / 'reference.safetensors')} each, keys TAP@prompt)")
        print(f"reproduce: {meta.get('command') or '(no command recorded)'}")
        return 0
    if args.action == "diff":
        da, db = _snapshot(root, args.id1), _snapshot(root, args.id2)
        ma, mb = _read_json(da / "meta.json"), _read_json(db / "meta.json")
        for k in ("model", "prompts_sha256"):
            if ma.get(k) != mb.get(k):
                _warn("snapshots", f"{k} differs: {ma.get(k)} ({da.name}) vs {mb.get(k)} ({db.name})")
        fa = {tap_key(t): t for t in _failing(_read_json(da / "diff.json"))}
        fb = {tap_key(t): t for t in _failing(_read_json(db / "diff.json"))}
        appeared = [fb[n] for n in fb if n not in fa]
        gone = [fa[n] for n in fa if n not in fb]
        changed, same = [], 0
        for n in (n for n in fb if n in fa):
            ea, eb = (fa[n].get("metrics") or {}).get("max_abs"), (fb[n].get("metrics") or {}).get("max_abs")
            ra, rb = fa[n].get("role"), fb[n].get("role")
            if ra == rb and ea is not None and eb is not None and math.isclose(ea, eb, rel_tol=1e-6, abs_tol=0):
                same += 1
                continue
            ratio = f"{eb / ea:.3g}x" if ea and eb is not None else "—"
            changed.append([n, _g(ea), _g(eb), ratio, f"{ra} -> {rb}" if ra != rb else str(rb)])
        print(f"{da.name} -> {db.name}")
        print(f"\nappeared (failing only in {db.name}): {len(appeared)}")
        if appeared:
            print(_columns(TAP_HEAD, _tap_rows(appeared)))
        print(f"\ndisappeared (failing only in {da.name}): {len(gone)}")
        if gone:
            print(_columns(TAP_HEAD, _tap_rows(gone)))
        print(f"\nchanged error (failing in both): {len(changed)}")
        if changed:
            print(_columns(["tap", f"max_abs {da.name}", f"max_abs {db.name}", "ratio", "role"], changed))
        print(f"\nunchanged (failing in both, same error): {same}")
        return 0
    # prune
    if args.keep < 1 or args.max_gb < 0:
        raise ValueError(f"--keep must be at least 1 and --max-gb at least 0 (got {args.keep}, {args.max_gb})")
    sizes = {d: snapshots.size_of(d) for d in snapshots.runs(root)}
    removed = snapshots.prune(root, args.keep, args.max_gb)
    for d in removed:
        print(f"removed {d.name} ({_human(sizes.get(d, 0))})")
    left = snapshots.runs(root)
    print(f"kept {len(left)} snapshot(s) under {root}, {_human(sum(snapshots.size_of(d) for d in left))} "
          f"(--keep {args.keep}, --max-gb {args.max_gb:g})")
    return 0


def _count_tensors(path: Path) -> int | str:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return len(list(f.keys()))
    except Exception:  # noqa: BLE001 - a damaged file is shown as such, the rest still prints
        return "? (unreadable)"


# -- report -------------------------------------------------------------------------------------


def _report(args: argparse.Namespace) -> int:
    from vllm_parity.harness.report import render

    run_dir = Path(args.run_dir)
    if not (run_dir / "report.json").is_file():
        raise ValueError(f"{run_dir}: no report.json — not a report directory")
    try:
        render(run_dir)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{run_dir / 'report.json'}: not valid JSON ({exc})") from None
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{run_dir / 'report.json'}: not a complete parity-report/1 ({exc!r} missing or "
                         f"malformed)") from None
    print(run_dir / "summary.md")
    print(run_dir / "report.html")
    return 0


# -- trend --------------------------------------------------------------------------------------


def _trend(args: argparse.Namespace) -> int:
    from vllm_parity.harness import trend

    if args.append:
        src = Path(args.append)
        path = src / "report.json" if src.is_dir() else src
        report = _read_json(path)
        sha = (report.get("run") or {}).get("model_sha256") if isinstance(report, dict) else None
        model = Path(str((report.get("run") or {}).get("model", ""))) if isinstance(report, dict) else None
        if sha is None and model is not None and model.is_dir():
            from vllm_parity.fixtures.default_model import checkpoint_sha256

            sha = checkpoint_sha256(model)
        if sha is None:
            _warn("trend", f"{path}: no model hash and model directory {model} not found; drift cannot tell a "
                           f"model change from a regression for this run")
        try:
            row = trend.append(args.file, report, model_sha256=sha)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a complete parity-report/1 ({exc!r})") from None
        print(f"appended run {row['run']} ({len(row['taps'])} taps) to {args.file}", file=sys.stderr)
    try:
        rows = trend.load(args.file)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    found = trend.drift(rows, tap=args.tap, window=args.window, factor=args.factor)
    if args.json:
        print(json.dumps(json_clean({"file": str(args.file), "runs": len(rows), "drift": found}), indent=1))
    else:
        print(trend.table(rows, tap=args.tap, last=args.last), end="")
        print()
        if found:
            for d in found:
                print(f"drift: {d['message']}")
        else:
            print(f"no drift over the last {min(args.window, len(rows))} comparable run(s) "
                  f"(factor {args.factor:g}, window {args.window})")
    return 1 if found and args.fail_on_drift else 0


def _add_debug_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diff", help="compare two dump directories tap by tap",
                       description="Compare two dump directories (A as reference, B as candidate) tap by tap. "
                                   "Exit status: 0 all taps pass, 1 some fail, 2 bad input.")
    p.add_argument("dump_a", metavar="DUMP_A", help="dump directory taken as the reference")
    p.add_argument("dump_b", metavar="DUMP_B", help="dump directory taken as the candidate")
    p.add_argument("--taps", metavar="GLOB", help="compare only taps matching GLOB, e.g. 'layers.3.*'")
    p.add_argument("--tolerances", metavar="FILE",
                   help="TOML tolerances (default: [tool.parity] of ./pyproject.toml, else dtype defaults)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON (schema parity-diff/1)")
    p.set_defaults(func=_diff)

    p = sub.add_parser("snapshots", help="list, show, compare and prune snapshots of failing taps")
    ssub = p.add_subparsers(dest="action", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", default=".parity/snapshots", help="snapshot root (default .parity/snapshots)")
    ssub.add_parser("list", parents=[common], help="every snapshot, newest first")
    s = ssub.add_parser("show", parents=[common], help="one snapshot: metadata, failing taps, the command")
    s.add_argument("id", metavar="ID", help="snapshot id (or a unique prefix)")
    s = ssub.add_parser("diff", parents=[common], help="failing taps that appear, disappear or change")
    s.add_argument("id1", metavar="ID1")
    s.add_argument("id2", metavar="ID2")
    s = ssub.add_parser("prune", parents=[common], help="keep the newest N snapshots, at most X GB")
    s.add_argument("--keep", type=int, default=20, metavar="N", help="snapshots to keep (default 20)")
    s.add_argument("--max-gb", type=float, default=2.0, metavar="X", help="size cap in GB (default 2)")
    p.set_defaults(func=_snapshots)

    p = sub.add_parser("report", help="re-render report.html and summary.md from report.json")
    p.add_argument("run_dir", metavar="RUN_DIR", help="report directory holding report.json")
    p.set_defaults(func=_report)

    p = sub.add_parser("trend", help="the nightly trend of each tap's minimum passing atol, and drift",
                       description="Show the trend file as a table and warn about taps whose minimum passing "
                                   "atol drifts upward. Exit status: 0 (1 with --fail-on-drift and drift), "
                                   "2 bad input.")
    p.add_argument("file", metavar="FILE", help="trend file (JSON Lines, one run per line)")
    p.add_argument("--tap", metavar="GLOB", help="only taps matching GLOB")
    p.add_argument("--append", metavar="REPORT",
                   help="first append a run: its report directory or report.json")
    p.add_argument("--window", type=int, default=7, metavar="N", help="runs the drift check spans (default 7)")
    p.add_argument("--factor", type=float, default=2.0, metavar="F",
                   help="growth over the window that counts as drift (default 2)")
    p.add_argument("--last", type=int, default=10, metavar="N", help="runs shown in the table (default 10)")
    p.add_argument("--json", action="store_true", help="print the drift findings as JSON")
    p.add_argument("--fail-on-drift", action="store_true", help="exit 1 when a tap drifts")
    p.set_defaults(func=_trend)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ParityInputError, ValueError) as exc:
        print(f"parity {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
