"""Optional engine settings under the harness: the multiprocess engine, prefix caching and chunked prefill. Each
run's dumps equal the plain in-process run's, tap by tap (rows mapped from each step's metadata)."""

import argparse
import types

import pytest


def test_the_plugin_options_reach_the_run_options():
    """``--parity-prefix-caching`` and ``--parity-chunked-prefill=TOKENS`` set the run's Options (off by default)."""
    from vllm_parity.harness.plugin import OPTIONS, _options

    parser = argparse.ArgumentParser()
    for flag, _, kwargs in OPTIONS:
        parser.add_argument(flag, **kwargs)

    def opts(*args):
        ns = parser.parse_args(list(args))
        config = types.SimpleNamespace(getoption=lambda flag: getattr(ns, flag[2:].replace("-", "_")),
                                       rootpath=".", invocation_params=types.SimpleNamespace(args=args))
        return _options(config)

    plain = opts()
    assert (plain.prefix_caching, plain.chunked_prefill) == (False, 0)
    both = opts("--parity-prefix-caching", "--parity-chunked-prefill=24")
    assert (both.prefix_caching, both.chunked_prefill) == (True, 24)


def _same(one, other, tol: float = 1e-4) -> None:
    """Every tap of every prompt, and of every decode step, equal within ``tol``."""
    import torch

    assert one.taps() == other.taps()
    assert one.manifest.get("decode", {}).get("tokens") == other.manifest.get("decode", {}).get("tokens")
    for a, b in zip([one, *one.steps()], [other, *other.steps()], strict=True):
        for tap in a.taps():
            assert a.prompts(tap) == b.prompts(tap), tap
            for p in a.prompts(tap):
                torch.testing.assert_close(b.get(tap, p), a.get(tap, p), rtol=tol, atol=tol,
                                           msg=lambda m: f"{a.root.name} {tap}@{p}: {m}")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The default model's dumps from a plain in-process engine: 2 prompts, 2 decode steps."""
    pytest.importorskip("vllm", reason="the engine's own settings")
    from vllm_parity.architectures import lookup
    from vllm_parity.fixtures.default_model import default_model_dir
    from vllm_parity.fixtures.prompts import DEFAULT, load_prompts
    from vllm_parity.harness import vllm_side
    from vllm_parity.harness.engine import close_llm, make_llm

    prompts = load_prompts(DEFAULT)[:2]
    llm = make_llm(default_model_dir())
    try:
        return prompts, vllm_side.capture(llm, lookup("llama"), prompts, tmp_path_factory.mktemp("plain") / "d",
                                          decode_steps=2)
    finally:
        close_llm(llm)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.nightly
def test_multiprocess_engine_dumps_as_the_in_process_one(plain, tmp_path):
    """With VLLM_ENABLE_V1_MULTIPROCESSING=1 (engine core and worker in processes of their own, arguments sent as
    msgpack) the capture runs and gives the in-process dumps."""
    from vllm_parity.architectures import lookup
    from vllm_parity.fixtures.default_model import default_model_dir
    from vllm_parity.harness import vllm_side
    from vllm_parity.harness.engine import close_llm, make_llm

    prompts, one = plain
    llm = make_llm(default_model_dir(), multiprocessing=True)
    try:
        assert type(llm.llm_engine.engine_core).__name__ == "SyncMPClient"
        _same(one, vllm_side.capture(llm, lookup("llama"), prompts, tmp_path / "mp", decode_steps=2))
    finally:
        close_llm(llm)


CHUNK = 24  # tokens a step: the default's 64-token prompts, and the 32 positions the cache does not serve, split


@pytest.mark.vllm
@pytest.mark.slow
def test_prefix_caching_and_chunked_prefill_dump_as_the_plain_engine(plain, tmp_path):
    """With both on, every prompt's recorded prefill computes only the positions after its cached blocks, in
    chunks (assembled), the cached ones taken from the warming pass; every tap of the prefill and of each decode
    step passes the default tolerances against the plain run's."""
    from vllm_parity.architectures import lookup
    from vllm_parity.fixtures.default_model import default_model_dir
    from vllm_parity.harness import vllm_side
    from vllm_parity.harness.compare import compare_dumps
    from vllm_parity.harness.engine import PREFIX_BLOCK, close_llm, engine_features, make_llm
    from vllm_parity.harness.tolerances import ToleranceTable

    prompts, one = plain
    llm = make_llm(default_model_dir(), **engine_features(prefix_caching=True, chunked_prefill=CHUNK))
    try:
        dump = vllm_side.capture(llm, lookup("llama"), prompts, tmp_path / "features", decode_steps=2)
    finally:
        close_llm(llm)
    assert dump.manifest["engine_features"] == {"chunked_prefill": CHUNK, "prefix_caching": True}
    assert dump.manifest["prefix_cached"] == [PREFIX_BLOCK] * len(prompts)  # 64 tokens: one block served
    assert all(n >= 2 for n in dump.manifest["prefill_chunks"]), dump.manifest["prefill_chunks"]
    assert one.manifest["engine_features"] == {"chunked_prefill": 0, "prefix_caching": False}
    assert "prefix_cached" not in one.manifest
    assert dump.manifest["decode"]["tokens"] == one.manifest["decode"]["tokens"]
    for a, b in zip([one, *one.steps()], [dump, *dump.steps()], strict=True):
        results = compare_dumps(a, b, a.taps(), ToleranceTable(), arch=lookup("llama"))
        assert len(results) == len(a.taps()) and all(r.passed for r in results), \
            [(r.name, r.message) for r in results if not r.passed][:3]
    _same(one, dump, tol=1e-3)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.nightly
def test_an_isolated_run_with_both_features_passes(tmp_path):
    """The parity run's options: prefix caching and chunked prefill on, isolated (every layer and projection fed the
    reference's rows for the positions it computes), decode steps forced to the propagated run's tokens."""
    pytest.importorskip("vllm", reason="the engine's own settings")
    from vllm_parity.harness.session import Options, ParitySession

    s = ParitySession(Options(report_dir=str(tmp_path / "report"), snapshot_dir=str(tmp_path / "snap"),
                              root=str(tmp_path), level="op", mode="isolated", decode_steps=2, prefix_caching=True,
                              chunked_prefill=CHUNK))
    try:
        judgement = s.judgement()
        capture = s.capture()
        run = s.record().run
    finally:
        s.finish()
    assert not [t.label for t in judgement.taps if not t.verdict]
    assert run["schedule"]["prefix_cached"] == [32] * 4 and run["schedule"]["engine_features"]["prefix_caching"]
    assert len({t.step for t in judgement.taps}) == 3  # the prefill and both decode steps
    for dump in (capture.candidate, capture.isolated):
        assert dump.manifest["engine_features"] == {"chunked_prefill": CHUNK, "prefix_caching": True}
        assert dump.manifest["prefix_cached"] == [32] * 4


@pytest.mark.vllm
def test_the_capture_arguments_survive_the_multiprocess_engine_encoding(monkeypatch, tmp_path):
    """What capture sends its workers, encoded and decoded as vLLM's multiprocess client and engine core do
    (msgpack, pickle allowed): the architecture arrives whole (a dataclass alone would arrive as a dict)."""
    pytest.importorskip("vllm", reason="vLLM's own serialization")
    import pickle

    from vllm_parity.architectures import lookup
    from vllm_parity.harness import vllm_side

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import vllm.envs as envs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    envs.disable_envs_cache()
    sent = []

    class Stop(Exception):
        pass

    def collective_rpc(fn, args=()):
        sent.append(MsgpackDecoder().decode(MsgpackEncoder().encode((fn, args))))
        raise Stop

    config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(enable_chunked_prefill=False),
                                   cache_config=types.SimpleNamespace(enable_prefix_caching=False))
    llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(vllm_config=config), collective_rpc=collective_rpc)
    arch = lookup("llama")
    with pytest.raises(Stop):
        vllm_side.capture(llm, arch, [[1, 2, 3]], tmp_path / "d")
    fn, args = sent[0]
    assert fn is vllm_side._install_worker
    assert pickle.loads(args[1]) == arch
