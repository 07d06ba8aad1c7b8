"""benchmarks/gguf_skeleton.py, which moved the test files' shapes to the GPU machine for results/cuda-gguf-h200-*:
a file shrunk to its skeleton and grown back has the source's metadata and every tensor's name, type and shape, with
finite weights, and loads as the source does."""
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

from edgellm.loading import load_model
from tests.fixtures.tiny import make_gguf, make_hf_model
from tests.test_gguf_as_stored import K_MIX, LEGACY_MIX, SHAPE

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gguf_skeleton.py"


def test_shrink_then_grow_keeps_the_file_but_its_values(tmp_path):
    types = dict(K_MIX, **{"ffn_up.weight": "Q5_1", "attn_k.weight": LEGACY_MIX["attn_k.weight"]})
    source = make_gguf(make_hf_model(tmp_path / "hf", "llama_gqa", seed=3, **SHAPE), tmp_path / "src.gguf",
                       quant_types=types, seed=7)
    skeleton, grown = tmp_path / "src.skel.gguf", tmp_path / "grown.gguf"
    for verb, a, b in (("shrink", source, skeleton), ("grow", skeleton, grown)):
        subprocess.run([sys.executable, str(SCRIPT), verb, str(a), str(b)], check=True, capture_output=True)
    assert skeleton.stat().st_size < source.stat().st_size / 4
    src, out = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(grown))
    assert [(t.name, t.tensor_type, list(t.shape)) for t in src.tensors] == \
           [(t.name, t.tensor_type, list(t.shape)) for t in out.tensors]
    meta = {k: f.contents() for k, f in src.fields.items() if not k.startswith("GGUF.")}
    assert meta == {k: f.contents() for k, f in out.fields.items() if not k.startswith("GGUF.")}
    for t in out.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(values).all(), t.name  # the fp16 scales (and min scales) set, not random bytes
    quantized = [i for i, t in enumerate(src.tensors) if t.tensor_type not in (gguf.GGMLQuantizationType.F32,
                                                                              gguf.GGMLQuantizationType.F16)]
    assert quantized and not np.array_equal(out.tensors[quantized[0]].data, src.tensors[quantized[0]].data)  # new
    model = load_model(grown, weights="auto").model
    assert model.config.n_layers == load_model(source, weights="auto").model.config.n_layers
