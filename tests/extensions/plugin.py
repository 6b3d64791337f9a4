"""A pytest plugin for parity runs on the dummy architecture and format: the libraries learn them, and the
harness is given their files (but the one PARITY_TEST_WITHOUT names)."""

import os


def pytest_configure(config):
    from tests.extensions import libraries

    without = os.environ.get("PARITY_TEST_WITHOUT", "")
    serving = os.environ.get("PARITY_TEST_CANDIDATE", "vllm") == "vllm"
    libraries.teach_transformers()
    if serving:
        libraries.teach_vllm()
    if without != "architecture":
        import tests.extensions.dummy_llama  # noqa: F401
    if without != "format":
        from tests.extensions import dummy_int8_serving

        if serving:
            dummy_int8_serving.register_with_vllm()
