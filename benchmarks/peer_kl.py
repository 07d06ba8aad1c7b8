"""llama.cpp's own quantization of a GGUF, scored against its float original by llama.cpp itself.

    /tmp/peer/bin/python benchmarks/peer_kl.py F32.gguf OUT.gguf TYPE TEXT

Runs under llama-cpp-python's interpreter (../shared/peers/README.md), not edgellm's. Quantizes F32.gguf to
TYPE (Q8_0, Q4_0, Q4_1) with llama.cpp's quantizer, then over TEXT in windows of 512 tokens scores the second
half of each window with both models (llama-perplexity's way) and prints one JSON line: perplexity of each,
mean KL(float || quantized) of the next-token distributions, its 99th percentile, top-1 agreement.
"""
import ctypes
import json
import math
import sys

import numpy as np
import llama_cpp

CTX = 512
FTYPES = {"Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
          "Q4_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1}


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def main() -> None:
    src, dst, qtype, text = sys.argv[1:5]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[qtype]
    params.nthread = 2
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)) != 0:
        sys.exit(f"llama.cpp could not quantize {src} to {qtype}")
    models = [llama_cpp.Llama(model_path=p, n_threads=2, n_ctx=CTX, n_batch=CTX, logits_all=True, verbose=False)
              for p in (src, dst)]
    ids = models[0].tokenize(open(text, "rb").read(), add_bos=False)
    kls, agree, n, nll = [], 0, 0, [0.0, 0.0]
    for start in range(0, len(ids) - CTX + 1, CTX):
        window = ids[start:start + CTX]
        target = np.array(window[CTX // 2 + 1:])
        lps = []
        for i, llm in enumerate(models):
            llm.reset()
            llm.eval(window)
            lp = log_softmax(np.array(llm.scores[CTX // 2:CTX - 1], dtype=np.float64))
            nll[i] -= lp[np.arange(len(target)), target].sum()
            lps.append(lp)
        ref, q = lps
        kls.append((np.exp(ref) * (ref - q)).sum(-1))
        agree += int((ref.argmax(-1) == q.argmax(-1)).sum())
        n += len(target)
    kl = np.concatenate(kls)
    print(json.dumps({"type": qtype, "tokens_scored": n, "reference_perplexity": math.exp(nll[0] / n),
                      "perplexity": math.exp(nll[1] / n), "kl_mean": float(kl.mean()),
                      "kl_p99": float(np.quantile(kl, 0.99)), "top1_agreement": agree / n,
                      "llama_cpp": llama_cpp.__version__}))


if __name__ == "__main__":
    main()
