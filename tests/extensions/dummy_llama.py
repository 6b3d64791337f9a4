"""A user's architecture, as the harness needs it: one data file. This one is Llama under another
``model_type`` (transformers and vLLM are taught the name in ``libraries.py``)."""

import dataclasses

from vllm_parity.architectures import register
from vllm_parity.architectures.llama import LLAMA

DUMMY_LLAMA = register(dataclasses.replace(LLAMA, model_type="parity_dummy_llama"))
