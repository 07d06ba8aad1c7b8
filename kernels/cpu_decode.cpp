// edgellm's whole CPU decode step in C++: one call per token instead of ~60 torch ops per layer from Python.
//
// Why: at SmolLM2-135M's size a layer's arithmetic is a few tens of microseconds, while each torch op called
// from Python costs 4-8 us on this machine class, so the eager decode step spent more time in the interpreter
// and the dispatcher than in the matmuls.  This file runs the same graph as edgellm/model.py for one token
// (T = 1) on a float32 model with a float32 KV cache:
//   h = embed(token); per layer: h += Wo · attn(rope(Wqkv · rmsnorm(h))); h += W2 · (silu(g) * u), [g|u] =
//   W13 · rmsnorm(h); logits = Wout · rmsnorm(h)
// and the families' switches around it (DecodeModel / DecodeLayer): embeddings scaled, q/k heads normalised before
// RoPE, RoPE over part of the head or from a layer's own table, attention over a sliding window with soft-capped
// scores, the attention and MLP outputs normalised before the residual add (Gemma), GELU for SiLU, capped logits.
// with the matmuls through cpu_kernels.cpp's int4/int8 kernels (or an fp32 GEMV for float weights), and
// attention over the cache [Hkv, S, D] as flash-decoding partials (key tiles in parallel, one LSE combine).
//
// Plain C++ (no torch headers): cpu_bindings.cpp builds the plan from the model's tensors and owns them.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#if !defined(EDGELLM_FORCE_SCALAR) && defined(__AVX2__) && (defined(_MSC_VER) || (defined(__FMA__) && defined(__F16C__)))
#define EDGELLM_DEC_AVX2 1
#include "simd_math.h"
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define EDGELLM_DEC_VNNI 1  // int8 dot products for the scores against an int4 key cache
#endif
#endif

#include "cpu_decode.h"
#include "cpu_gguf.h"
#include "half.h"

namespace edgellm {

void q4_gemm(const float* x, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* scales,
             const uint16_t* mins, int64_t N, int64_t G, float* out, int variant);
void q8_gemm(const float* x, int64_t M, int64_t K, const int8_t* codes, const uint16_t* scales, int64_t N,
             int64_t G, float* out, int variant);
void parallel_run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f);
int max_threads();

namespace {

float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#ifdef EDGELLM_DEC_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
  s = hsum(_mm256_add_ps(a0, a1));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += a * x
void axpy(float a, const float* x, float* y, int64_t n) {
  int64_t i = 0;
#ifdef EDGELLM_DEC_AVX2
  const __m256 va = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += a * x[i];
}

void add_inplace(float* y, const float* x, int64_t n) {
  int64_t i = 0;
#ifdef EDGELLM_DEC_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) y[i] += x[i];
}

// out = w * (x * rsqrt(mean(x^2) + eps)), as model.RMSNorm (fp32).
void rmsnorm(const float* x, const float* w, float eps, float* out, int64_t n) {
  const float inv = 1.0f / std::sqrt(dot(x, x, n) / (float)n + eps);
  int64_t i = 0;
#ifdef EDGELLM_DEC_AVX2
  const __m256 vi = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), vi)));
#endif
  for (; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

#ifdef EDGELLM_DEC_AVX2
// tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|) <= 1 (no overflow): |abs err| ~1e-7.
inline __m256 tanh256(__m256 x) {
  const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
  const __m256 e = exp256(_mm256_mul_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), _mm256_set1_ps(-2.0f)));
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_or_ps(sign, _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)));
}
#endif

// s[i] = c tanh(s[i] / c) for i in [0, n) (Gemma 2's soft-capped scores and logits); c <= 0: nothing.
void softcap(float* s, int64_t n, float c) {
  if (c <= 0.0f) return;
  const float inv = 1.0f / c;
  int64_t i = 0;
#ifdef EDGELLM_DEC_AVX2
  const __m256 vc = _mm256_set1_ps(c), vi = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(s + i, _mm256_mul_ps(vc, tanh256(_mm256_mul_ps(_mm256_loadu_ps(s + i), vi))));
#endif
  for (; i < n; ++i) s[i] = c * std::tanh(s[i] * inv);
}

// act[i] = gelu_tanh(g[i]) * u[i], gelu_tanh(x) = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (GeGLU, Gemma)
void gelu_mul(const float* g, const float* u, float* out, int64_t n) {
  const float k0 = 0.7978845608028654f, k1 = 0.044715f;
  int64_t i = 0;
#ifdef EDGELLM_DEC_AVX2
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(k0),
                                       _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(k1), x), _mm256_mul_ps(x, x), x));
    const __m256 y = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, tanh256(inner)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(y, _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) {
    const float x = g[i];
    out[i] = 0.5f * x * (1.0f + std::tanh(k0 * (x + k1 * x * x * x))) * u[i];
  }
}

// act[i] = silu(g[i]) * u[i]
void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
#ifdef EDGELLM_DEC_AVX2
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 vg = _mm256_loadu_ps(g + i);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), vg));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(vg, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

// x [H, D] in place: the first R dims of each head x*cos + (x2, x1)*sin, sin with its first half negated
// (model.apply_rope); dims R.. pass (partial rotary; R = D otherwise).
void rope(float* x, int64_t H, int64_t D, int64_t R, const float* cos, const float* sin) {
  const int64_t half = R / 2;
  float tmp[1024];
  for (int64_t h = 0; h < H; ++h) {
    float* v = x + h * D;
    std::memcpy(tmp, v, sizeof(float) * R);
    for (int64_t i = 0; i < half; ++i) {
      v[i] = tmp[i] * cos[i] + tmp[i + half] * sin[i];
      v[i + half] = tmp[i + half] * cos[i + half] + tmp[i] * sin[i + half];
    }
  }
}

#ifdef EDGELLM_DEC_AVX2
// NW weight rows x R activation rows, one accumulator each, k ascending in steps of 8: the same lanes and
// order as the one-row pass below, so every (r, n) gets the same bits whatever the blocking.
template <int NW, int R, bool PREFETCH = true>
inline void f32_tile(const float* x, int64_t K, const float* w, int64_t N, float* out) {
  __m256 acc[NW][R];
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NW];
    if (PREFETCH && (k & 15) == 0)  // the next tile's rows: DRAM latency hides behind this tile's FMAs
      for (int i = 0; i < NW; ++i) __builtin_prefetch(w + (NW + i) * K + k, 0, 3);
    for (int i = 0; i < NW; ++i) wv[i] = _mm256_loadu_ps(w + i * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int i = 0; i < NW; ++i) acc[i][r] = _mm256_fmadd_ps(wv[i], xv, acc[i][r]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NW; ++i) out[r * N + i] = hsum(acc[i][r]);
}
#endif

// fp32 GEMM for a few rows: out[r, n] = W[n,:] . x[r,:], weight rows split over threads. Every (r, n) is
// accumulated exactly as for M = 1 (one 8-lane accumulator over k, then hsum; dot() for a chunk's last < 4
// rows), so a verification pass over T tokens gives each token the bits of a one-token step. For M > 1,
// tiles of 3 weight rows x 4 activation rows keep 12 accumulators in registers: 7 loads per 12 FMAs instead
// of 5 per 4 (the fp32 verification pass was load-bound, ~2 ms per extra token on the bundled model).
void f32_rows(const float* x, int64_t M, int64_t K, const float* W, int64_t N, float* out) {
  parallel_run(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
#ifdef EDGELLM_DEC_AVX2
    if (K % 8 == 0) {
      const int64_t nb = n0 + (n1 - n0) / 4 * 4;  // rows the one-accumulator pass covers (as for M = 1)
      if (M == 1) {
        for (; n < nb; n += 4) f32_tile<4, 1, false>(x, K, W + n * K, N, out + n);
      } else {
        for (; n < nb; n += 3) {
          const int64_t nw = std::min<int64_t>(3, nb - n);
          const float* w = W + n * K;
          int64_t r = 0;
          for (; r + 4 <= M; r += 4) {
            if (nw == 3) f32_tile<3, 4>(x + r * K, K, w, N, out + r * N + n);
            else if (nw == 2) f32_tile<2, 4>(x + r * K, K, w, N, out + r * N + n);
            else f32_tile<1, 4>(x + r * K, K, w, N, out + r * N + n);
          }
          for (; r < M; ++r) {
            if (nw == 3) f32_tile<3, 1>(x + r * K, K, w, N, out + r * N + n);
            else if (nw == 2) f32_tile<2, 1>(x + r * K, K, w, N, out + r * N + n);
            else f32_tile<1, 1>(x + r * K, K, w, N, out + r * N + n);
          }
        }
      }
    }
#endif
    for (; n < n1; ++n)
      for (int64_t r = 0; r < M; ++r) out[r * N + n] = dot(W + n * K, x + r * K, K);
  });
}

// out [M, N] = x [M, K] @ W^T (+ bias); the int kernels treat each row on its own too (bit-identical to M = 1).
// A prefill's rows (decode_tokens last_only) from this many on multiply GGUF blocks in the prompt GEMM
// (gguf_gemm_prompt, where it is vectorized), which decodes each weight once per call where the row kernel re-reads
// the codes per group of rows: the same int8 activations and integer sums, equal to fp32 rounding.  Fewer rows,
// decode and speculative verification stay on the row kernel (bit for bit the one-token step).
constexpr int64_t kPrefillGemmRows = 8;

// out [M, L.N] = x [M, L.K] @ W^T (+ bias); `prompt`: GGUF blocks through the prompt GEMM (see kPrefillGemmRows).
void linear(const DecodeLinear& L, const float* x, int64_t M, float* out, int variant, bool prompt = false) {
  if (L.kind == DecodeLinear::GGUF) {
    const GgufActs acts = gguf_quantize_acts(x, M, L.K, /*paired=*/!prompt);
    int64_t offset = 0;
    for (const GgufPart& p : L.parts) {
      float* y = p.out_index ? out : out + offset;
      if (prompt) gguf_gemm_prompt(acts, p.data, p.type, p.N, L.K, y, L.N, p.out_index);
      else gguf_gemm(acts, p.data, p.type, p.N, L.K, y, L.N, p.out_index);
      offset += p.N;
    }
  } else if (L.kind == DecodeLinear::INT4)
    q4_gemm(x, M, L.K, L.codes, L.scales, L.mins, L.N, L.G, out, variant);
  else if (L.kind == DecodeLinear::INT8)
    q8_gemm(x, M, L.K, reinterpret_cast<const int8_t*>(L.codes), L.scales, L.N, L.G, out, variant);
  else
    f32_rows(x, M, L.K, L.w, L.N, out);
  if (L.bias)
    for (int64_t r = 0; r < M; ++r) add_inplace(out + r * L.N, L.bias, L.N);
}

void embed(const DecodeModel& m, int64_t tok, float* h) {
  const DecodeLinear& E = m.embedding;
  const int64_t K = E.K;
  if (E.kind == DecodeLinear::F32) {
    std::memcpy(h, E.w + tok * K, sizeof(float) * K);
    return;
  }
  if (E.kind == DecodeLinear::GGUF) {  // the plan keeps embedding parts in row order (no out_index)
    int64_t r = tok;
    for (const GgufPart& p : E.parts) {
      if (r < p.N) {
        gguf_dequantize_rows(p.data + r * p.row_bytes, p.type, 1, K, h);
        return;
      }
      r -= p.N;
    }
    return;
  }
  const int64_t ng = K / E.G;
  const uint16_t* s = E.scales + tok * ng;
  if (E.kind == DecodeLinear::INT8) {
    const int8_t* c = reinterpret_cast<const int8_t*>(E.codes) + tok * K;
    for (int64_t k = 0; k < K; ++k) h[k] = (float)c[k] * half_to_float(s[k / E.G]);
    return;
  }
  // int4, as kernels.matmul.dequantize_int4: (q - 8) * s, or q * s + m (two roundings)
  const uint8_t* c = E.codes + tok * (K / 2);
  const uint16_t* mn = E.mins ? E.mins + tok * ng : nullptr;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t b = k / 32, j = k % 32;
    const uint8_t byte = c[b * 16 + (j & 15)];
    const float q = (float)(j < 16 ? (byte & 0x0F) : (byte >> 4));
    const float sc = half_to_float(s[k / E.G]);
    if (mn) {
      volatile float p = q * sc;  // no FMA contraction: match the two roundings of the torch path
      h[k] = p + half_to_float(mn[k / E.G]);
    } else {
      h[k] = (q - 8.0f) * sc;
    }
  }
}

// Tiles of keys per KV head: enough tasks for the threads once the context (n keys x Hkv heads x D) reaches
// min_work, else one. Sets `tile` (keys per tile); returns the number of tiles.
int64_t key_tiles(int64_t n, int64_t Hkv, int64_t D, int64_t nt, int64_t min_work, int64_t& tile) {
  int64_t tiles = 1;
  if (nt > 1 && n * Hkv * D >= min_work)
    tiles = std::min<int64_t>((n + 63) / 64, std::max<int64_t>(1, (2 * nt + Hkv - 1) / Hkv));
  tile = (n + tiles - 1) / tiles;
  return (n + tile - 1) / tile;
}

// s[p] = exp(s[p] - mx) for p in [a, b); returns their sum (the softmax numerators of one tile and row).
float exp_sum(float* s, int64_t a, int64_t b, float mx) {
  float l = 0.0f;
  int64_t p = a;
#ifdef EDGELLM_DEC_AVX2
  __m256 vl = _mm256_setzero_ps();
  const __m256 vm = _mm256_set1_ps(mx);
  for (; p + 8 <= b; p += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + p), vm));
    _mm256_storeu_ps(s + p, e);
    vl = _mm256_add_ps(vl, e);
  }
  l = hsum(vl);
#endif
  for (; p < b; ++p) {
    s[p] = std::exp(s[p] - mx);
    l += s[p];
  }
  return l;
}

// The log-sum-exp combine of flash-decoding: per query head, the tiles' partial outputs (unnormalised, with
// their running max and sum: part [(Hkv * tiles + tile) * g + r][D + 2]) weighted by exp(max_tile - max).
void combine_tiles(const DecodeModel& m, const float* part, int64_t tiles, float* out) {
  const int64_t D = m.head_dim, Hkv = m.n_kv_heads, g = m.n_heads / m.n_kv_heads;
  for (int64_t j = 0; j < Hkv; ++j) {
    for (int64_t r = 0; r < g; ++r) {
      const int64_t h = j * g + r;
      float M = -INFINITY;
      for (int64_t i = 0; i < tiles; ++i) M = std::max(M, part[((j * tiles + i) * g + r) * (D + 2) + D]);
      float L = 0.0f;
      float* oh = out + h * D;
      std::memset(oh, 0, sizeof(float) * D);
      for (int64_t i = 0; i < tiles; ++i) {
        const float* o = part + ((j * tiles + i) * g + r) * (D + 2);
        const float w = std::exp(o[D] - M);
        L += w * o[D + 1];
        axpy(w, o, oh, D);
      }
      const float inv = 1.0f / L;
      for (int64_t d = 0; d < D; ++d) oh[d] *= inv;
    }
  }
}

#ifdef EDGELLM_DEC_AVX2
template <int NV>
void f32_tile(const DecodeModel& m, const float* q, const float* kc, const float* vc, int64_t j, int64_t a,
              int64_t b, float* sc, int64_t sstride, float* part);
#endif

// One tile [a, b) of KV head j's keys for one token without an AVX2 tile (the portable path): scores of query
// head j*g + r at key p go to sc[r * sstride + p - a]; writes the partial output, max and sum into part.
void plain_tile(const DecodeModel& m, const float* q, const float* kc, const float* vc, int64_t j, int64_t a,
                int64_t b, float* sc, int64_t sstride, float* part) {
  const int64_t D = m.head_dim, g = m.n_heads / m.n_kv_heads, S = m.max_seq_len;
  const float* K = kc + j * S * D;
  const float* V = vc + j * S * D;
  for (int64_t r = 0; r < g; ++r) {
    const float* qh = q + (j * g + r) * D;
    float* s = sc + r * sstride;
    float mx = -INFINITY;
    for (int64_t p = a; p < b; ++p) {
      s[p - a] = dot(qh, K + p * D, D);
      mx = std::max(mx, s[p - a]);
    }
    softcap(s, b - a, m.attn_softcap);  // (increasing: the max stays the max)
    softcap(&mx, 1, m.attn_softcap);
    const float l = exp_sum(s, 0, b - a, mx);
    float* o = part + r * (D + 2);
    std::memset(o, 0, sizeof(float) * D);
    for (int64_t p = a; p < b; ++p) axpy(s[p - a], V + p * D, o, D);
    o[D] = mx;
    o[D + 1] = l;
  }
}

// Attention of T tokens against one layer's fp32 cache: token t's query q + t * qstride (q [Hq, D] already
// scaled) sees keys [0, pos + t]; its output goes to out + t * ostride. Each token's keys are split into tiles
// (flash-decoding: per tile a partial output, max and sum, then combine_tiles) and each (KV head, tile) task
// runs its tile for every token in turn, so for a T-token verification pass the tile's keys and values come
// from memory once and then from cache. A token's tiles, float operations and combine do not depend on T,
// so each row is bit for bit a one-token step's. False (nothing done) where the tokens would split their keys
// into different numbers of tiles; one token at a time always works.
bool attention_rows(DecodeModel& m, const float* q, int64_t qstride, const float* kc, const float* vc,
                    int64_t pos, int64_t T, float* out, int64_t ostride, int64_t window) {
  const int64_t D = m.head_dim, Hkv = m.n_kv_heads, g = m.n_heads / m.n_kv_heads;
#ifdef EDGELLM_DEC_AVX2
  const bool fast = (D == 64 || D == 128) && g <= 64;
#else
  const bool fast = false;
#endif
  const int64_t nt = max_threads();
  int64_t tile_t[kDecodeMaxRows], lo_t[kDecodeMaxRows];  // token t's keys: [lo_t, pos + t] (a window, or all)
  int64_t tiles = 0;
  for (int64_t t = 0; t < T; ++t) {
    lo_t[t] = window > 0 ? std::max<int64_t>(0, pos + t + 1 - window) : 0;
    const int64_t n = key_tiles(pos + t + 1 - lo_t[t], Hkv, D, nt, 32768, tile_t[t]);
    if (t > 0 && n != tiles) return false;
    tiles = n;
  }
  const int64_t tasks = tiles * Hkv, tile_max = tile_t[T - 1];
  const int64_t part_floats = tasks * g * (D + 2);  // one token's partials, combine_tiles' layout
  const size_t need = static_cast<size_t>(T * part_floats + tasks * g * tile_max + 64);
  if (m.work_rows.size() < need) m.work_rows.resize(need);  // grows once; steady state allocates nothing
  float* parts = m.work_rows.data();
  float* scores = parts + T * part_floats;  // per task: g rows of tile_max scores
  auto task = [&](int64_t t0, int64_t t1) {
    for (int64_t k = t0; k < t1; ++k) {
      const int64_t j = k / tiles, i = k % tiles;
      float* sc = scores + k * g * tile_max;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t n = pos + t + 1, a = lo_t[t] + i * tile_t[t], b = std::min(n, a + tile_t[t]);
        float* part = parts + t * part_floats + k * g * (D + 2);
#ifdef EDGELLM_DEC_AVX2
        if (fast) {
          if (D == 64) f32_tile<8>(m, q + t * qstride, kc, vc, j, a, b, sc, tile_max, part);
          else f32_tile<16>(m, q + t * qstride, kc, vc, j, a, b, sc, tile_max, part);
          continue;
        }
#endif
        (void)fast;
        plain_tile(m, q + t * qstride, kc, vc, j, a, b, sc, tile_max, part);
      }
    }
  };
  if (tasks == 1 || nt <= 1) task(0, tasks);
  else parallel_run(0, tasks, 1, task);
  for (int64_t t = 0; t < T; ++t) combine_tiles(m, parts + t * part_floats, tiles, out + t * ostride);
  return true;
}

// y [D] = x [D] @ R [D, D]: 64 columns at a time in 8 registers, R's rows scaled by x's elements and summed
// (an axpy per row, storing y back each time, cost 4-5x as much: ~0.25 ms a token over the 24 rotations a layer)
void rotate(const float* x, const float* R, float* y, int64_t D) {
#ifdef EDGELLM_DEC_AVX2
  if (D % 64 == 0) {
    for (int64_t c = 0; c < D; c += 64) {
      __m256 acc[8];
      for (int v = 0; v < 8; ++v) acc[v] = _mm256_setzero_ps();
      for (int64_t i = 0; i < D; ++i) {
        const __m256 xi = _mm256_set1_ps(x[i]);
        const float* row = R + i * D + c;
        for (int v = 0; v < 8; ++v) acc[v] = _mm256_fmadd_ps(xi, _mm256_loadu_ps(row + 8 * v), acc[v]);
      }
      for (int v = 0; v < 8; ++v) _mm256_storeu_ps(y + c + 8 * v, acc[v]);
    }
    return;
  }
#endif
  std::memset(y, 0, sizeof(float) * D);
  for (int64_t i = 0; i < D; ++i) axpy(x[i], R + i * D, y, D);
}

// Write one (rotated) row at (head j, position p): edgellm.kernels.kv_quant's quantize_int8 / quantize_int4 math,
// and the row itself into the exact sink rows when p < n_sink.
void kv_write(const DecodeKV& c, int64_t j, int64_t p, int64_t S, int64_t D, const float* x) {
  const int64_t row = j * S + p;
  if (c.kind == DecodeKV::F32) {
    std::memcpy(c.f + row * D, x, sizeof(float) * D);
    return;
  }
  if (c.kind == DecodeKV::F16) {  // round to nearest even, as torch's copy into the fp16 cache
    for (int64_t i = 0; i < D; ++i) c.h[row * D + i] = float_to_half(x[i]);
    return;
  }
  if (p < c.n_sink) std::memcpy(c.sink + (j * (c.n_sink + 1) + p) * D, x, sizeof(float) * D);
  const int64_t ng = D / c.G;
  uint16_t* sc = c.scales + row * ng;
  if (c.kind == DecodeKV::INT8) {
    int8_t* q = reinterpret_cast<int8_t*>(c.codes) + row * D;
    for (int64_t g = 0; g < ng; ++g) {
      const float* xg = x + g * c.G;
      float amax = 0.0f;
      for (int64_t i = 0; i < c.G; ++i) amax = std::max(amax, std::fabs(xg[i]));
      sc[g] = float_to_half(amax > 0.0f ? amax / 127.0f : 1.0f);
      const float s = half_to_float(sc[g]);
      for (int64_t i = 0; i < c.G; ++i)
        q[g * c.G + i] = (int8_t)std::min(127.0f, std::max(-127.0f, std::nearbyint(xg[i] / s)));
    }
    return;
  }
  uint8_t codes[1024];
  uint16_t* mn = c.mins + row * ng;
  for (int64_t g = 0; g < ng; ++g) {
    const float* xg = x + g * c.G;
    float lo = xg[0], hi = xg[0];
    for (int64_t i = 1; i < c.G; ++i) { lo = std::min(lo, xg[i]); hi = std::max(hi, xg[i]); }
    mn[g] = float_to_half(lo);
    const float m = half_to_float(mn[g]);
    const float span = hi - m;
    sc[g] = float_to_half(span > 0.0f ? span / 15.0f : 1.0f);
    const float s = half_to_float(sc[g]);
    for (int64_t i = 0; i < c.G; ++i)
      codes[g * c.G + i] = (uint8_t)std::min(15.0f, std::max(0.0f, std::nearbyint((xg[i] - m) / s)));
  }
  uint8_t* out = c.codes + row * (D / 2);
  for (int64_t i = 0; i < D / 2; ++i) out[i] = (uint8_t)(codes[i] | (codes[i + D / 2] << 4));
}

// Row (head j, position p) of an fp16 or quantized cache in fp32: the half value, code * scale (+ min), or the
// exact sink row.
void kv_row(const DecodeKV& c, int64_t j, int64_t p, int64_t S, int64_t D, float* out) {
  if (c.kind == DecodeKV::F16) {
    for (int64_t i = 0; i < D; ++i) out[i] = half_to_float(c.h[(j * S + p) * D + i]);
    return;
  }
  if (p < c.n_sink) {  // an attention sink, kept exactly
    std::memcpy(out, c.sink + (j * (c.n_sink + 1) + p) * D, sizeof(float) * D);
    return;
  }
  const int64_t row = j * S + p, ng = D / c.G;
  const uint16_t* sc = c.scales + row * ng;
  if (c.kind == DecodeKV::INT8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(c.codes) + row * D;
    for (int64_t g = 0; g < ng; ++g) {
      const float s = half_to_float(sc[g]);
      for (int64_t i = g * c.G; i < (g + 1) * c.G; ++i) out[i] = (float)q[i] * s;
    }
    return;
  }
  const uint8_t* b = c.codes + row * (D / 2);
  const uint16_t* mn = c.mins + row * ng;
  const int64_t half = D / 2;
  int64_t i0 = 0;
#ifdef EDGELLM_DEC_AVX2
  const __m256i low4 = _mm256_set1_epi32(15);
  for (; i0 + 8 <= half; i0 += 8) {  // 8 bytes: elements i.. (low nibbles) and i + D/2.. (high nibbles)
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + i0)));
    _mm256_storeu_ps(out + i0, _mm256_cvtepi32_ps(_mm256_and_si256(w, low4)));
    _mm256_storeu_ps(out + half + i0, _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4)));
  }
#endif
  for (int64_t i = i0; i < half; ++i) {
    out[i] = (float)(b[i] & 0x0F);
    out[i + half] = (float)(b[i] >> 4);
  }
  for (int64_t g = 0; g < ng; ++g) {  // (an FMA here: attention does not need torch's two roundings)
    const float s = half_to_float(sc[g]), m = half_to_float(mn[g]);
    for (int64_t i = g * c.G; i < (g + 1) * c.G; ++i) out[i] = out[i] * s + m;
  }
}

#ifdef EDGELLM_DEC_AVX2
// Lane k of the result = the sum of v[k]'s lanes (8 horizontal sums in 6 instructions instead of 8 x 5).
inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

inline float hmax(__m256 v) {
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  t = _mm_max_ss(t, _mm_movehdup_ps(t));
  return _mm_cvtss_f32(t);
}

// Rows [p0, p0 + np) of head j of an fp16 or quantized cache into out [np, D] fp32 (fp16: F16C's convert;
// code * scale (+ min), FMA), D % 16 == 0, D <= 256 and G % 8 == 0: 8 lanes never straddle a group. (The group
// of each 8 lanes is looked up, not divided for: an idiv per vector was half of this function's time.)
void kv_rows_avx2(const DecodeKV& c, int64_t j, int64_t p0, int64_t np, int64_t S, int64_t D, float* out) {
  if (c.kind == DecodeKV::F16) {
    const uint16_t* src = c.h + (j * S + p0) * D;
    for (int64_t i = 0; i < np * D; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    return;
  }
  const int64_t ng = D / c.G, half = D / 2;
  int gl[16], gh[16];  // group of elements d.. and d + D/2.. for the 8-byte step d = 8 i
  for (int64_t i = 0; i < half / 8; ++i) {
    gl[i] = (int)(8 * i / c.G);
    gh[i] = (int)((8 * i + half) / c.G);
  }
  const __m256i low4 = _mm256_set1_epi32(15);
  for (int64_t i = 0; i < np; ++i) {
    const int64_t row = j * S + p0 + i;
    const uint16_t* sc = c.scales + row * ng;
    float* o = out + i * D;
    if (p0 + i < c.n_sink) {  // an attention sink, kept exactly
      std::memcpy(o, c.sink + (j * (c.n_sink + 1) + p0 + i) * D, sizeof(float) * D);
      continue;
    }
    float sf[32], mf[32];
    for (int64_t g = 0; g < ng; ++g) sf[g] = _cvtsh_ss(sc[g]);
    if (c.kind == DecodeKV::INT8) {
      const int8_t* q = reinterpret_cast<const int8_t*>(c.codes) + row * D;
      for (int64_t k = 0; k < half / 8; ++k) {
        const __m256 v0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * k))));
        const __m256 v1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + half + 8 * k))));
        _mm256_storeu_ps(o + 8 * k, _mm256_mul_ps(v0, _mm256_set1_ps(sf[gl[k]])));
        _mm256_storeu_ps(o + half + 8 * k, _mm256_mul_ps(v1, _mm256_set1_ps(sf[gh[k]])));
      }
      continue;
    }
    const uint16_t* mn = c.mins + row * ng;
    for (int64_t g = 0; g < ng; ++g) mf[g] = _cvtsh_ss(mn[g]);
    const uint8_t* b = c.codes + row * half;
    for (int64_t k = 0; k < half / 8; ++k) {  // 8 bytes: elements 8k.. (low nibbles) and 8k + D/2.. (high)
      const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8 * k)));
      _mm256_storeu_ps(o + 8 * k, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(w, low4)),
                                                  _mm256_set1_ps(sf[gl[k]]), _mm256_set1_ps(mf[gl[k]])));
      _mm256_storeu_ps(o + half + 8 * k, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4)),
                                                         _mm256_set1_ps(sf[gh[k]]), _mm256_set1_ps(mf[gh[k]])));
    }
  }
}

// One tile of attention_quantized with the head dim known at compile time (NV = D / 8 vectors): keys are
// dequantized 32 at a time into an L1 buffer; each query head then keeps its q (or its output) in NV
// registers over those 32 keys, scores come 8 at a time out of hsum8. Returns nothing; writes the tile's
// scores (exp'd), and per head the partial output, max and sum into part.
// keys(c0, nc, buf) / values(...): rows c0 .. c0+nc-1 of KV head j as fp32 [nc, D] (dequantized into buf, or
// the fp32 cache's own rows). The fp32 cache takes this tile too (f32_tile): scores 8 at a time and the
// output in registers instead of a dot (one horizontal sum each) and an axpy (load + store) per key.
// Scores of query head j*g + r at key p (a <= p < b) go to sc[r * sstride + p - a].
template <int NV, class Rows>
void tile_scores(const DecodeModel& m, const float* q, int64_t j, int64_t a, int64_t b, float* sc,
                 int64_t sstride, float* mx, const Rows& keys) {
  constexpr int64_t D = NV * 8, CH = 32;
  const int64_t g = m.n_heads / m.n_kv_heads;
  alignas(32) float kvbuf[CH * D];
  for (int64_t r = 0; r < g; ++r) mx[r] = -INFINITY;
  for (int64_t c0 = a; c0 < b; c0 += CH) {
    const int64_t nc = std::min<int64_t>(CH, b - c0);
    const float* buf = keys(c0, nc, kvbuf);
    for (int64_t r = 0; r < g; ++r) {
      const float* qh = q + (j * g + r) * D;
      float* s = sc + r * sstride + (c0 - a);
      __m256 qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = _mm256_loadu_ps(qh + v * 8);
      __m256 vmx = _mm256_set1_ps(-INFINITY);
      int64_t i = 0;
      for (; i + 8 <= nc; i += 8) {
        __m256 acc[8];
        for (int k = 0; k < 8; ++k) {
          const float* kr = buf + (i + k) * D;
          __m256 x = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kr));
          for (int v = 1; v < NV; ++v) x = _mm256_fmadd_ps(qv[v], _mm256_loadu_ps(kr + v * 8), x);
          acc[k] = x;
        }
        const __m256 sc = hsum8(acc);
        _mm256_storeu_ps(s + i, sc);
        vmx = _mm256_max_ps(vmx, sc);
      }
      float mr = std::max(mx[r], hmax(vmx));
      for (; i < nc; ++i) {
        const float* kr = buf + i * D;
        __m256 x = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kr));
        for (int v = 1; v < NV; ++v) x = _mm256_fmadd_ps(qv[v], _mm256_loadu_ps(kr + v * 8), x);
        s[i] = hsum(x);
        mr = std::max(mr, s[i]);
      }
      mx[r] = mr;
    }
  }
}

// The second half of attention_tile: softmax numerators of the tile's scores (max mx per head), and the
// values weighted by them into part.
template <int NV, class Rows>
void tile_values(const DecodeModel& m, int64_t a, int64_t b, float* sc, int64_t sstride, const float* mx,
                 float* part, const Rows& values) {
  constexpr int64_t D = NV * 8, CH = 32;
  const int64_t g = m.n_heads / m.n_kv_heads;
  alignas(32) float kvbuf[CH * D];
  float l[64];
  for (int64_t r = 0; r < g; ++r) l[r] = exp_sum(sc + r * sstride, 0, b - a, mx[r]);  // (same 8-groups from a)
  for (int64_t r = 0; r < g; ++r) std::memset(part + r * (D + 2), 0, sizeof(float) * D);
  for (int64_t c0 = a; c0 < b; c0 += CH) {
    const int64_t nc = std::min<int64_t>(CH, b - c0);
    const float* buf = values(c0, nc, kvbuf);
    for (int64_t r = 0; r < g; ++r) {
      const float* w = sc + r * sstride + (c0 - a);
      float* o = part + r * (D + 2);
      __m256 acc[NV];
      for (int v = 0; v < NV; ++v) acc[v] = _mm256_loadu_ps(o + v * 8);
      for (int64_t i = 0; i < nc; ++i) {
        const __m256 wi = _mm256_set1_ps(w[i]);
        for (int v = 0; v < NV; ++v) acc[v] = _mm256_fmadd_ps(wi, _mm256_loadu_ps(buf + i * D + v * 8), acc[v]);
      }
      for (int v = 0; v < NV; ++v) _mm256_storeu_ps(o + v * 8, acc[v]);
    }
  }
  for (int64_t r = 0; r < g; ++r) {
    part[r * (D + 2) + D] = mx[r];
    part[r * (D + 2) + D + 1] = l[r];
  }
}

// softcap() on the g query heads' scores of one tile (n each, rows sstride apart) and their maxima.
inline void softcap_rows(const DecodeModel& m, float* sc, int64_t sstride, int64_t n, float* mx) {
  if (m.attn_softcap <= 0.0f) return;
  const int64_t g = m.n_heads / m.n_kv_heads;
  for (int64_t r = 0; r < g; ++r) softcap(sc + r * sstride, n, m.attn_softcap);
  softcap(mx, g, m.attn_softcap);
}

template <int NV, class Rows>
void attention_tile(const DecodeModel& m, const float* q, int64_t j, int64_t a, int64_t b, float* sc,
                    int64_t sstride, float* part, const Rows& keys, const Rows& values) {
  float mx[64];
  tile_scores<NV>(m, q, j, a, b, sc, sstride, mx, keys);
  softcap_rows(m, sc, sstride, b - a, mx);
  tile_values<NV>(m, a, b, sc, sstride, mx, part, values);
}

#ifdef EDGELLM_DEC_VNNI
// Whether quantized_key_scores() takes this key cache: int8 or int4, 64 or 128 dims (one or two 64-code vectors
// a row), groups of 16 elements or more (each 16-element chunk within one group), at most 16 query heads per KV head.
bool vnni_keys(const DecodeKV& kc, int64_t D, int64_t g) {
  return (kc.kind == DecodeKV::INT8 || kc.kind == DecodeKV::INT4) && (D == 64 || D == 128) && kc.G % 16 == 0 &&
         kc.G <= D && g <= 16;
}

// The first two levels of a 16 x 16 transpose-and-add: from 16 vectors (one per key), 4 vectors u[i] whose
// 128-bit block b, lane l holds the sum of key 4i+l's lanes 4b .. 4b+3 (its 16-element chunk b).
template <class V, class Add, class Lo, class Hi, class Lo64, class Hi64>
inline void chunk_sums(const V* v, V* u, Add add, Lo lo, Hi hi, Lo64 lo64, Hi64 hi64) {
  V t[8];
  for (int i = 0; i < 8; ++i) t[i] = add(lo(v[2 * i], v[2 * i + 1]), hi(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) u[i] = add(lo64(t[2 * i], t[2 * i + 1]), hi64(t[2 * i], t[2 * i + 1]));
}

// The last two levels: lane 4i+l of the result = the sum over the blocks of u[i]'s lane l.
inline __m512 block_sums(const __m512* u) {
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// tile_scores() for an int4 / int8 key cache without dequantizing it. A key element is c * s + m (code c, its
// group's scale s and, for int4, min m), so q . k = sum over 16-element chunks of s * (q_chunk . c_chunk) +
// m * sum(q_chunk). VPDPBUSD multiplies unsigned by signed bytes: int8 codes go in as c + 128 (a sign-bit flip)
// and 128 * (the lane's q sum) comes back off, in int32, before the chunk sums.
// The integer dots come out of VPDPBUSD (4 codes x 4 int8 q bytes a lane, 64 an instruction), 16 keys' lanes
// are summed into chunk sums in int32 (keys 4i..4i+3 per vector, a chunk per 128-bit block), and only then
// scaled by s and given the m term, 4 keys a vector, before the last two levels of the horizontal sum.
// q is written as QD int8 digits in base 128 (q / unit = q0 128^2 + q1 128 + q2, |q0| <= 127 for int4 codes,
// <= 63 for int8 ones, so no int32 sum can overflow), each digit one more VPDPBUSD into the shifted sum:
// 3 digits carry q to ~2^-21 (int8: 2^-20) of its largest element: scores within ~1e-5 of the float path's
// relative to |q||k|, 100x below the int4 keys' own error, where one digit (llama.cpp's Q8 activations) moved a
// tiny test model's logits by 0.2 (tests/test_decode_step.py holds the fused step to 1e-4 of the eager one).
template <int KIND, int NV, int QD>
void quantized_key_scores(const DecodeModel& m, const float* q, const DecodeKV& kc, int64_t j, int64_t a,
                          int64_t b, float* sc, int64_t sstride, float* mx) {
  constexpr int64_t D = NV * 8, NZ = D / 64, KB = 16;  // NZ 64-code vectors per row; keys per block
  constexpr bool I8 = KIND == DecodeKV::INT8;
  const int64_t g = m.n_heads / m.n_kv_heads, S = m.max_seq_len, G = kc.G, ng = D / G;
  alignas(64) int8_t qd[16][QD][D];  // the digits of each head's q
  alignas(64) float qc[16][NZ][16];  // per head, vector z, block b (all 4 lanes): chunk (z, b)'s q sum / unit
  alignas(64) int32_t off[16][NZ][16];  // int8: per lane of 4 elements, 128 * their q in units (the +128's share)
  float unit[16];                    // the value of one unit of the last digit, per head
  for (int64_t r = 0; r < g; ++r) {
    const float* qh = q + (j * g + r) * D;
    float amax = 0.0f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(qh[d]));
    float scale = amax > 0.0f ? amax / (I8 ? 63.0f : 127.0f) : 1.0f;
    for (int k = 1; k < QD; ++k) scale *= 1.0f / 128.0f;  // (powers of two: exact)
    unit[r] = scale;
    const float inv = 1.0f / scale;
    for (int64_t d = 0; d < D; d += 16) {
      // in units of the last digit; each digit takes what its place can hold, the next one the remainder
      __m512 rest = _mm512_mul_ps(_mm512_loadu_ps(qh + d), _mm512_set1_ps(inv));
      float place = 1.0f;
      for (int k = 1; k < QD; ++k) place *= 128.0f;
      for (int k = 0; k < QD; ++k, place *= 1.0f / 128.0f) {
        __m512 digit = _mm512_roundscale_ps(_mm512_mul_ps(rest, _mm512_set1_ps(1.0f / place)),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        digit = _mm512_min_ps(_mm512_max_ps(digit, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
        rest = _mm512_fnmadd_ps(digit, _mm512_set1_ps(place), rest);
        _mm_store_si128(reinterpret_cast<__m128i*>(qd[r][k] + d), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(digit)));
      }
    }
    if (I8)
      for (int64_t l = 0; l < D / 4; ++l) {
        int32_t sum = 0;
        for (int64_t d = 4 * l; d < 4 * l + 4; ++d) {
          int32_t v = 0;
          for (int k = 0; k < QD; ++k) v = v * 128 + qd[r][k][d];
          sum += v;
        }
        off[r][l / 16][l % 16] = 128 * sum;
      }
    for (int64_t z = 0; z < NZ; ++z)
      for (int64_t c = 0; c < 4; ++c) {
        float sum = 0.0f;
        for (int64_t d = 64 * z + 16 * c; d < 64 * z + 16 * c + 16; ++d) sum += qh[d];
        for (int l = 0; l < 4; ++l) qc[r][z][4 * c + l] = sum * inv;
      }
  }
  // scales / mins of 4 consecutive rows, [4 keys][ng] as loaded, into the u[i] layout of vector z:
  // block b, lane l = key l's value for chunk (z, b)
  __m512i sidx[NZ];
  for (int64_t z = 0; z < NZ; ++z) {
    alignas(64) int32_t idx[16];
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 4; ++l) idx[4 * c + l] = (int32_t)(l * ng + (64 * z + 16 * c) / G);
    sidx[z] = _mm512_load_si512(idx);
  }
  auto quad = [&](const uint16_t* base, int64_t row, int64_t keys, __m512* out) {
    const int64_t n = keys * ng;  // halves to read: never past the rows that exist
    const __m512 lo = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << std::min<int64_t>(n, 16)) - 1u),
                                                               base + row * ng));
    const __m512 hi = n > 16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << (n - 16)) - 1u),
                                                                       base + row * ng + 16))
                             : _mm512_setzero_ps();
    for (int64_t z = 0; z < NZ; ++z) out[z] = _mm512_permutex2var_ps(lo, sidx[z], hi);
  };
  const __m256i low4 = _mm256_set1_epi8(15);
  alignas(64) uint8_t codes[KB][D];  // unpacked, element order
  __m512 ls[4][NZ], lm[4][NZ];       // scales and mins of keys 4i.., u[i] layout
  auto add32 = [](__m512i x, __m512i y) { return _mm512_add_epi32(x, y); };
  auto lo32 = [](__m512i x, __m512i y) { return _mm512_unpacklo_epi32(x, y); };
  auto hi32 = [](__m512i x, __m512i y) { return _mm512_unpackhi_epi32(x, y); };
  auto lo64 = [](__m512i x, __m512i y) { return _mm512_unpacklo_epi64(x, y); };
  auto hi64 = [](__m512i x, __m512i y) { return _mm512_unpackhi_epi64(x, y); };
  for (int64_t c0 = a; c0 < b; c0 += KB) {
    const int64_t nc = std::min<int64_t>(KB, b - c0);
    for (int64_t i = 0; i < KB; ++i) {
      if (i >= nc) {  // padding keys: codes 0 and scales/mins 0, so score 0, never stored
        std::memset(codes[i], 0, sizeof(codes[i]));
        continue;
      }
      if (I8) {  // codes + 128 as unsigned bytes
        const uint8_t* src = kc.codes + (j * S + c0 + i) * D;
        for (int64_t z = 0; z < NZ; ++z)
          _mm512_store_si512(codes[i] + 64 * z, _mm512_xor_si512(_mm512_loadu_si512(src + 64 * z),
                                                                 _mm512_set1_epi8((char)0x80)));
        continue;
      }
      const uint8_t* src = kc.codes + (j * S + c0 + i) * (D / 2);
      for (int64_t z = 0; z < NZ; ++z) {  // 32 bytes: elements 32 z .. (low nibbles) and D/2 + 32 z .. (high)
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * z));
        _mm256_store_si256(reinterpret_cast<__m256i*>(codes[i] + 32 * z), _mm256_and_si256(v, low4));
        _mm256_store_si256(reinterpret_cast<__m256i*>(codes[i] + D / 2 + 32 * z),
                           _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
      }
    }
    for (int i = 0; i < 4; ++i) {
      const int64_t keys = std::max<int64_t>(0, std::min<int64_t>(4, nc - 4 * i));
      quad(kc.scales, j * S + c0 + 4 * i, keys, ls[i]);
      if (!I8) quad(kc.mins, j * S + c0 + 4 * i, keys, lm[i]);
    }
    for (int64_t r = 0; r < g; ++r) {
      __m512 y[4];
      for (int64_t z = 0; z < NZ; ++z) {
        __m512i qv[QD];
        for (int k = 0; k < QD; ++k) qv[k] = _mm512_load_si512(qd[r][k] + 64 * z);
        __m512i dots[KB], u[4];
        for (int64_t i = 0; i < KB; ++i) {
          const __m512i c = _mm512_load_si512(codes[i] + 64 * z);
          __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, qv[0]);
          for (int k = 1; k < QD; ++k) d = _mm512_dpbusd_epi32(_mm512_slli_epi32(d, 7), c, qv[k]);
          dots[i] = I8 ? _mm512_sub_epi32(d, _mm512_load_si512(off[r][z])) : d;
        }
        chunk_sums(dots, u, add32, lo32, hi32, lo64, hi64);
        const __m512 qz = _mm512_load_ps(qc[r][z]);
        for (int i = 0; i < 4; ++i) {
          const __m512 t = I8 ? _mm512_mul_ps(_mm512_cvtepi32_ps(u[i]), ls[i][z])
                              : _mm512_fmadd_ps(_mm512_cvtepi32_ps(u[i]), ls[i][z], _mm512_mul_ps(lm[i][z], qz));
          y[i] = z == 0 ? t : _mm512_add_ps(y[i], t);
        }
      }
      const __m512 v = _mm512_mul_ps(block_sums(y), _mm512_set1_ps(unit[r]));
      _mm512_mask_storeu_ps(sc + r * sstride + (c0 - a), (__mmask16)((1u << nc) - 1u), v);
    }
  }
  for (int64_t r = 0; r < g; ++r) {
    float* s = sc + r * sstride;
    const float* qh = q + (j * g + r) * D;
    for (int64_t p = a; p < std::min(b, kc.n_sink); ++p)  // the exact sink rows
      s[p - a] = dot(qh, kc.sink + (j * (kc.n_sink + 1) + p) * D, D);
    __m512 vm = _mm512_set1_ps(-INFINITY);
    int64_t p = 0;
    for (; p + 16 <= b - a; p += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + p));
    float mr = _mm512_reduce_max_ps(vm);
    for (; p < b - a; ++p) mr = std::max(mr, s[p]);
    mx[r] = mr;
  }
}

// Whether register_tile_values() takes this value cache: int8 or int4, 64 or 128 dims, groups of 16 or more.
bool vnni_values(const DecodeKV& vc, int64_t D) {
  return (vc.kind == DecodeKV::INT8 || vc.kind == DecodeKV::INT4) && (D == 64 || D == 128) && vc.G % 16 == 0 &&
         vc.G <= D;
}

// Row `row` of an int8 / int4 cache, dims h0 .. h0 + 63, dequantized into 4 registers (int8: c * s, int4:
// c * s + m; each 16 dims lie in one group). int4 is split-halves nibbles: byte i holds dims i and i + D/2.
template <int KIND>
inline void row64(const DecodeKV& c, int64_t row, int64_t D, int64_t h0, __m512* out) {
  const int64_t ng = D / c.G;
  const uint16_t* sc = c.scales + row * ng;
  if (KIND == DecodeKV::INT8) {
    const int8_t* src = reinterpret_cast<const int8_t*>(c.codes) + row * D + h0;
    for (int k = 0; k < 4; ++k) {
      const __m128i piece = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * k));
      out[k] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(piece)),
                             _mm512_set1_ps(_cvtsh_ss(sc[(h0 + 16 * k) / c.G])));
    }
    return;
  }
  const uint8_t* src = c.codes + row * (D / 2);
  __m128i piece[4];
  if (D == 64) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi8(15));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
    piece[0] = _mm256_castsi256_si128(lo);
    piece[1] = _mm256_extracti128_si256(lo, 1);
    piece[2] = _mm256_castsi256_si128(hi);
    piece[3] = _mm256_extracti128_si256(hi, 1);
  } else {
    const __m512i v = _mm512_loadu_si512(src);
    const __m512i n = _mm512_and_si512(h0 == 0 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));
    piece[0] = _mm512_extracti32x4_epi32(n, 0);
    piece[1] = _mm512_extracti32x4_epi32(n, 1);
    piece[2] = _mm512_extracti32x4_epi32(n, 2);
    piece[3] = _mm512_extracti32x4_epi32(n, 3);
  }
  const uint16_t* mn = c.mins + row * ng;
  for (int k = 0; k < 4; ++k) {
    const int64_t grp = (h0 + 16 * k) / c.G;
    out[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(piece[k])), _mm512_set1_ps(_cvtsh_ss(sc[grp])),
                             _mm512_set1_ps(_cvtsh_ss(mn[grp])));
  }
}

// For GH query heads: out[r][h0 ..] += sum over rows p in [p0, p1) of w[r][p] * V[p] (dims h0 .. h0 + 63),
// each row dequantized once in registers for all GH heads (no buffer round trip).
template <int KIND, int GH>
void values64(const DecodeKV& vc, int64_t j, int64_t S, int64_t D, int64_t h0, int64_t p0, int64_t p1,
                   const float* w, int64_t wstride, float* out, int64_t ostride) {
  __m512 acc[GH][4];
  for (int r = 0; r < GH; ++r)
    for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_loadu_ps(out + r * ostride + h0 + 16 * k);
  for (int64_t p = p0; p < p1; ++p) {
    __m512 v[4];
    row64<KIND>(vc, j * S + p, D, h0, v);
    for (int r = 0; r < GH; ++r) {
      const __m512 wr = _mm512_set1_ps(w[r * wstride + p]);
      for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_fmadd_ps(wr, v[k], acc[r][k]);
    }
  }
  for (int r = 0; r < GH; ++r)
    for (int k = 0; k < 4; ++k) _mm512_storeu_ps(out + r * ostride + h0 + 16 * k, acc[r][k]);
}

// tile_values() for an int8 / int4 value cache: the softmax numerators, then the values 64 dims and up to 4 heads at a
// time (4 x 4 accumulators and a row in 20 registers); the exact sink rows in float.
template <int KIND, int NV>
void register_tile_values(const DecodeModel& m, const DecodeKV& vc, int64_t j, int64_t a, int64_t b, float* sc,
                      int64_t sstride, const float* mx, float* part) {
  constexpr int64_t D = NV * 8;
  const int64_t g = m.n_heads / m.n_kv_heads, S = m.max_seq_len;
  float l[64];
  for (int64_t r = 0; r < g; ++r) l[r] = exp_sum(sc + r * sstride, 0, b - a, mx[r]);
  for (int64_t r = 0; r < g; ++r) std::memset(part + r * (D + 2), 0, sizeof(float) * D);
  const int64_t p0 = std::min(b, std::max(a, vc.n_sink));
  for (int64_t p = a; p < p0; ++p)  // the exact sink rows
    for (int64_t r = 0; r < g; ++r)
      axpy(sc[r * sstride + p - a], vc.sink + (j * (vc.n_sink + 1) + p) * D, part + r * (D + 2), D);
  const float* w = sc - a;  // w[r * sstride + p]
  for (int64_t r0 = 0; r0 < g; r0 += 4) {
    const int64_t gh = std::min<int64_t>(4, g - r0);
    for (int64_t h0 = 0; h0 < D; h0 += 64) {
      const float* wr = w + r0 * sstride;
      float* o = part + r0 * (D + 2);
      if (gh == 4) values64<KIND, 4>(vc, j, S, D, h0, p0, b, wr, sstride, o, D + 2);
      else if (gh == 3) values64<KIND, 3>(vc, j, S, D, h0, p0, b, wr, sstride, o, D + 2);
      else if (gh == 2) values64<KIND, 2>(vc, j, S, D, h0, p0, b, wr, sstride, o, D + 2);
      else values64<KIND, 1>(vc, j, S, D, h0, p0, b, wr, sstride, o, D + 2);
    }
  }
  for (int64_t r = 0; r < g; ++r) {
    part[r * (D + 2) + D] = mx[r];
    part[r * (D + 2) + D + 1] = l[r];
  }
}
#endif

template <int NV>
void quantized_tile(const DecodeModel& m, const float* q, const DecodeKV& kc, const DecodeKV& vc, int64_t j,
                    int64_t a, int64_t b, float* scores, float* part) {
  const int64_t S = m.max_seq_len;
  auto rows = [&](const DecodeKV& c) {
    return [&c, j, S](int64_t c0, int64_t nc, float* buf) -> const float* {
      kv_rows_avx2(c, j, c0, nc, S, NV * 8, buf);
      return buf;
    };
  };
  float* sc = scores + j * (m.n_heads / m.n_kv_heads) * S + a;
#ifdef EDGELLM_DEC_VNNI
  const bool fast_keys = m.int_attention && vnni_keys(kc, NV * 8, m.n_heads / m.n_kv_heads);
  const bool fast_values = m.int_attention && vnni_values(vc, NV * 8);
  if (fast_keys || fast_values) {
    float mx[64];
    if (fast_keys && kc.kind == DecodeKV::INT4) quantized_key_scores<DecodeKV::INT4, NV, 3>(m, q, kc, j, a, b, sc, S, mx);
    else if (fast_keys) quantized_key_scores<DecodeKV::INT8, NV, 3>(m, q, kc, j, a, b, sc, S, mx);
    else tile_scores<NV>(m, q, j, a, b, sc, S, mx, rows(kc));
    softcap_rows(m, sc, S, b - a, mx);
    if (fast_values && vc.kind == DecodeKV::INT4) register_tile_values<DecodeKV::INT4, NV>(m, vc, j, a, b, sc, S, mx, part);
    else if (fast_values) register_tile_values<DecodeKV::INT8, NV>(m, vc, j, a, b, sc, S, mx, part);
    else tile_values<NV>(m, a, b, sc, S, mx, part, rows(vc));
    return;
  }
#endif
  attention_tile<NV>(m, q, j, a, b, sc, S, part, rows(kc), rows(vc));
}

template <int NV>
void f32_tile(const DecodeModel& m, const float* q, const float* kc, const float* vc, int64_t j, int64_t a,
              int64_t b, float* sc, int64_t sstride, float* part) {
  const int64_t D = NV * 8, S = m.max_seq_len;
  auto rows = [j, S, D](const float* c) {
    return [c, j, S, D](int64_t c0, int64_t, float*) -> const float* { return c + (j * S + c0) * D; };
  };
  attention_tile<NV>(m, q, j, a, b, sc, sstride, part, rows(kc), rows(vc));
}
#endif

// attention_rows() for one token and a quantized cache: q [Hq, D] already scaled and rotated. A key/value row
// is dequantized once per KV head and serves the g query heads of that KV head. Head dims 64 and 128 (AVX2) take
// quantized_tile: 32 rows dequantized at a time, q / the output in registers, 8 scores per hsum8 (at 6k
// context the int4 cache's attention went from 16 ms to ~6 ms a token; it was compute-bound, not memory-bound).
// On an AVX-512 VNNI build quantized_tile computes the scores from the codes (quantized_key_scores) and
// dequantizes value rows in registers (register_tile_values): ~3.3 ms at 6k (benchmarks/kv_step_split.py).
void attention_quantized(const DecodeModel& m, const float* q, const DecodeKV& kc, const DecodeKV& vc, int64_t lo,
                         int64_t n, float* out, float* work) {
  const int64_t D = m.head_dim, Hkv = m.n_kv_heads, g = m.n_heads / m.n_kv_heads, S = m.max_seq_len;
  const int64_t nt = max_threads();
  int64_t tile;  // dequantizing makes each key dearer than in attention_rows(): split from shorter contexts on
  const int64_t tiles = key_tiles(n - lo, Hkv, D, nt, 8192, tile);  // keys [lo, n)
  float* scores = work;
  float* part = work + m.n_heads * S;
#ifdef EDGELLM_DEC_AVX2
  const bool fast = (D == 64 || D == 128) && kc.G % 8 == 0 && vc.G % 8 == 0 && g <= 64;
#else
  const bool fast = false;
#endif
  auto task = [&](int64_t t0, int64_t t1) {
    float row[1024];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j = t / tiles, a = lo + (t % tiles) * tile, b = std::min(n, a + tile);
#ifdef EDGELLM_DEC_AVX2
      if (fast) {
        if (D == 64) quantized_tile<8>(m, q, kc, vc, j, a, b, scores, part + t * g * (D + 2));
        else quantized_tile<16>(m, q, kc, vc, j, a, b, scores, part + t * g * (D + 2));
        continue;
      }
#endif
      float mx[64], l[64];
      for (int64_t r = 0; r < g; ++r) mx[r] = -INFINITY;
      for (int64_t p = a; p < b; ++p) {
        kv_row(kc, j, p, S, D, row);
        for (int64_t r = 0; r < g; ++r) {
          const int64_t h = j * g + r;
          const float sc = dot(q + h * D, row, D);
          scores[h * S + p] = sc;
          mx[r] = std::max(mx[r], sc);
        }
      }
      if (m.attn_softcap > 0.0f) {
        for (int64_t r = 0; r < g; ++r) softcap(scores + (j * g + r) * S + a, b - a, m.attn_softcap);
        softcap(mx, g, m.attn_softcap);
      }
      for (int64_t r = 0; r < g; ++r) {
        l[r] = exp_sum(scores + (j * g + r) * S, a, b, mx[r]);
        std::memset(part + (t * g + r) * (D + 2), 0, sizeof(float) * D);
      }
      for (int64_t p = a; p < b; ++p) {
        kv_row(vc, j, p, S, D, row);
        for (int64_t r = 0; r < g; ++r) axpy(scores[(j * g + r) * S + p], row, part + (t * g + r) * (D + 2), D);
      }
      for (int64_t r = 0; r < g; ++r) {
        part[(t * g + r) * (D + 2) + D] = mx[r];
        part[(t * g + r) * (D + 2) + D + 1] = l[r];
      }
    }
  };
  if (tiles * Hkv == 1 || nt <= 1) task(0, tiles * Hkv);
  else parallel_run(0, tiles * Hkv, 1, task);
  combine_tiles(m, part, tiles, out);
}

}  // namespace

int64_t decode_work_floats(const DecodeModel& m) {
  const int64_t D = m.head_dim, g = m.n_heads / m.n_kv_heads;
  const int64_t max_tiles = 64 * 1024;  // bounded by (n + 63) / 64 and by 2 * threads / Hkv
  (void)max_tiles;
  const int64_t tiles = std::max<int64_t>(1, (m.max_seq_len + 63) / 64);
  return m.n_heads * m.max_seq_len + m.n_kv_heads * tiles * g * (D + 2);
}

namespace {
struct Clock {
  bool on;
  std::chrono::steady_clock::time_point t;
  explicit Clock(bool on_) : on(on_) { if (on) t = std::chrono::steady_clock::now(); }
  void lap(double& acc) {  // add the time since the last lap to acc
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    acc += std::chrono::duration<double>(now - t).count();
    t = now;
  }
};
}  // namespace

void decode_tokens(DecodeModel& m, const int64_t* tokens, int64_t T, int64_t pos, float* logits, int variant,
                   bool last_only) {
  Clock clk(m.profile);
  m.steps += T;
  const int64_t dim = m.dim, D = m.head_dim, Hq = m.n_heads, Hkv = m.n_kv_heads, S = m.max_seq_len;
  const int64_t qsz = Hq * D, kvsz = Hkv * D, hid = m.hidden, qkvw = qsz + 2 * kvsz;
  const int64_t tw = std::max(dim, 2 * hid);
  // Row-major [T, width] activations; each token's row goes through exactly what a one-token step does.
  float* h = m.buf.data();      // [T, dim]
  float* xn = h + T * dim;      // [T, dim]
  float* qkv = xn + T * dim;    // [T, qkvw]
  float* att = qkv + T * qkvw;  // [T, qsz]
  float* tmp = att + T * qsz;   // [T, tw]
  float* act = tmp + T * tw;    // [T, hid]
  float* work = m.work.data();
  const int64_t R = m.rotary_dim;
  const bool gemm = last_only && T >= kPrefillGemmRows && gguf_prompt_gemm_fast();  // the layers' GGUF linears
  for (int64_t t = 0; t < T; ++t) {
    embed(m, tokens[t], h + t * dim);
    if (m.embed_scale != 1.0f)
      for (int64_t i = 0; i < dim; ++i) h[t * dim + i] *= m.embed_scale;
  }
  for (size_t li = 0; li < m.layers.size(); ++li) {
    const DecodeLayer& L = m.layers[li];
    const float* kcen = m.kv_center ? m.kv_center + li * 2 * kvsz : nullptr;  // [2, Hkv, D] of this layer
    const float* kscale = m.kv_key_scale ? m.kv_key_scale + li * kvsz : nullptr;  // [Hkv, D] of this layer
    const float* qscale = kscale ? m.kv_query_scale.data() + li * kvsz : nullptr;
    for (int64_t t = 0; t < T; ++t) rmsnorm(h + t * dim, L.attn_norm, m.eps, xn + t * dim, dim);
    clk.lap(m.t_other);
    linear(L.qkv, xn, T, qkv, variant, gemm);
    clk.lap(m.t_matmul);
    const float* cos_table = L.local_rope ? m.rope_cos_local : m.rope_cos;
    const float* sin_table = L.local_rope ? m.rope_sin_local : m.rope_sin;
    for (int64_t t = 0; t < T; ++t) {
      float* q = qkv + t * qkvw;
      if (L.q_norm) {  // per head, before RoPE (Qwen3, Gemma 3); in place: each element is read before it is written
        for (int64_t hh = 0; hh < Hq; ++hh) rmsnorm(q + hh * D, L.q_norm, m.eps, q + hh * D, D);
        for (int64_t hh = 0; hh < Hkv; ++hh) rmsnorm(q + qsz + hh * D, L.k_norm, m.eps, q + qsz + hh * D, D);
      }
      rope(q, Hq + Hkv, D, R, cos_table + (pos + t) * R, sin_table + (pos + t) * R);  // Q heads then K heads
      const float* k = q + qsz;
      const float* v = k + kvsz;
      for (int64_t j = 0; j < Hkv; ++j) {
        if (m.kv_rot) {  // a quantized cache holds K and V centred and rotated (edgellm.cache)
          float rk[1024], rv[1024], ck[1024], cv[1024];
          const float* kj = k + j * D;
          const float* vj = v + j * D;
          if (kcen) {
            for (int64_t d = 0; d < D; ++d) {
              ck[d] = kj[d] - kcen[j * D + d];
              cv[d] = vj[d] - kcen[kvsz + j * D + d];
            }
            if (kscale)
              for (int64_t d = 0; d < D; ++d) ck[d] *= kscale[j * D + d];
            kj = ck;
            vj = cv;
          }
          rotate(kj, m.kv_rot, rk, D);
          rotate(vj, m.kv_rot, rv, D);
          kv_write(L.k, j, pos + t, S, D, rk);
          kv_write(L.v, j, pos + t, S, D, rv);
        } else {
          kv_write(L.k, j, pos + t, S, D, k + j * D);
          kv_write(L.v, j, pos + t, S, D, v + j * D);
        }
      }
      for (int64_t i = 0; i < qsz; ++i) q[i] *= m.attn_scale;
    }
    clk.lap(m.t_other);
    // causal: token t sees positions [0, pos + t]
    const bool fp = L.k.kind == DecodeKV::F32;
    const bool together =
        fp && T > 1 && m.attention_rows && attention_rows(m, qkv, qkvw, L.k.f, L.v.f, pos, T, att, qsz, L.window);
    for (int64_t t = 0; t < T && !together; ++t) {
      float* o = att + t * qsz;
      if (fp) {
        attention_rows(m, qkv + t * qkvw, qkvw, L.k.f, L.v.f, pos + t, 1, o, qsz, L.window);
        continue;
      }
      const int64_t lo = L.window > 0 ? std::max<int64_t>(0, pos + t + 1 - L.window) : 0;
      if (L.k.kind == DecodeKV::F16) {  // tiles converted to fp32 32 rows at a time (attention_quantized's readers)
        attention_quantized(m, qkv + t * qkvw, L.k, L.v, lo, pos + t + 1, o, work);
        continue;
      }
      float* qr = m.qrot.data();  // q (/ key scales) @ R per head, attention, then the output rotated back (R^T)
      for (int64_t h = 0; h < Hq; ++h) {
        const float* qh = qkv + t * qkvw + h * D;
        float qs[1024];
        if (qscale) {
          const float* inv = qscale + (h / (Hq / Hkv)) * D;
          for (int64_t d = 0; d < D; ++d) qs[d] = qh[d] * inv[d];
          qh = qs;
        }
        rotate(qh, m.kv_rot, qr + h * D, D);
      }
      attention_quantized(m, qr, L.k, L.v, lo, pos + t + 1, qr + qsz, work);
      for (int64_t h = 0; h < Hq; ++h) {
        rotate(qr + qsz + h * D, m.kv_rot_t.data(), o + h * D, D);  // back: x @ R^T
        if (kcen) add_inplace(o + h * D, kcen + kvsz + (h / (Hq / Hkv)) * D, D);
      }
    }
    clk.lap(m.t_attention);
    linear(L.o, att, T, tmp, variant, gemm);
    clk.lap(m.t_matmul);
    for (int64_t t = 0; t < T; ++t) {
      if (L.post_attn_norm) rmsnorm(tmp + t * dim, L.post_attn_norm, m.eps, tmp + t * dim, dim);
      add_inplace(h + t * dim, tmp + t * dim, dim);
      rmsnorm(h + t * dim, L.ffn_norm, m.eps, xn + t * dim, dim);
    }
    clk.lap(m.t_other);
    linear(L.w13, xn, T, tmp, variant, gemm);
    clk.lap(m.t_matmul);
    for (int64_t t = 0; t < T; ++t) {
      if (m.act == 1) gelu_mul(tmp + t * 2 * hid, tmp + t * 2 * hid + hid, act + t * hid, hid);
      else silu_mul(tmp + t * 2 * hid, tmp + t * 2 * hid + hid, act + t * hid, hid);
    }
    clk.lap(m.t_other);
    linear(L.w2, act, T, xn, variant, gemm);
    clk.lap(m.t_matmul);
    for (int64_t t = 0; t < T; ++t) {
      if (L.post_ffn_norm) rmsnorm(xn + t * dim, L.post_ffn_norm, m.eps, xn + t * dim, dim);
      add_inplace(h + t * dim, xn + t * dim, dim);
    }
  }
  const int64_t first = last_only ? T - 1 : 0;  // the rows the LM head multiplies
  for (int64_t t = first; t < T; ++t) rmsnorm(h + t * dim, m.norm, m.eps, xn + t * dim, dim);
  clk.lap(m.t_other);
  linear(m.output, xn + first * dim, T - first, logits, variant);
  softcap(logits, (T - first) * m.vocab, m.final_softcap);  // Gemma 2
  clk.lap(m.t_matmul);
}

void decode_step(DecodeModel& m, int64_t token, int64_t pos, float* logits, int variant) {
  decode_tokens(m, &token, 1, pos, logits, variant);
}

void decode_prepare(DecodeModel& m) {
  const int64_t dim = m.dim, qsz = m.n_heads * m.head_dim, kvsz = m.n_kv_heads * m.head_dim, hid = m.hidden;
  const int64_t per_row = 2 * dim + (qsz + 2 * kvsz) + qsz + std::max(dim, 2 * hid) + hid;
  m.buf.assign(kDecodeMaxRows * per_row + 64, 0.0f);
  m.work.assign(decode_work_floats(m) + 64, 0.0f);
  m.qrot.assign(2 * qsz + 64, 0.0f);
  m.kv_rot_t.clear();
  if (m.kv_rot) {
    const int64_t D = m.head_dim;
    m.kv_rot_t.resize(D * D);
    for (int64_t i = 0; i < D; ++i)
      for (int64_t j = 0; j < D; ++j) m.kv_rot_t[j * D + i] = m.kv_rot[i * D + j];
  }
  m.kv_query_scale.clear();
  if (m.kv_key_scale) {
    const int64_t n = (int64_t)m.layers.size() * m.n_kv_heads * m.head_dim;
    m.kv_query_scale.resize(n);
    for (int64_t i = 0; i < n; ++i) m.kv_query_scale[i] = 1.0f / m.kv_key_scale[i];
  }
}

}  // namespace edgellm
