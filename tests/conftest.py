import os

import pytest

from edgellm.torch_import import deferred_meta_kernels

with deferred_meta_kernels():  # torch imported as the `edgellm` command imports it (edgellm/torch_import.py)
    import torch

from tests.fixtures.tiny import VARIANTS, make_gguf, make_hf_model

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{variant: (hf_folder, gguf_path)} for every tiny variant, built once per session."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for i, variant in enumerate(VARIANTS):
        folder = make_hf_model(root / variant, variant, seed=i)
        out[variant] = (folder, make_gguf(folder, root / f"{variant}.gguf"))
    return out


@pytest.fixture(scope="session")
def tiny_llama(tiny_models):
    return tiny_models["llama_gqa"]


@pytest.fixture(scope="session")
def bundled_path():
    from edgellm.loading import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def bundled(bundled_path):
    """The bundled SmolLM2-135M-Instruct loaded once (fp32, CPU)."""
    from edgellm.loading import load_model

    return load_model(bundled_path, max_seq_len=2048, weights="fp")


@pytest.fixture
def exact_matmul():
    """Options for the C++ CPU kernel in its float-fma variant: exact to the dequantized reference (fp32 order).
    Pass them to load_model / Engine."""
    from edgellm.options import KernelOptions, Options

    return Options(kernel=KernelOptions(activations="fp32"))
