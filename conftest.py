"""Hypothesis profiles shared by every test module: dev (default), ci (CI=true), nightly."""

import os

import torch
from hypothesis import HealthCheck, settings

# Triton decides between compiling and interpreting when a kernel is decorated, so the choice must
# be made before any module defines one: without a GPU, kernels run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytester drops the modules a test imported when the test ends; transformers' generation code (which
# reading a checkpoint's shapes imports) registers torch operators, which cannot happen twice in a process.
import transformers.generation.utils  # noqa: E402, F401

settings.register_profile("dev", max_examples=25, deadline=None)
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))
