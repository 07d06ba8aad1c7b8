// The plan of cpu_decode.cpp's fused decode step: raw pointers into tensors that cpu_bindings.cpp keeps alive.
#pragma once

#include <cstdint>
#include <vector>

namespace edgellm {

// One GGUF tensor of a GGUF linear (cpu_gguf.h): its raw blocks, read in place; its rows go to out_index[n], or
// (out_index null) to the rows after the previous parts'.
struct GgufPart {
  int type = 0;
  int64_t N = 0, row_bytes = 0;
  const uint8_t* data = nullptr;
  const int32_t* out_index = nullptr;
};

struct DecodeLinear {
  enum Kind { F32 = 0, GGUF = 1, INT4 = 4, INT8 = 8 };
  int kind = F32;
  std::vector<GgufPart> parts;      // GGUF: x quantized once, every part multiplied against it
  int64_t N = 0, K = 0, G = 0;
  const float* w = nullptr;         // F32: [N, K]
  const uint8_t* codes = nullptr;   // INT4: uint8 [N, K/2]; INT8: int8 [N, K]
  const uint16_t* scales = nullptr; // fp16 [N, K/G]
  const uint16_t* mins = nullptr;   // fp16 [N, K/G] (asymmetric int4) or null
  const float* bias = nullptr;      // [N] or null
};

// K or V of one layer's cache: fp32 [Hkv, S, D], fp16 [Hkv, S, D] (the "f16" cache, as computed: no rotation),
// or edgellm.cache's int8 / int4 groups of the head dim (int8: codes [Hkv, S, D], symmetric; int4: split-halves
// nibbles [Hkv, S, D/2], scale + min), fp16 scales [Hkv, S, D/G]. Quantized rows hold K/V rotated by
// DecodeModel::kv_rot.
struct DecodeKV {
  enum Kind { F32 = 0, INT4 = 4, INT8 = 8, F16 = 16 };
  int kind = F32;
  int64_t G = 0;  // (F16: D, so that the tiled readers take it as one group)
  float* f = nullptr;
  uint16_t* h = nullptr;  // F16's rows
  uint8_t* codes = nullptr;
  uint16_t* scales = nullptr;
  uint16_t* mins = nullptr;
  float* sink = nullptr;  // fp32 [Hkv, n_sink + 1, D]: positions < n_sink kept exactly (read instead), or null
  int64_t n_sink = 0;
};

struct DecodeLayer {
  DecodeLinear qkv, o, w13, w2;
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  DecodeKV k, v;
  // The families' extras (edgellm/config.py); null / 0 where a family has none.
  const float* q_norm = nullptr;          // [D]: RMSNorm of each q head before RoPE (Qwen3, Gemma 3)
  const float* k_norm = nullptr;          // [D]: the same for each k head
  const float* post_attn_norm = nullptr;  // [dim]: the attention output normalised before the residual add (Gemma)
  const float* post_ffn_norm = nullptr;   // [dim]: the MLP output likewise
  int64_t window = 0;                     // > 0: each token attends to its last `window` positions only
  bool local_rope = false;                // RoPE from DecodeModel::rope_cos_local / rope_sin_local (Gemma 3)
};

struct DecodeModel {
  int64_t dim = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, hidden = 0, vocab = 0, max_seq_len = 0;
  float eps = 1e-5f, attn_scale = 1.0f;
  DecodeLinear embedding;  // rows: F32 [V, dim], INT8 / INT4 codes + scales (+ mins), or GGUF parts
  std::vector<DecodeLayer> layers;
  const float* norm = nullptr;
  DecodeLinear output;
  const float* rope_cos = nullptr;  // [>= S, R]
  const float* rope_sin = nullptr;  // [>= S, R], first half negated
  const float* rope_cos_local = nullptr;  // the sliding-window layers' own tables (Gemma 3), or null
  const float* rope_sin_local = nullptr;
  int64_t rotary_dim = 0;           // R: RoPE turns the first R dims of each head, the rest pass (Phi-4-mini)
  int act = 0;                      // the gated MLP's activation: 0 SiLU, 1 GELU (tanh approximation, Gemma)
  float embed_scale = 1.0f;         // embeddings times this (Gemma: sqrt(dim))
  float attn_softcap = 0.0f;        // > 0: scores -> c tanh(scores / c) before the softmax (Gemma 2)
  float final_softcap = 0.0f;       // > 0: the same on the logits
  const float* kv_rot = nullptr;    // [D, D] orthonormal (a quantized cache: K, V, q times it), or null
  const float* kv_center = nullptr; // [layers, 2, Hkv, D]: K / V centres subtracted before the rotation
                                    // (edgellm/kv_calibration.py; V's added back to the output), or null
  const float* kv_key_scale = nullptr;  // [layers, Hkv, D]: centred keys times it before the rotation, q
                                        // divided by it (edgellm/kv_calibration.py), or null
  std::vector<float> kv_query_scale;    // 1 / kv_key_scale, by decode_prepare
  std::vector<float> buf, work;     // activations and attention scratch, sized by decode_prepare
  std::vector<float> qrot;          // rotated q and attention output of one token (quantized cache)
  std::vector<float> kv_rot_t;      // kv_rot transposed (rotating the attention output back), by decode_prepare
  std::vector<float> work_rows;     // attention_rows' scratch (grown on first use)
  bool attention_rows = true;       // T-token passes: every token's tiles in one parallel region (A/B switch)
  bool int_attention = true;        // int8/int4 caches: VPDPBUSD scores and register-dequantized values where
                                    // the build has AVX-512 VNNI (false: the AVX2 tiles, A/B; DecodeTuning)
  bool profile = false;             // accumulate the seconds below (steady clock; off by default)
  double t_matmul = 0, t_attention = 0, t_other = 0;
  int64_t steps = 0;
};

// Tokens one call may take (speculative verification: the draft tokens + 1); the buffers are sized for it.
constexpr int64_t kDecodeMaxRows = 16;

void decode_prepare(DecodeModel& m);
// logits [vocab] of `token` at position `pos`; writes K/V of `pos` into each layer's cache.
void decode_step(DecodeModel& m, int64_t token, int64_t pos, float* logits, int variant);
// T <= kDecodeMaxRows tokens at positions [pos, pos + T), causal: logits [T, vocab], each row bit for bit
// what decode_step gives that token at its position; `last_only`: the last token's row alone (a short prompt's
// prefill: the LM head over one row; from kPrefillGemmRows rows on, GGUF linears through the prompt GEMM, equal to
// the row kernels to fp32 rounding).
void decode_tokens(DecodeModel& m, const int64_t* tokens, int64_t T, int64_t pos, float* logits, int variant,
                   bool last_only = false);

}  // namespace edgellm
