"""How the Triton tests run, imported before anything imports triton: under TRITON_INTERPRET=1 on CPU tensors by
default (CI, no GPU); with TRITON_INTERPRET=0 on a CUDA machine, compiled on the GPU. Skips the importing module
where triton is missing, or compiled Triton is asked for without a GPU."""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere
pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[cuda]')")

INTERPRET = os.environ["TRITON_INTERPRET"] not in ("0", "")
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("compiled Triton (TRITON_INTERPRET=0) needs a CUDA device", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"
