"""Hypothesis profiles shared by every test module: dev (default), ci (CI=true), nightly; tests marked
``nightly`` run only where PARITY_NIGHTLY=1 (the nightly workflow)."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Triton decides between compiling and interpreting when a kernel is decorated, so the choice must
# be made before any module defines one: without a GPU, kernels run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytester drops the modules a test imported when its in-process run ends, but transformers' lazy mappings
# keep the modules they imported: a later import makes a second ``LlamaConfig`` class (which vLLM's workers
# then cannot unpickle), and transformers' generation code registers torch operators, which cannot happen
# twice in a process. So the configuration and modeling modules of every known architecture load here, once.
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING  # noqa: E402

from vllm_parity.architectures import known  # noqa: E402

for _model_type in known():
    if _model_type in CONFIG_MAPPING:
        MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[_model_type]]

settings.register_profile("dev", max_examples=25, deadline=None)
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PARITY_NIGHTLY") == "1":
        return
    skip = pytest.mark.skip(reason="nightly: runs in the nightly gate (PARITY_NIGHTLY=1)")
    for item in items:
        if item.get_closest_marker("nightly") is not None:
            item.add_marker(skip)
