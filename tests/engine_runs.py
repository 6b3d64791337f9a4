"""Running the harness as a user does: pytest in a subprocess (pytester), and the vLLM plugin variant
that plants faults."""

import json
import sys


def run(pytester, *args, stdin=None):
    # option=value: pytest picks its rootdir before plugin options are known, and would take a
    # separate value for a path to collect
    result = pytester.run(sys.executable, "-m", "pytest", f"--basetemp={pytester.path / 'tmp'}",
                          "-p", "no:cacheprovider", "-rs", f"--parity-report={pytester.path / 'report'}",
                          f"--parity-snapshot-dir={pytester.path / 'snap'}", *args, timeout=600,
                          **({"stdin": stdin} if stdin is not None else {}))
    return result


def report(pytester):
    return json.loads((pytester.path / "report" / "report.json").read_text())


ZOO_PLUGIN = '''
"""A test-only variant of the vLLM plugin: several layers, each with its own planted fault."""
import dataclasses, os

import torch


def pytest_configure(config):
    from vllm.model_executor.layers.quantization import register_quantization_config

    from vllm_parity.serving import vllm as vllm_plugin
    from vllm_parity.serving.vllm.ternary import TernaryConfig
    from vllm_parity.serving.vllm.ternary import TernaryLinearMethod

    faults = dict(item.split("=") for item in os.environ["PARITY_TEST_FAULTS"].split(","))
    CHANNEL = 100
    vllm_plugin.register()

    class AfterLoad(TernaryLinearMethod):
        def __init__(self, spec, modules, change):
            super().__init__(spec, modules)
            self.change = change

        def process_weights_after_loading(self, layer):
            super().process_weights_after_loading(layer)
            self.change(layer)

    kv = int(os.environ.get("PARITY_TEST_KV", "64"))

    class SwappedSlices(TernaryLinearMethod):  # k and v columns of the fused output exchanged
        def apply(self, layer, x, bias=None):
            y = super().apply(layer, x, bias)
            q, k, v = y.split([layer.parity_n - 2 * kv, kv, kv], dim=-1)
            return torch.cat([q, v, k], dim=-1)

    def regroup(layer):  # the kernel indexes scales with twice the group size
        s = layer.parity_scale
        s.copy_(s[:, torch.arange(s.shape[1]) // 2])

    def bf16(layer):
        layer.parity_scale.copy_(layer.parity_scale.to(torch.bfloat16).to(torch.float32))

    class ZooConfig(TernaryConfig):
        def make_method(self, modules):
            kind = next((faults[m] for m in modules if m in faults), None)
            spec = self.spec
            if kind == "code_table":
                return TernaryLinearMethod(dataclasses.replace(spec, code_map=(0, -1, 1, None)), modules)
            if kind == "bit_order":
                return TernaryLinearMethod(dataclasses.replace(spec, bit_order="msb"), modules)
            if kind == "pack_layout":
                return TernaryLinearMethod(dataclasses.replace(spec, pack_layout="blocked"), modules)
            if kind == "scale_inverted":
                return TernaryLinearMethod(dataclasses.replace(spec, scale_mode="divide"), modules)
            if kind == "scale_missing":
                return AfterLoad(spec, modules, lambda layer: layer.parity_scale.fill_(1.0))
            if kind == "scale_dtype":
                return AfterLoad(spec, modules, bf16)
            if kind == "group_size":
                return AfterLoad(spec, modules, regroup)
            if kind == "channel_scale":  # one output channel's scale off by 1 %
                return AfterLoad(spec, modules, lambda layer: layer.parity_scale[CHANNEL].mul_(1.01))
            if kind == "slices_swapped":
                return SwappedSlices(spec, modules)
            return super().make_method(modules)

    register_quantization_config("ternary")(ZooConfig)
'''


def session(model, tmp_path, name, llm=None, **opts):
    """An in-process parity run (as the pytest plugin makes it) on ``model``, writing under ``tmp_path / name``;
    ``llm``: an engine handed over by an earlier run on the same checkpoint."""
    from vllm_parity.harness.session import Options, ParitySession

    return ParitySession(Options(model=str(model), report_dir=str(tmp_path / name / "report"),
                                 snapshot_dir=str(tmp_path / name / "snap"), root=str(tmp_path), **opts), llm=llm)


def checked_engine(model, tmp_path, check, **opts):
    """A clean run's checks (``check(session)``), then its engine, handed over for a faulty run on ``model``."""
    clean = session(model, tmp_path, "clean", **opts)
    try:
        check(clean)
        return clean.hand_over()
    finally:
        clean.finish()


def doubled_channel_is_found(llm, model, tmp_path, change) -> None:
    """``change(vllm_model)`` doubles output channel 5 of layer 1's down projection in the engine: the run on it
    finds exactly that tap as the source, with the hint that the channel's scale is off by 2."""
    llm.apply_model(change)
    faulty = session(model, tmp_path, "faulty", llm=llm, level="op")
    try:
        assert [t.name for t in faulty.judgement().taps if t.role == "source"] == ["layers.1.mlp.down"]
        (hint, *_) = faulty.diagnosis().of("layers.1.mlp.down")
        assert hint.kind == "scale_wrong" and "channel(s) × 2 (channels 5)" in hint.evidence, hint
    finally:
        faulty.finish()


def other_bit_order(model, module: str):
    """``module``'s ternary weight decoded with the other bit order: what a kernel reading it wrongly uses."""
    import dataclasses

    from vllm_parity.reference.checkpoint import Checkpoint
    from vllm_parity.reference.formats import ternary

    ckpt = Checkpoint(model)
    n, k = ckpt.linear_shapes()[module]
    flipped = dataclasses.replace(ckpt.spec, bit_order="msb" if ckpt.spec.bit_order == "lsb" else "lsb")
    return ternary.decode(ckpt.tensor(f"{module}.{flipped.weight_name}"), ckpt.tensor(f"{module}.{flipped.scale_name}"),
                          flipped, n, k)


def tensor_parallel_dumps(model, arch: str, prompts, root, each=None) -> dict:
    """vLLM's dumps of ``prompts`` at TP1 and TP2, ``{tp: DumpReader}``; ``each(llm, tp)`` runs on each engine."""
    from vllm_parity.architectures import lookup
    from vllm_parity.harness import vllm_side
    from vllm_parity.harness.engine import close_llm, make_llm

    dumps = {}
    for tp in (1, 2):
        llm = make_llm(model, tensor_parallel_size=tp)
        try:
            if each is not None:
                each(llm, tp)
            dumps[tp] = vllm_side.capture(llm, lookup(arch), prompts, root / f"tp{tp}")
        finally:
            close_llm(llm)
    return dumps


def assert_same_dumps(one, two, tol: float = 1e-4) -> None:
    """Two dumps of one model, TP2 gathered against TP1: every tap of every prompt, same shape, within ``tol``."""
    import torch

    assert two.manifest["tensor_parallel_size"] == 2 and one.taps() == two.taps()
    for tap in one.taps():
        for p in one.prompts(tap):
            a, b = one.get(tap, p), two.get(tap, p)
            assert a.shape == b.shape, tap
            torch.testing.assert_close(b, a, rtol=tol, atol=tol, msg=lambda m: f"{tap}@{p}: {m}")


def has_wna16() -> bool:
    """Whether vLLM's CPU build here has its 4-bit kernel (every W4A16, AWQ and GPTQ path runs on it)."""
    import torch
    import vllm._custom_ops  # noqa: F401  (loads the build's kernels)

    return hasattr(torch.ops._C, "cpu_gemm_wna16")


def four_bit_checked(model, tmp_path, faults: dict, faulty_model=None, dtype: str = "bfloat16") -> list[bool]:
    """A 4-bit checkpoint served in ``dtype`` passes every level (skipped where vLLM has no 4-bit kernel); then, on
    the same engine, ``faults`` (``{tap: (change for llm.apply_model, hint kind, a regex its evidence matches)}``,
    one tap each) planted at once: in isolated mode (auto's choice in half precision) exactly those taps are sources, each with
    its hint first. ``faulty_model``: the checkpoint the faulty run's reference reads, where a fault is in how
    vLLM reads the checkpoint (the engine's layers then reloaded as vLLM would read that checkpoint). Returns,
    per fault, whether its layer ran vLLM's W4A8 kernel (the changes' answers)."""
    import re

    import pytest

    if not has_wna16():
        pytest.skip("vLLM's CPU build here has no cpu_gemm_wna16 (AVX-512 builds only): the refusal is checked "
                    "instead")

    def passes(s):
        assert s.mode == "isolated" and not [t.name for t in s.judgement().taps if not t.verdict]
        for check in ("greedy", "topk", "logprobs"):
            assert s.check(check)["passed"], (check, s.check(check))

    llm = checked_engine(model, tmp_path, passes, level="model", dtype=dtype)
    w4a8 = [llm.apply_model(change)[0] for change, _, _ in faults.values()]
    faulty = session(faulty_model or model, tmp_path, "faulty", llm=llm, level="op", dtype=dtype)
    try:
        assert faulty.mode == "isolated"
        assert sorted(t.name for t in faulty.judgement().taps if t.role == "source") == sorted(faults)
        for tap, (_, kind, says) in faults.items():
            hints = faulty.diagnosis().of(tap)
            assert hints and hints[0].kind == kind and re.search(says, hints[0].evidence), (tap, hints)
    finally:
        faulty.finish()
    return w4a8


def four_bit_refused(model, tmp_path, method: str) -> None:
    """Where vLLM has no 4-bit kernel, the run stops with the reason (skipped where it has one)."""
    import pytest

    from vllm_parity.errors import EngineUnsupported

    if has_wna16():
        pytest.skip("vLLM's 4-bit CPU kernel is built here: the run is judged instead")
    s = session(model, tmp_path, "w4", level="block", dtype="bfloat16")
    try:
        with pytest.raises(EngineUnsupported, match=rf"vLLM cannot serve this {method} checkpoint .* no kernel "
                                                    rf"'cpu_gemm_wna16' \(built for AVX-512"):
            s.judgement()
    finally:
        s.finish()


def four_bit_scales_changed(module: str, fault: str, channel: int = 5):
    """A change for ``llm.apply_model``: one unfused projection's 4-bit group scales, as vLLM's CPU kernel keeps
    them after loading, changed by ``fault``: ``channel`` (every scale of output ``channel`` × 2), ``next_group``
    (each group scaled by the next group's scales), ``pairs`` (the scales of neighbouring groups exchanged).

    With AMX in bf16 vLLM repacks for its W4A8 kernel: scales float32 in blocks (N / 32, G, 32); its W4A16
    kernel keeps them (G, N). Either way the scales stay apart from the codes, so they can be changed in place."""

    def change(model):
        import torch

        layer = model.get_submodule(module)
        t = (layer.weight_scale if hasattr(layer, "weight_scale") else layer.scales).data
        blocked = bool(getattr(layer, "use_w4a8", False))
        v = t.permute(1, 0, 2).reshape(t.shape[1], -1).clone() if blocked else t.clone()  # (G, N)
        groups = torch.arange(v.shape[0])
        if fault == "channel":
            v[:, channel] *= 2
        elif fault == "next_group":
            v = v[(groups + 1) % len(groups)]
        elif fault == "pairs":
            v = v[groups.reshape(-1, 2).flip(1).reshape(-1)]
        else:
            raise ValueError(f"unknown scale fault {fault!r}; known: channel, next_group, pairs")
        t.copy_(v.reshape(t.shape[1], t.shape[0], t.shape[2]).permute(1, 0, 2) if blocked else v)
        return blocked
    return change


def four_bit_reloaded(module: str, tensors: dict, dtype: str = "bfloat16"):
    """A change for ``llm.apply_model``: one unfused projection's 4-bit parameters set to ``tensors`` (name →
    tensor, in the layout vLLM's CPU kernel takes at load: compressed-tensors' as stored, AWQ's after vLLM turned
    it into GPTQ's) and the kernel's ``process_weights_after_loading`` run again over them, as at load. For faults
    in the kernel's blocked layout, where a zero point or a code also enters a precomputed compensation."""

    def change(model):
        import torch

        layer = model.get_submodule(module)
        kernel = getattr(getattr(layer, "scheme", None), "kernel", None) or layer.quant_method.kernel
        for name, t in tensors.items():
            getattr(layer, name).data = t.to(getattr(torch, dtype)) if t.is_floating_point() else t.clone()
        kernel.process_weights_after_loading(layer)
        return bool(getattr(layer, "use_w4a8", False))
    return change


def stored(model, module: str) -> dict:
    """``module``'s tensors in a one-file checkpoint, by their names within the module."""
    from pathlib import Path

    from safetensors.torch import load_file

    return {k.removeprefix(f"{module}."): v for k, v in load_file(Path(model) / "model.safetensors").items()
            if k.startswith(f"{module}.")}


def nibbles(words, dim: int):
    """The eight 4-bit values of each int32 word of ``words``, lowest first, laid along ``dim``."""
    import torch

    v = (words.unsqueeze(-1) >> torch.arange(0, 32, 4, dtype=torch.int32)) & 15
    v = v.movedim(-1, dim + 1) if dim == 0 else v
    return v.reshape(*words.shape[:dim], words.shape[dim] * 8, *words.shape[dim + 1:])


def words(values, dim: int):
    """``values`` (0..15) packed eight a word along ``dim``, the first in the lowest bits (vLLM's standard)."""
    import torch

    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8) << torch.arange(0, 32, 4)
    packed = v.sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).movedim(-1, dim)
