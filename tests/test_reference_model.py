import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

from vllm_parity.architectures import lookup
from vllm_parity.fixtures.checkpoints import Dims, make_fixture
from vllm_parity.fixtures.prompts import load_prompts
from vllm_parity.reference.formats import ternary
from vllm_parity.reference.checkpoint import Checkpoint
from vllm_parity.reference.formats.ternary import PRESETS
from vllm_parity.reference.linear import ReferenceLinear, activation_fake_quant
from vllm_parity.reference.model import build_reference_model, set_precision

from tests.strategies import ternary_matrices, ternary_specs

SMALL = Dims(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256, vocab=1024)


@pytest.fixture(scope="module")
def fixture_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref")
    return {fmt: make_fixture(fmt, root / fmt, dims=SMALL) for fmt in ("fp", "seed-article", "hf-bitnet", "int8x")}


def _ids():
    return torch.tensor([p[:32] for p in load_prompts()])


def test_fp_reference_equals_transformers_llama(fixture_dirs):
    ref = build_reference_model(fixture_dirs["fp"])
    hf = LlamaForCausalLM.from_pretrained(fixture_dirs["fp"], dtype=torch.float32,
                                          attn_implementation="eager").eval()
    with torch.no_grad():
        a, b = ref(_ids()).logits, hf(_ids()).logits
    assert a.shape == (4, 32, SMALL.vocab)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", ["seed-article", "hf-bitnet", "int8x"])
def test_quantized_projections_become_reference_linears(fixture_dirs, fmt):
    ckpt = Checkpoint(fixture_dirs[fmt])
    model = build_reference_model(ckpt)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, ReferenceLinear)}
    assert sorted(linears) == sorted(ckpt.linear_shapes())
    assert not isinstance(model.lm_head, ReferenceLinear)
    with torch.no_grad():
        logits = model(_ids()).logits
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.1  # a live model, not a constant


def test_reference_linear_weight_is_the_decoded_checkpoint(fixture_dirs):
    ckpt = Checkpoint(fixture_dirs["seed-article"])
    model = build_reference_model(ckpt)
    name = "model.layers.1.mlp.down_proj"
    n, k = ckpt.linear_shapes()[name]
    want = ternary.decode(ckpt.tensor(f"{name}.weight_ternary"), ckpt.tensor(f"{name}.weight_scale"),
                          ckpt.spec, n, k)
    assert torch.equal(model.get_submodule(name).weight(), want)


@pytest.mark.parametrize("fmt", ["seed-article", "int8x"])
def test_uncached_and_fp64_modes(fixture_dirs, fmt):
    cached = build_reference_model(fixture_dirs[fmt])
    lazy = build_reference_model(fixture_dirs[fmt], cache=False)
    assert all(m.cached_weight is None for m in lazy.modules() if isinstance(m, ReferenceLinear))
    f64 = build_reference_model(fixture_dirs[fmt], dtype=torch.float64)
    with torch.no_grad():
        a, b, c = cached(_ids()).logits, lazy(_ids()).logits, f64(_ids()).logits
    assert torch.equal(a, b)
    assert c.dtype == torch.float64
    torch.testing.assert_close(a.double(), c, rtol=0, atol=1e-3)
    set_precision(cached, torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(cached(_ids()).logits, c, rtol=0, atol=1e-9)


@settings(max_examples=10)
@given(spec=ternary_specs(), data=st.data())
def test_reference_linear_matches_fp64_product(spec, data):
    values = data.draw(ternary_matrices(spec, max_quads=6))
    n, k = values.shape
    g = torch.Generator().manual_seed(n * 1000 + k)
    scale = (torch.rand(spec.scale_shape(n, k), generator=g) + 0.5).to(torch.float16)
    stored = {"packed": ternary.pack_values(values, spec), "scale": scale}
    lin = ReferenceLinear("w", spec, stored, n, k)
    x = torch.randn(3, 5, k, generator=g)
    w64 = ternary.decode(stored["packed"], scale, spec, n, k, dtype=torch.float64)
    if spec.activation_quant:
        xq, sx = activation_fake_quant(x.double())
        want = (xq @ w64.T) / sx
    else:
        want = x.double() @ w64.T
    got = lin(x)
    assert got.shape == (3, 5, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_hf_bitnet_reference_linear_matches_transformers_bitlinear():
    from transformers.integrations.bitnet import BitLinear

    n, k = 64, 96
    g = torch.Generator().manual_seed(7)
    values = torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8)
    spec = PRESETS["hf-bitnet"]
    scale = torch.tensor([23.5])
    packed = ternary.pack_values(values, spec)
    theirs = BitLinear(k, n, bias=False, dtype=torch.float32)
    theirs.weight.copy_(packed)
    theirs.weight_scale.copy_(scale)
    ours = ReferenceLinear("w", spec, {"packed": packed, "scale": scale}, n, k)
    x = torch.randn(4, 9, k, generator=g) * 3
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def _first_call_differs(layer):
    """The layer computes otherwise at its first call only (a library's first-call code path); returns its calls."""
    calls = []

    def hook(mod, args):
        calls.append(1)
        if len(calls) == 1:
            return (args[0] + 1e-3, *args[1:])
    return calls, layer.register_forward_pre_hook(hook)


def test_capture_does_not_depend_on_the_first_forward(fixture_dirs, tmp_path):
    """A process's first forward can take other library code paths (fp32 attention 3e-4 off, one run in
    ten on two threads); the dump must hold what every later forward computes."""
    from vllm_parity.harness.reference_side import capture

    model = build_reference_model(fixture_dirs["int8x"])
    prompts = [p[:24] for p in load_prompts()[:2]]
    calls, handle = _first_call_differs(model.model.layers[0])
    dump = capture(model, lookup("llama"), prompts, tmp_path / "dump")
    with torch.no_grad():
        steady = model(torch.tensor([prompts[0]]), use_cache=False, output_hidden_states=True).hidden_states[1]
    handle.remove()
    torch.testing.assert_close(dump.get("layers.0.output", 0), steady[0], rtol=0, atol=0)


def test_one_forward_gives_each_prompts_rows_and_its_decode_steps(fixture_dirs, tmp_path):
    """Every prompt, right-padded, and the tokens after it in one forward: each prompt's rows are what it computes
    alone, and decode step s's row what transformers' own KV-cache decode computes at that step; the first forward
    (a warm-up through the first layer) is not what is dumped."""
    from vllm_parity.harness.reference_side import capture_batch

    model = build_reference_model(fixture_dirs["seed-article"])
    prompts = [p[:n] for p, n in zip(load_prompts()[:3], (24, 9, 17))]
    tokens = [[5, 6], [7, 8], [9, 10]]
    calls, handle = _first_call_differs(model.model.layers[0])
    dump, steps = capture_batch(model, lookup("llama"), prompts, tmp_path / "dump", tokens=tokens)
    handle.remove()
    assert len(calls) == 2 and len(steps) == 2 and dump.manifest["decode"] == {"steps": 2, "tokens": tokens}
    for p, ids in enumerate(prompts):
        with torch.no_grad():
            alone = model(torch.tensor([ids]), use_cache=False, output_hidden_states=True)
            torch.testing.assert_close(dump.get("layers.0.output", p), alone.hidden_states[1][0])
            torch.testing.assert_close(dump.get("logits", p), alone.logits[0])
            out = model(torch.tensor([ids]), use_cache=True)
            for s, tok in enumerate(tokens[p]):  # decode step s runs tokens[p][s] at position len(ids) + s
                out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
                torch.testing.assert_close(steps[s].get("logits", p), out.logits[0])
                assert steps[s].manifest["first_positions"][p] == len(ids) + s


@pytest.mark.parametrize("fmt", ["seed-article", "int8x"])
def test_a_quantized_projection_keeps_its_bias(tmp_path, fmt):
    """Qwen2's q/k/v carry a bias beside their quantized weight: ``x @ W^T + b``."""
    path = make_fixture(fmt, tmp_path / fmt, dims=SMALL, arch="qwen2")
    ckpt = Checkpoint(path)
    model = build_reference_model(ckpt)
    name = "model.layers.0.self_attn.k_proj"
    lin = model.get_submodule(name)
    assert isinstance(lin, ReferenceLinear)
    bias = ckpt.tensor(f"{name}.bias")
    x = torch.randn(3, SMALL.hidden)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), x @ lin.weight().T + bias, rtol=0, atol=1e-5)
    assert model.get_submodule("model.layers.0.mlp.up_proj").bias is None
