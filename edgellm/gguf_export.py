"""GGUF export: a quantized model written as a GGUF that llama.cpp / Ollama can run.

Group-32 int8 → Q8_0, int4 sym → Q4_0, int4 asym → Q4_1 (our packed codes are those blocks, byte for byte:
quant/groups.py `to_gguf`), floats → F32; the fused Q/K/V and gate/up split back into llama.cpp's tensors, Q/K
rows permuted back to its layout, the tokenizer described in GGUF metadata. Written atomically.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from .atomic import AtomicFile
from .config import ModelConfig, rope_inv_freq
from .errors import QuantizationError
from .gguf_file import permute_rope_rows
from .quant.convert import quantized_tensors, row_op, split_rows
from .quant.groups import QuantizedTensor, to_gguf


def export_gguf(loaded, out: Path, progress: Callable[[str], None] | None = None) -> Path:
    """Write the quantized model as GGUF: group-32 int8 → Q8_0, int4 sym → Q4_0, int4 asym → Q4_1,
    floats → F32; fused Q/K/V and gate/up split back; Q/K rows permuted back to llama.cpp's layout."""
    import gguf
    import numpy as np

    model, cfg, tok = loaded.model, loaded.config, loaded.tokenizer
    qts = quantized_tensors(model)
    for name, qt in qts.items():
        if qt.group_size != 32 and not (qt.bits == 8 and qt.group_size == 32):
            raise QuantizationError(f"GGUF export needs group size 32 ({name} uses {qt.group_size}); "
                                    f"quantize with --group-size 32")
    if tok.meta.get("model") not in ("gpt2", "llama"):
        raise QuantizationError("GGUF export: this tokenizer cannot be described in GGUF metadata")
    if cfg.arch not in ("llama", "mistral", "qwen2"):
        raise QuantizationError(f"GGUF export writes the llama and qwen2 architectures; this model is {cfg.arch}: "
                                f"use --format edgellm")
    arch = "qwen2" if cfg.arch == "qwen2" else "llama"
    permute = arch == "llama"

    def add(writer, name: str, value) -> None:
        if isinstance(value, QuantizedTensor):
            raw, ggml_type = to_gguf(value)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=ggml_type)
        else:
            writer.add_tensor(name, value.detach().float().cpu().numpy())
        if progress:
            progress(name)

    def weight(module_name: str):
        if module_name in qts:
            return qts[module_name]
        return model.get_submodule(module_name).weight

    def rows(value, sizes: list[int]):
        if isinstance(value, QuantizedTensor):
            return split_rows(value, sizes)
        return list(value.split(sizes, dim=0))

    def perm(value, heads: int):
        if not permute:
            return value
        if isinstance(value, QuantizedTensor):
            return row_op(value, lambda t: permute_rope_rows(t, heads).contiguous(), value.shape[0])
        return permute_rope_rows(value, heads)

    with AtomicFile(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch)
        w.add_name(Path(str(loaded.path)).stem)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.dim)
        w.add_block_count(cfg.n_layers)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.n_heads)
        w.add_head_count_kv(cfg.n_kv_heads)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_vocab_size(cfg.vocab_size)
        if cfg.rope_scaling and cfg.rope_scaling["rope_type"] in ("linear", "yarn"):
            w.add_rope_scaling_type(gguf.RopeScalingType(cfg.rope_scaling["rope_type"]))
            w.add_rope_scaling_factor(float(cfg.rope_scaling.get("factor", 1.0)))
        _add_tokenizer(w, tok)
        if cfg.extra.get("rope_freqs"):
            w.add_tensor("rope_freqs.weight", np.asarray(cfg.extra["rope_freqs"], dtype=np.float32))
        elif cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3":
            plain = ModelConfig(**{**cfg.to_dict(), "rope_scaling": None})
            ratio = rope_inv_freq(plain)[0] / rope_inv_freq(cfg)[0]
            w.add_tensor("rope_freqs.weight", ratio.float().numpy())
        add(w, "token_embd.weight", weight("tok_embeddings"))
        for i in range(cfg.n_layers):
            pre = f"layers.{i}."
            q, k, v = rows(weight(pre + "attention.wqkv"), [cfg.q_size, cfg.kv_size, cfg.kv_size])
            add(w, f"blk.{i}.attn_q.weight", perm(q, cfg.n_heads))
            add(w, f"blk.{i}.attn_k.weight", perm(k, cfg.n_kv_heads))
            add(w, f"blk.{i}.attn_v.weight", v)
            bias = model.get_submodule(pre + "attention.wqkv").bias
            if bias is not None:
                bq, bk, bv = bias.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
                add(w, f"blk.{i}.attn_q.bias", perm(bq, cfg.n_heads))
                add(w, f"blk.{i}.attn_k.bias", perm(bk, cfg.n_kv_heads))
                add(w, f"blk.{i}.attn_v.bias", bv)
            add(w, f"blk.{i}.attn_output.weight", weight(pre + "attention.wo"))
            gate, up = rows(weight(pre + "feed_forward.w13"), [cfg.intermediate_size] * 2)
            add(w, f"blk.{i}.ffn_gate.weight", gate)
            add(w, f"blk.{i}.ffn_up.weight", up)
            add(w, f"blk.{i}.ffn_down.weight", weight(pre + "feed_forward.w2"))
            add(w, f"blk.{i}.attn_norm.weight", model.get_submodule(pre + "attention_norm").weight)
            add(w, f"blk.{i}.ffn_norm.weight", model.get_submodule(pre + "ffn_norm").weight)
        add(w, "output_norm.weight", model.norm.weight)
        if not cfg.tie_embeddings:
            add(w, "output.weight", weight("output"))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return out


def _add_tokenizer(w, tok) -> None:
    spec = json.loads(tok.backend.to_str())
    vocab = dict(spec["model"]["vocab"])
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    for t, i in vocab.items():
        tokens[i] = t
    specials = {a["id"] for a in spec.get("added_tokens", []) if a.get("special")}
    w.add_tokenizer_model(tok.meta["model"])
    w.add_tokenizer_pre(tok.meta.get("pre", "default"))
    w.add_token_list(tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    if tok.meta["model"] == "llama":
        # sentencepiece merges the pair whose result scores highest: score = -merge rank keeps our order
        rank = {m.replace(" ", ""): -float(r) for r, m in reversed(list(enumerate(merges)))}
        w.add_token_scores([rank.get(t, -1e6) for t in tokens])
        types = [3 if i in specials else 6 if t.startswith("<0x") and len(t) == 6 else 1 for i, t in enumerate(tokens)]
    else:
        types = [3 if i in specials else 1 for i in range(size)]
    w.add_token_types(types)
    if merges and tok.meta["model"] == "gpt2":
        w.add_token_merges(merges)
    if tok.bos_id is not None:
        w.add_bos_token_id(tok.bos_id)
    eos = tok.backend.token_to_id(tok.eos_token) if tok.eos_token else None
    if eos is None and tok.eos_ids:
        eos = min(tok.eos_ids)
    if eos is not None:
        w.add_eos_token_id(eos)
    w.add_add_bos_token(bool(tok.add_bos))
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)
