// edgellm CPU weight-only matmul kernels: y[M,N] = x[M,K] @ dequant(W)[N,K]^T for small M (decode, verify).
//
// Weight format (fixed, see quant/groups.py):
//   int4: codes uint8 [N, K/2], GGUF Q4_0/Q4_1 packing per block of 32 along K: byte j of a block's 16 bytes
//         = code[j] | code[j+16] << 4; scales fp16 [N, K/G]; w = (code - 8) * scale, or code * scale + min
//         when mins fp16 [N, K/G] is given.  G in {32, 64, 128}.
//   int8: codes int8 [N, K]; scales fp16 [N, K/G]; w = code * scale.  G = 32/64/128 or G = K (per channel).
//
// Two approaches live here (benchmarks/kernels_cpu.py measures both):
//   (a) "int-dot", llama.cpp's: quantize each 32-block of x to int8 with one fp32 scale, multiply int4/int8
//       codes by int8 activations with integer dot products (AVX2 maddubs/madd, NEON sdot/smull), scale the
//       per-block int32 sums by d_w * d_x.  Not bit-exact to the float reference: x is rounded to 8 bits,
//       ~0.5% relative error on Gaussian x, as in llama.cpp.  The default ("auto"): on AVX2 it needs ~6
//       vector ops per 32 weights against ~20 for (b), and measured several times faster at M = 1.
//   (b) "float-fma": dequantize codes to fp32 in registers and FMA with the fp32 activations.  Exact up to
//       fp32 summation order; kept as variant 2 for exactness checks and the benchmark.
//
// This file includes no Python/pybind and only ATen/Parallel.h (threads), so it compiles in a few seconds;
// cpu_bindings.cpp holds the pybind module and the torch op registration.  With -DEDGELLM_STANDALONE it
// compiles with no torch at all (tests/test_cpu_kernels.py builds it so to check the portable path, and
// the NEON path under qemu).
//
// ISA paths, chosen at compile time from the target flags the builder passes:
//   AVX2+FMA+F16C (x86-64), NEON (arm64; sdot when __ARM_FEATURE_DOTPROD), and portable scalar C++.
//   AVX-512 VNNI (Zen 4, Ice Lake and later): the same AVX2 kernels, with vpdpbusd (u8 x s8, four products
//   summed into each int32 lane) in place of maddubs + madd + one level of hadd in the full 8-block chunks.
//   The integer block sums are the same numbers (nothing saturates either way), so results are bit for bit
//   those of the AVX2 build; it pays where the kernels are compute-bound: a T-token verification pass and
//   the int8 activation rows of prefill chunks <= 16 tokens.  The multi-token row-group kernel also takes
//   16 rows in 512-bit registers there (V16 below): on Zen 4 a 512-bit vpdpbusd issues as fast as a 256-bit
//   one (measured 181 vs 101 GMAC/s per core), so a verification pass's integer dots run up to twice as fast.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "half.h"

#if !defined(EDGELLM_FORCE_SCALAR) && defined(__AVX2__) && (defined(_MSC_VER) || (defined(__FMA__) && defined(__F16C__)))
#define EDGELLM_AVX2 1
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define EDGELLM_VNNI 1
#endif
#elif !defined(EDGELLM_FORCE_SCALAR) && (defined(__aarch64__) || defined(_M_ARM64))
#define EDGELLM_NEON 1
#include <arm_neon.h>
#else
#define EDGELLM_SCALAR 1
#endif

#ifdef EDGELLM_STANDALONE
namespace edgellm_par {
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t /*grain*/, const F& f) {
  if (begin < end) f(begin, end);
}
}  // namespace edgellm_par
#elif defined(_OPENMP)
#include <ATen/Parallel.h>
namespace edgellm_par {
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  // at::parallel_for runs on torch's intra-op OpenMP pool (the extension is compiled with -fopenmp and
  // links the same libgomp.so.1 torch loaded), so torch.set_num_threads() applies and the threads are
  // already warm from torch's own ops.
  at::parallel_for(begin, end, grain, f);
}
}  // namespace edgellm_par
#else
// No OpenMP in this build (e.g. Apple clang): at::parallel_for would run serially, so keep a small pool of
// our own, sized by torch.get_num_threads().  Workers spin briefly before sleeping: decode calls arrive
// every few tens of microseconds, and a condition-variable wake-up costs about that much.
#include <ATen/Parallel.h>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
namespace edgellm_par {
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: joining threads during static teardown can hang
    return *pool;
  }
  void run(int ntasks, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> serial(run_mu_);
    while ((int)threads_.size() < ntasks - 1) {
      const int id = (int)threads_.size();
      threads_.emplace_back([this, id] { worker(id); });
      threads_.back().detach();
    }
    task_ = &fn;
    ntasks_ = ntasks;
    pending_.store((int)threads_.size(), std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lk(mu_);
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    fn(0);
    for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins)
      if (spins > 2000) std::this_thread::yield();
  }

 private:
  void worker(int id) {
    uint64_t seen = 0;
    for (;;) {
      for (int spins = 0; gen_.load(std::memory_order_acquire) == seen && spins < 100000; ++spins) {
      }
      if (gen_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen; });
      }
      seen = gen_.load(std::memory_order_acquire);
      if (id + 1 < ntasks_) (*task_)(id + 1);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
  std::mutex run_mu_, mu_;
  std::condition_variable cv_;
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0};
  const std::function<void(int)>* task_ = nullptr;
  int ntasks_ = 0;
};

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t range = end - begin;
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), (range + grain - 1) / std::max<int64_t>(grain, 1));
  if (nt <= 1) {
    f(begin, end);
    return;
  }
  const int64_t chunk = (range + nt - 1) / nt;
  const std::function<void(int)> task = [&](int i) {
    const int64_t b = begin + i * chunk, e = std::min(end, b + chunk);
    if (b < e) f(b, e);
  };
  Pool::get().run((int)nt, task);
}
}  // namespace edgellm_par
#endif

namespace edgellm {

static constexpr int64_t QK = 32;  // block of the int4 packing and of the activation quantization

// fp16 -> fp32: half_to_float in half.h (shared with cpu_decode.cpp)

// ---------------------------------------------------------------- scratch buffers
// One growing buffer per calling thread: the decode loop calls us ~120 times per token with the same
// shapes, so after the first token there is no allocation here.
static uint8_t* scratch(size_t bytes) {
  static thread_local std::vector<uint8_t> buf;
  if (buf.size() < bytes + 64) buf.resize(bytes + 64);
  uintptr_t p = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<uint8_t*>((p + 63) & ~uintptr_t(63));
}

// The 8-row kernel's transposed scales: a buffer of their own (scratch() holds the quantized activations,
// which the calling thread is still reading).
static float* scale_scratch(size_t floats) {
  static thread_local std::vector<float> buf;
  if (buf.size() < floats + 16) buf.resize(floats + 16);
  uintptr_t p = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t(63));
}

static inline void prefetch(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 2);  // into L2 (T1): see cpu_gguf_x8.cpp prefetch_sb
#elif defined(EDGELLM_AVX2)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
#else
  (void)p;
#endif
}

// Software prefetch of the row PREFETCH_BYTES ahead (codes, and the same rows' scales / mins).  The rows stream
// from DRAM (a token reads ~90 MB of weights here); the hardware prefetcher stops at each 4 KiB page and
// restarts slowly, and measured (one thread, weights cycled through 64 MB): 4 KiB ahead made the int4
// matvecs 1.3-1.6x and the int8 LM head 1.5x faster; 1-2 KiB helped less, 8-16 KiB no more.
static constexpr int64_t PREFETCH_BYTES = 4096;
static inline void prefetch_row(const void* crow, int64_t rb, const uint16_t* srow, const uint16_t* mrow, int64_t ng) {
  const char* c = static_cast<const char*>(crow) + PREFETCH_BYTES;
  for (int64_t o = 0; o < rb; o += 64) prefetch(c + o);
  const int64_t ahead = PREFETCH_BYTES / rb * ng;  // the scales of the row PREFETCH_BYTES ahead
  prefetch(srow + ahead);
  if (mrow) prefetch(mrow + ahead);
}

// ---------------------------------------------------------------- group index of a 32-block
struct GroupOf {
  int shift;    // log2(blocks per group) when that is a power of two, else -1
  int64_t bpg;  // blocks per group
  explicit GroupOf(int64_t G) : shift(-1), bpg(G / 32) {
    for (int s = 0; s < 40; ++s)
      if ((int64_t(1) << s) == bpg) shift = s;
  }
  int64_t operator()(int64_t b) const { return shift >= 0 ? (b >> shift) : b / bpg; }
};

// ---------------------------------------------------------------- activation quantization (approach a)
// Per row m and 32-block b:  q  int8 x / d rounded,  d = max|x| / 127,
//                            s  = d * sum(q)   (for the asymmetric min term),
//                            q8 = 8 * sum(q)   (int32, for the symmetric "- 8" offset).
// The offset terms use the *quantized* x (s, q8), not the exact sum of x: the total error is then
// sum_i w_i * (x_i - d q_i), proportional to the real weights, instead of also containing a
// min * rounding-error term that does not cancel (llama.cpp makes the same choice).
//
// AVX2 byte layout: blocks 2p and 2p+1 sit in the two 128-bit lanes of one register (a 32-byte load of
// the packed codes), so the 64 bytes at p*64 are [blk 2p x0..15 | blk 2p+1 x0..15 | blk 2p x16..31 |
// blk 2p+1 x16..31].  Other ISAs: [blk b x0..31] at b*32.  The per-block scalars are in natural order
// everywhere (the AVX2 kernels permute their block sums into it).
struct XQ {
  int64_t M, K, nb, nc, nfull;  // blocks, 8-block chunks (rounded up), full chunks
  int8_t* q;
  float* d;
  float* s;
  int32_t* q8;
  const int8_t* qrow(int64_t m) const { return q + m * nc * 256; }
  const float* drow(int64_t m) const { return d + m * nc * 8; }
  const float* srow(int64_t m) const { return s + m * nc * 8; }
  const int32_t* q8row(int64_t m) const { return q8 + m * nc * 8; }
};

static inline int64_t xq_off(int64_t b, int half /*0: x0..15, 1: x16..31*/) {
#ifdef EDGELLM_AVX2
  return (b >> 1) * 64 + half * 32 + (b & 1) * 16;
#else
  return b * 32 + half * 16;
#endif
}

static inline int64_t xq_pos(int64_t b, int64_t /*nfull*/) { return b; }  // per-block scalars: natural order

// Quantize one block of 32 floats; writes 16+16 bytes, returns d, stores sum(q) in *qsum.
static inline float quantize_block(const float* x, int8_t* lo, int8_t* hi, int32_t* qsum) {
#ifdef EDGELLM_AVX2
  __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16),
         v3 = _mm256_loadu_ps(x + 24);
  const __m256 sgn = _mm256_set1_ps(-0.0f);
  __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sgn, v0), _mm256_andnot_ps(sgn, v1)),
                            _mm256_max_ps(_mm256_andnot_ps(sgn, v2), _mm256_andnot_ps(sgn, v3)));
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const float d = amax / 127.0f;
  const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id));  // round to nearest even
  __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id));
  __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id));
  __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  *qsum = _mm_cvtsi128_si32(s4);
  // packs interleave the 128-bit lanes; the final permute restores x order.
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm_storeu_si128((__m128i*)lo, _mm256_castsi256_si128(p));
  _mm_storeu_si128((__m128i*)hi, _mm256_extracti128_si256(p, 1));
  return d;
#else
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f;
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t sum = 0;
  for (int i = 0; i < 32; ++i) {
    const int v = (int)std::nearbyint(x[i] * id);
    sum += v;
    if (i < 16) lo[i] = (int8_t)v; else hi[i - 16] = (int8_t)v;
  }
  *qsum = sum;
  return d;
#endif
}

// Requires K % 32 == 0.
static XQ quantize_x(const float* x, int64_t M, int64_t K) {
  XQ r;
  r.M = M; r.K = K; r.nb = K / QK; r.nc = (r.nb + 7) / 8; r.nfull = r.nb / 8;
  const size_t per = (size_t)(M * r.nc * 8);
  const size_t qbytes = per * 32;
  uint8_t* base = scratch(qbytes + 3 * per * 4 + 64);
  r.q = reinterpret_cast<int8_t*>(base);
  r.d = reinterpret_cast<float*>(base + qbytes);
  r.s = reinterpret_cast<float*>(base + qbytes + per * 4);
  r.q8 = reinterpret_cast<int32_t*>(base + qbytes + per * 8);
  for (int64_t m = 0; m < M; ++m) {
    int8_t* q = r.q + m * r.nc * 256;
    float* d = r.d + m * r.nc * 8;
    float* s = r.s + m * r.nc * 8;
    int32_t* q8 = r.q8 + m * r.nc * 8;
    for (int64_t b = r.nb; b < r.nc * 8; ++b) {  // padding (never read by the kernels; keep it defined)
      std::memset(q + xq_off(b, 0), 0, 16);
      std::memset(q + xq_off(b, 1), 0, 16);
      d[b] = s[b] = 0.0f;
      q8[b] = 0;
    }
    for (int64_t b = 0; b < r.nb; ++b) {
      int32_t qs;
      const float db = quantize_block(x + m * K + b * QK, q + xq_off(b, 0), q + xq_off(b, 1), &qs);
      const int64_t p = xq_pos(b, r.nfull);
      d[p] = db;
      s[p] = db * (float)qs;
      q8[p] = 8 * qs;
    }
  }
  return r;
}

static inline void fill_w8(float* out, const uint16_t* srow, int64_t c, const GroupOf& gof) {
  for (int j = 0; j < 8; ++j) out[j] = half_to_float(srow[gof(c * 8 + j)]);
}

#ifdef EDGELLM_AVX2
// =================================================================================================== AVX2
static inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline __m256i load_2x128(const void* lo, const void* hi) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)lo)),
                                 _mm_loadu_si128((const __m128i*)hi), 1);
}

// Per-block weight scales (or mins) of full chunk c, natural block order.
static inline __m256 load_w8n(const uint16_t* srow, int64_t c, int64_t G, const GroupOf& gof) {
  if (G == 32) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(srow + c * 8)));
  if (G == 64) {  // blocks 2g, 2g+1 share group g
    const __m128 g = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(srow + c * 4)));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(g), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
  }
  if (G == 128) {
    int32_t two;
    std::memcpy(&two, srow + c * 2, 4);
    const __m128 g = _mm_cvtph_ps(_mm_cvtsi32_si128(two));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(g), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  }
  if (gof(c * 8) == gof(c * 8 + 7)) return _mm256_set1_ps(_cvtsh_ss(srow[gof(c * 8)]));
  alignas(32) float t[8];
  fill_w8(t, srow, c, gof);
  return _mm256_load_ps(t);
}

// ---- approach (a), int4 and int8: one weight row against T activation rows (T <= 4).
// int4, per full chunk (8 blocks, 128 bytes of a row): 4 loads of 32 bytes = blocks (2k, 2k+1); maddubs of the
// u8 codes (0..15) with the s8 activations gives int16 sums of 2 products; adding the lo/hi nibble halves and
// two levels of hadd_epi16 sum 16 products per int16 lane, |.| <= 16*15*127 = 30480 < 32767, so nothing
// saturates or wraps; one madd with ones finishes the 32-product block sums as int32, in lane order
// 0,2,4,6,1,3,5,7, which one permute makes natural.
// int8: |w| * (x * sign w) == w * x; maddubs int16 pair sums reach 2*128*127 = 32512, so each half gets its
// own madd before the int32 add, and the block sums come from hadd_epi32 (same lane order).
// Tail blocks (K = 576 is 2 chunks + 2 blocks) go in pairs, one register per pair, with vector scales:
// [d_b, d_b+1] (fp16 -> fp32 in one conversion) x [dx_b, dx_b+1], expanded to [c_b x4 | c_b+1 x4] by one
// permute; the min (or -8 * sum q) terms of the tail go to a 128-bit accumulator.
// The float operations of one (row, activation row) pair run in the same order whatever T is, so a row of a
// T-token verification pass is bit-identical to the same row computed alone (M = 1): speculative decoding
// relies on it.  GS: the group size at compile time (32, the GGUF blocks, is the common case), 0 = any.
#ifdef EDGELLM_VNNI
static constexpr bool kVnni = true;
#else
static constexpr bool kVnni = false;
#endif

static inline __m256i q8_pair_dot(__m256i wlo, __m256i ulo, __m256i whi, __m256i uhi, const int8_t* xp,
                                  __m256i ones) {
  const __m256i xa = _mm256_sign_epi8(_mm256_load_si256((const __m256i*)xp), wlo);
  const __m256i xb = _mm256_sign_epi8(_mm256_load_si256((const __m256i*)(xp + 32)), whi);
#ifdef EDGELLM_VNNI
  (void)ones;
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ulo, xa), uhi, xb);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(ulo, xa), ones),
                          _mm256_madd_epi16(_mm256_maddubs_epi16(uhi, xb), ones));
#endif
}

template <int GS>
static inline __m256 w8_natural(const uint16_t* srow, int64_t c, int64_t G, const GroupOf& gof) {
  if (GS == 32) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(srow + c * 8)));
  return load_w8n(srow, c, G, gof);
}

template <int GS>
static inline __m128 w2_pair(const uint16_t* srow, int64_t b, const GroupOf& gof) {
  uint32_t two;
  if (GS == 32) {
    std::memcpy(&two, srow + b, 4);
  } else {
    two = (uint32_t)srow[gof(b)] | ((uint32_t)srow[gof(b + 1)] << 16);
  }
  return _mm_cvtph_ps(_mm_cvtsi32_si128((int)two));  // [w_b, w_b+1, 0, 0]
}

static inline float hsum_tail(__m256 acc, __m128 tail) {
  __m128 s = _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1)), tail);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Row n of W (codes row crow, scales srow, mins mrow) against activation rows m0 .. m0+T-1 -> out[(m0+t)*ldo].
template <int BITS, bool ASYM, int GS, int T>
static inline void qdot_row(const XQ& xq, int64_t m0, const uint8_t* crow, const uint16_t* srow, const uint16_t* mrow,
                            int64_t G, const GroupOf& gof, float* out, int64_t ldo) {
  const int64_t nb = xq.nb, nfull = xq.nfull, xstride = xq.nc * 256, dstride = xq.nc * 8;
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i natural = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i expand2 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const int8_t* xq0 = xq.qrow(m0);
  __m256 acc[T];
  __m128 tail[T];
  for (int t = 0; t < T; ++t) { acc[t] = _mm256_setzero_ps(); tail[t] = _mm_setzero_ps(); }
  for (int64_t c = 0; c < nfull; ++c) {
    __m256i hh[T][2];
    for (int kk = 0; kk < 2; ++kk) {
      __m256i s[T][2];
      for (int k2 = 0; k2 < 2; ++k2) {
        const int k = kk * 2 + k2;
        const int8_t* xk = xq0 + c * 256 + k * 64;
        if (BITS == 4) {
          const __m256i v = _mm256_loadu_si256((const __m256i*)(crow + c * 128 + k * 32));
          const __m256i lo = _mm256_and_si256(v, m4);                        // codes 0..15 of blk 2k | 2k+1
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);  // codes 16..31
          for (int t = 0; t < T; ++t) {
#ifdef EDGELLM_VNNI  // int32 lanes [blk 2k: 4 sums of 8 products | blk 2k+1: 4]
            s[t][k2] = _mm256_dpbusd_epi32(
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, _mm256_load_si256((const __m256i*)(xk + t * xstride))),
                hi, _mm256_load_si256((const __m256i*)(xk + t * xstride + 32)));
#else
            s[t][k2] = _mm256_add_epi16(
                _mm256_maddubs_epi16(lo, _mm256_load_si256((const __m256i*)(xk + t * xstride))),
                _mm256_maddubs_epi16(hi, _mm256_load_si256((const __m256i*)(xk + t * xstride + 32))));
#endif
          }
        } else {
          const int8_t* b0 = (const int8_t*)crow + c * 256 + k * 64;  // blocks 2k and 2k+1
          const __m256i wlo = load_2x128(b0, b0 + 32);                 // codes 0..15 of blk 2k | blk 2k+1
          const __m256i whi = load_2x128(b0 + 16, b0 + 48);            // codes 16..31
          const __m256i ulo = _mm256_sign_epi8(wlo, wlo), uhi = _mm256_sign_epi8(whi, whi);  // |w| as u8
          for (int t = 0; t < T; ++t) s[t][k2] = q8_pair_dot(wlo, ulo, whi, uhi, xk + t * xstride, ones);
        }
      }
      for (int t = 0; t < T; ++t)
        hh[t][kk] = BITS == 4 && !kVnni ? _mm256_hadd_epi16(s[t][0], s[t][1]) : _mm256_hadd_epi32(s[t][0], s[t][1]);
    }
    const __m256 dw = w8_natural<GS>(srow, c, G, gof);
    __m256 mw = _mm256_setzero_ps();
    if (ASYM) mw = w8_natural<GS>(mrow, c, G, gof);
    for (int t = 0; t < T; ++t) {
      __m256i h = BITS == 4 && !kVnni ? _mm256_madd_epi16(_mm256_hadd_epi16(hh[t][0], hh[t][1]), ones)
                                      : _mm256_hadd_epi32(hh[t][0], hh[t][1]);
      h = _mm256_permutevar8x32_epi32(h, natural);
      const int64_t o = (m0 + t) * dstride + c * 8;
      // symmetric int4: sum (code - 8) q = sum code q - 8 sum q, exactly, in int32
      if (BITS == 4 && !ASYM) h = _mm256_sub_epi32(h, _mm256_load_si256((const __m256i*)(xq.q8 + o)));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(dw, _mm256_load_ps(xq.d + o)), acc[t]);
      if (ASYM) acc[t] = _mm256_fmadd_ps(mw, _mm256_load_ps(xq.s + o), acc[t]);
    }
  }
  int64_t b = nfull * 8;
  for (; b + 2 <= nb; b += 2) {
    const int8_t* xb = xq0 + xq_off(b, 0);
    __m256i lo, hi, wlo, whi, ulo, uhi;
    if (BITS == 4) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(crow + b * 16));
      lo = _mm256_and_si256(v, m4);
      hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    } else {
      const int8_t* b0 = (const int8_t*)crow + b * 32;
      wlo = load_2x128(b0, b0 + 32);
      whi = load_2x128(b0 + 16, b0 + 48);
      ulo = _mm256_sign_epi8(wlo, wlo);
      uhi = _mm256_sign_epi8(whi, whi);
    }
    const __m128 dw2 = w2_pair<GS>(srow, b, gof);
    __m128 mw2 = _mm_setzero_ps();
    if (ASYM) mw2 = w2_pair<GS>(mrow, b, gof);
    for (int t = 0; t < T; ++t) {
      __m256i p;
      if (BITS == 4) {
        const __m256i sp = _mm256_add_epi16(
            _mm256_maddubs_epi16(lo, _mm256_load_si256((const __m256i*)(xb + t * xstride))),
            _mm256_maddubs_epi16(hi, _mm256_load_si256((const __m256i*)(xb + t * xstride + 32))));
        p = _mm256_madd_epi16(sp, ones);  // [blk b: 4 partial sums | blk b+1: 4]
      } else {
        p = q8_pair_dot(wlo, ulo, whi, uhi, xb + t * xstride, ones);
      }
      const int64_t o = (m0 + t) * dstride + b;
      const __m128 c2 = _mm_mul_ps(dw2, _mm_castsi128_ps(_mm_loadl_epi64((const __m128i*)(xq.d + o))));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_permutevar8x32_ps(_mm256_castps128_ps256(c2), expand2),
                               acc[t]);
      if (BITS == 4) {
        if (ASYM)
          tail[t] = _mm_fmadd_ps(mw2, _mm_castsi128_ps(_mm_loadl_epi64((const __m128i*)(xq.s + o))), tail[t]);
        else
          tail[t] = _mm_fnmadd_ps(c2, _mm_cvtepi32_ps(_mm_loadl_epi64((const __m128i*)(xq.q8 + o))), tail[t]);
      }
    }
  }
  float rest[T];
  for (int t = 0; t < T; ++t) rest[t] = 0.0f;
  if (b < nb) {  // one last block
    const float dw0 = _cvtsh_ss(srow[gof(b)]);
    const float mw0 = ASYM ? _cvtsh_ss(mrow[gof(b)]) : 0.0f;
    for (int t = 0; t < T; ++t) {
      const int8_t* xp = xq0 + t * xstride + xq_off(b, 0);
      const int64_t o = (m0 + t) * dstride + b;
      const float c0 = dw0 * xq.d[o];
      __m128i p;
      if (BITS == 4) {
        const __m128i m4s = _mm_set1_epi8(0x0F);
        const __m128i v = _mm_loadu_si128((const __m128i*)(crow + b * 16));
        const __m128i sp = _mm_add_epi16(_mm_maddubs_epi16(_mm_and_si128(v, m4s), _mm_loadu_si128((const __m128i*)xp)),
                                         _mm_maddubs_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), m4s),
                                                           _mm_loadu_si128((const __m128i*)(xp + 32))));
        p = _mm_madd_epi16(sp, _mm_set1_epi16(1));
        rest[t] = ASYM ? mw0 * xq.s[o] : -c0 * (float)xq.q8[o];
      } else {
        const int8_t* b0 = (const int8_t*)crow + b * 32;
        const __m128i w0 = _mm_loadu_si128((const __m128i*)b0), w1 = _mm_loadu_si128((const __m128i*)(b0 + 16));
        const __m128i one = _mm_set1_epi16(1);
        const __m128i xa = _mm_sign_epi8(_mm_loadu_si128((const __m128i*)xp), w0);
        const __m128i xc = _mm_sign_epi8(_mm_loadu_si128((const __m128i*)(xp + 32)), w1);
        p = _mm_add_epi32(_mm_madd_epi16(_mm_maddubs_epi16(_mm_sign_epi8(w0, w0), xa), one),
                          _mm_madd_epi16(_mm_maddubs_epi16(_mm_sign_epi8(w1, w1), xc), one));
      }
      tail[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(p), _mm_set1_ps(c0), tail[t]);
    }
  }
  for (int t = 0; t < T; ++t) out[(m0 + t) * ldo] = hsum_tail(acc[t], tail[t]) + rest[t];
}

// ---- approach (a), 8 (AVX2) or 16 (AVX-512) weight rows at a time (for 2+ activation rows; N % 8 leftover
// rows take the one-row kernel).
// The rows' codes of one 32-block are transposed in registers so that each int32 lane holds 4 consecutive
// codes of one row: an integer dot (vpdpbusd, or maddubs + madd) with 4 activation bytes broadcast to all
// lanes then adds 4 products to each row at once.  Every block ends with the rows' int32 sums in natural lane
// order, so the float epilogue is one convert and one FMA per block and token for all the rows (the one-row
// kernel needs three horizontal adds and a permute per 8 blocks and token), and the result is stored as 8 or
// 16 consecutive outputs.  The transpose (12 shuffles per block for int4, 24 for int8) is shared by the tokens
// of a tile (up to ROWS8_TILE); a T-token verification pass is what this is for.
// Per (row, token) the float operations are those of the one-row kernel (rows_tile), so a row's result
// does not depend on which kernel computed it, nor on the number of tokens: rows of a verification pass stay
// bit-identical to one-token steps, which take the one-row kernel (no transpose to amortise there).
static constexpr int64_t ROWS8 = 8;
// Tokens per pass over a group's transposed codes: each keeps 2 accumulators in registers, so 8 where AVX-512
// gives 32 vector registers, 4 with AVX2's 16.
#if defined(EDGELLM_VNNI)
#define ROWS8_TILE 8
#else
#define ROWS8_TILE 4
#endif
#if defined(__GNUC__) || defined(__clang__)
#define EDGELLM_INLINE static inline __attribute__((always_inline))
#else
#define EDGELLM_INLINE static __forceinline
#endif

static inline __m256i bcast32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Rows r0..r7 at p + r * stride, 16 bytes each (4 dwords q0..q3) -> q[j] = [row 0 qj, row 1 qj, ..., row 7 qj].
EDGELLM_INLINE void transpose_8x16(const uint8_t* p, int64_t stride, __m256i q[4]) {
  const __m256i a0 = load_2x128(p, p + 4 * stride), a1 = load_2x128(p + stride, p + 5 * stride);
  const __m256i a2 = load_2x128(p + 2 * stride, p + 6 * stride), a3 = load_2x128(p + 3 * stride, p + 7 * stride);
  const __m256i l01 = _mm256_unpacklo_epi32(a0, a1), h01 = _mm256_unpackhi_epi32(a0, a1);
  const __m256i l23 = _mm256_unpacklo_epi32(a2, a3), h23 = _mm256_unpackhi_epi32(a2, a3);
  q[0] = _mm256_unpacklo_epi64(l01, l23);
  q[1] = _mm256_unpackhi_epi64(l01, l23);
  q[2] = _mm256_unpacklo_epi64(h01, h23);
  q[3] = _mm256_unpackhi_epi64(h01, h23);
}

// u8 x s8 dot of 4-byte groups, added to the int32 lanes of acc (exact: no lane saturates for int4 codes, or
// for |int8| weights against sign-moved activations).
static inline __m256i dot4_u8s8(__m256i acc, __m256i u, __m256i x) {
#ifdef EDGELLM_VNNI
  return _mm256_dpbusd_epi32(acc, u, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}

// acc + u . (the 4 bytes at p, broadcast): VNNI folds the broadcast into the instruction's memory operand
// (compilers load it separately from intrinsics, one more uop per dot).
static inline __m256i dot4_u8s8_bcast(__m256i acc, __m256i u, const int8_t* p) {
#if defined(EDGELLM_VNNI) && (defined(__GNUC__) || defined(__clang__)) && !defined(EDGELLM_SIMDE_AVX512)
  __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
#else
  return dot4_u8s8(acc, u, bcast32(p));
#endif
}

// The fp32 scales (or mins) of rows n0..n0+7 for every group, transposed to [group][8]: one aligned load per
// block in the kernel.  fp16 -> fp32 is exact, so this changes no result.
static void transpose_scales8(const uint16_t* s, int64_t ng, float* out) {
  if (ng < 8) {
    for (int64_t g = 0; g < ng; ++g)
      for (int i = 0; i < 8; ++i) out[g * 8 + i] = _cvtsh_ss(s[i * ng + g]);
    return;
  }
  for (int64_t g0 = 0; g0 < ng; g0 += 8) {
    const int64_t g = std::min(g0, ng - 8);  // the last chunk overlaps the one before (same values written)
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + i * ng + g)));
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    float* o = out + g * 8;
    _mm256_store_ps(o + 0, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_store_ps(o + 8, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_store_ps(o + 16, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_store_ps(o + 24, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_store_ps(o + 32, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_store_ps(o + 40, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_store_ps(o + 48, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_store_ps(o + 56, _mm256_permute2f128_ps(u3, u7, 0x31));
  }
}

// The row-group kernels below are written once for a vector of R float / int32 lanes, one lane per weight row:
// V8 (AVX2 registers, 8 rows) everywhere, V16 (AVX-512 registers, 16 rows) in the VNNI build.  Every float
// operation is lane-wise, so a row's float sequence (and bits) is the same whichever R computes it.  On Zen 4
// a 512-bit vpdpbusd does twice the 256-bit one's work in the same issue slot (measured: 181 vs 101 GMAC/s per
// core), so the 16-row kernel does a verification pass's integer dots at up to twice the rate.
struct V8 {
  static constexpr int64_t R = 8;
  using F = __m256;
  using I = __m256i;
  static F fzero() { return _mm256_setzero_ps(); }
  static I izero() { return _mm256_setzero_si256(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static I set1i(int32_t v) { return _mm256_set1_epi32(v); }
  static F load(const float* p) { return _mm256_load_ps(p); }  // 32-byte aligned
  static void storeu(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F neg(F a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static I addi(I a, I b) { return _mm256_add_epi32(a, b); }
  static I subi(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I xori(I a, I b) { return _mm256_xor_si256(a, b); }
  static I set1b(char v) { return _mm256_set1_epi8(v); }
  static I abs8(I a) { return _mm256_abs_epi8(a); }
  static I sign8(I x, I w) { return _mm256_sign_epi8(x, w); }  // x * sign(w) (0 where w is 0)
  static I bcast(const int8_t* p) { return bcast32(p); }
  static I dot(I acc, I u, I x) { return dot4_u8s8(acc, u, x); }
  static I dot_bcast(I acc, I u, const int8_t* p) { return dot4_u8s8_bcast(acc, u, p); }
  static I nibbles_lo(I q) { return _mm256_and_si256(q, _mm256_set1_epi8(0x0F)); }
  static I nibbles_hi(I q) { return _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm256_set1_epi8(0x0F)); }
  static void transpose16(const uint8_t* p, int64_t stride, I q[4]) { transpose_8x16(p, stride, q); }
  static void transpose_scales(const uint16_t* s, int64_t ng, float* out) { transpose_scales8(s, ng, out); }
};

#if defined(EDGELLM_VNNI)
struct V16 {
  static constexpr int64_t R = 16;
  using F = __m512;
  using I = __m512i;
  static F fzero() { return _mm512_setzero_ps(); }
  static I izero() { return _mm512_setzero_si512(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static I set1i(int32_t v) { return _mm512_set1_epi32(v); }
  static F load(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned
  static void storeu(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F neg(F a) {  // (_mm512_xor_ps needs AVX512DQ)
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN)));
  }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static I addi(I a, I b) { return _mm512_add_epi32(a, b); }
  static I subi(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I xori(I a, I b) { return _mm512_xor_si512(a, b); }
  static I set1b(char v) { return _mm512_set1_epi8(v); }
  static I abs8(I a) { return _mm512_abs_epi8(a); }
  static I sign8(I x, I w) {  // x negated where w < 0 (where w is 0 the product with |w| is 0 either way)
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  }
  static I bcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I dot(I acc, I u, I x) { return _mm512_dpbusd_epi32(acc, u, x); }
  static I dot_bcast(I acc, I u, const int8_t* p) {
#if (defined(__GNUC__) || defined(__clang__)) && !defined(EDGELLM_SIMDE_AVX512)
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(p)));
    return acc;
#else
    return dot(acc, u, bcast(p));
#endif
  }
  static I nibbles_lo(I q) { return _mm512_and_si512(q, _mm512_set1_epi8(0x0F)); }
  static I nibbles_hi(I q) { return _mm512_and_si512(_mm512_srli_epi16(q, 4), _mm512_set1_epi8(0x0F)); }
  // Rows r0..r15 at p + r * stride, 16 bytes each -> q[j] = [row 0 qj, ..., row 15 qj]: 128-bit lane L of a_i
  // holds row 4L + i, so the unpacks of transpose_8x16, lane by lane, leave rows in natural order.
  static void transpose16(const uint8_t* p, int64_t stride, I q[4]) {
    I a[4];
    for (int i = 0; i < 4; ++i) {
      const uint8_t* r = p + i * stride;
      __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)r));
      v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(r + 4 * stride)), 1);
      v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(r + 8 * stride)), 2);
      a[i] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(r + 12 * stride)), 3);
    }
    const I l01 = _mm512_unpacklo_epi32(a[0], a[1]), h01 = _mm512_unpackhi_epi32(a[0], a[1]);
    const I l23 = _mm512_unpacklo_epi32(a[2], a[3]), h23 = _mm512_unpackhi_epi32(a[2], a[3]);
    q[0] = _mm512_unpacklo_epi64(l01, l23);
    q[1] = _mm512_unpackhi_epi64(l01, l23);
    q[2] = _mm512_unpacklo_epi64(h01, h23);
    q[3] = _mm512_unpackhi_epi64(h01, h23);
  }
  static void transpose_scales(const uint16_t* s, int64_t ng, float* out) {  // [group][16]: two [group][8]
    static thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < 16 * ng + 16) buf.resize(static_cast<size_t>(16 * ng + 16));
    float* a = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
    float* b = a + 8 * ng;
    transpose_scales8(s, ng, a);
    transpose_scales8(s + 8 * ng, ng, b);
    for (int64_t g = 0; g < ng; ++g) {
      _mm256_store_ps(out + g * 16, _mm256_load_ps(a + g * 8));
      _mm256_store_ps(out + g * 16 + 8, _mm256_load_ps(b + g * 8));
    }
  }
};
#endif

// Block b of rows n0..n0+R-1 (codes at `codes`, row stride rb bytes), transposed: lanes = rows; lo[j]: codes
// (int8: bytes) 4j..4j+3 of the block, hi[j]: 16+4j..16+4j+3.
template <class V, int BITS>
EDGELLM_INLINE void rows_codes(const uint8_t* codes, int64_t b, int64_t rb, typename V::I lo[4], typename V::I hi[4]) {
  if (BITS == 4) {
    typename V::I q[4];
    V::transpose16(codes + b * 16, rb, q);
    for (int j = 0; j < 4; ++j) {
      lo[j] = V::nibbles_lo(q[j]);
      hi[j] = V::nibbles_hi(q[j]);
    }
  } else {
    V::transpose16(codes + b * 32, rb, lo);
    V::transpose16(codes + b * 32 + 16, rb, hi);
  }
}

// One block b of rows n0..n0+R-1 (codes at `codes`, row stride rb bytes) against activation rows m0..m0+T-1,
// into accumulators acc[t]: the block's exact integer sums, times d_w * d_x (+ min_w * s_x), one FMA each.
template <class V, int BITS, bool ASYM, int T>
EDGELLM_INLINE void rows_block(const XQ& xq, int64_t m0, int64_t b, const uint8_t* codes, int64_t rb,
                               const float* wsc, const float* wmn, const GroupOf& gof, typename V::F* acc) {
  using I = typename V::I;
  using F = typename V::F;
  const int64_t xstride = xq.nc * 256, dstride = xq.nc * 8;
  I lo[4], hi[4];
  rows_codes<V, BITS>(codes, b, rb, lo, hi);
#if defined(EDGELLM_VNNI)
  if (BITS == 8) {  // w + 128 as u8; the 128 * sum(x) it adds is taken off below, exactly, in int32
    const I flip = V::set1b(static_cast<char>(0x80));
    for (int j = 0; j < 4; ++j) { lo[j] = V::xori(lo[j], flip); hi[j] = V::xori(hi[j], flip); }
  }
#else
  I alo[4], ahi[4];  // |w| as u8; the activations take w's sign per token (|.| <= 2*128*127 in int16)
  if (BITS == 8)
    for (int j = 0; j < 4; ++j) { alo[j] = V::abs8(lo[j]); ahi[j] = V::abs8(hi[j]); }
#endif
  const F dw = V::load(wsc + gof(b) * V::R);
  F mw = V::fzero();
  if (ASYM) mw = V::load(wmn + gof(b) * V::R);
  const int8_t* x0 = xq.qrow(m0);
  const int64_t off0 = xq_off(b, 0), off1 = xq_off(b, 1);
  for (int t = 0; t < T; ++t) {
    const int8_t* xl = x0 + t * xstride + off0;
    const int8_t* xh = x0 + t * xstride + off1;
    I s0 = V::izero(), s1 = V::izero();
    for (int j = 0; j < 4; ++j) {
#if defined(EDGELLM_VNNI)
      s0 = V::dot_bcast(s0, lo[j], xl + 4 * j);
      s1 = V::dot_bcast(s1, hi[j], xh + 4 * j);
#else
      if (BITS == 4) {
        s0 = V::dot_bcast(s0, lo[j], xl + 4 * j);
        s1 = V::dot_bcast(s1, hi[j], xh + 4 * j);
      } else {
        s0 = V::dot(s0, alo[j], V::sign8(V::bcast(xl + 4 * j), lo[j]));
        s1 = V::dot(s1, ahi[j], V::sign8(V::bcast(xh + 4 * j), hi[j]));
      }
#endif
    }
    I isum = V::addi(s0, s1);
    const int64_t o = (m0 + t) * dstride + b;
#if defined(EDGELLM_VNNI)
    if (BITS == 8) isum = V::subi(isum, V::set1i(xq.q8[o] * 16));  // 128 * sum(q)
#endif
    if (BITS == 4 && !ASYM) isum = V::subi(isum, V::set1i(xq.q8[o]));  // (code - 8) * q
    acc[t] = V::fmadd(V::cvt(isum), V::mul(dw, V::set1(xq.d[o])), acc[t]);
    if (ASYM) acc[t] = V::fmadd(mw, V::set1(xq.s[o]), acc[t]);
  }
}

// The full chunks' blocks of rows_tile, P lanes per sweep over the rows: as many accumulators as registers
// allow, since the fewer the sweeps, the closer to memory order the codes are read (at T <= 2, 8 lanes: in
// order; A/B at T = 2, matmuls of a fused int4 step: -5..-15% against P = 2). Lane j takes blocks j, j + 8, ...
// in turn whatever P is: the same float sequence.
template <class V, int BITS, bool ASYM, int T, int P>
EDGELLM_INLINE void sweep(const XQ& xq, int64_t m0, const uint8_t* codes, int64_t rb, const float* wsc, const float* wmn,
                          const GroupOf& gof, const uint8_t* pf, int64_t bf, typename V::F acc[][8]) {
  using F = typename V::F;
  constexpr int64_t bpb = V::R * BITS * 4;
  for (int j0 = 0; j0 < 8; j0 += P) {
    F part[T][P];
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < P; ++j) part[t][j] = V::fzero();
    for (int64_t b0 = 0; b0 < bf; b0 += 8) {
      if (pf)
        for (int64_t o = 0; o < P * bpb; o += 64) prefetch(pf + (b0 + j0) * bpb + o);
      for (int j = 0; j < P; ++j) {
        F cur[T];
        for (int t = 0; t < T; ++t) cur[t] = part[t][j];
        rows_block<V, BITS, ASYM, T>(xq, m0, b0 + j0 + j, codes, rb, wsc, wmn, gof, cur);
        for (int t = 0; t < T; ++t) part[t][j] = cur[t];
      }
    }
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < P; ++j) acc[t][j0 + j] = part[t][j];
  }
}

// The 4 partial integer sums of block b (partial l: codes 4l..4l+3 and 16+4l..16+4l+3, the one-row kernel's
// lane split) of rows n0..n0+R-1 against activation rows m0..m0+T-1: the blocks after the last full chunk,
// which the one-row kernel folds into its float sums part by part.
template <class V, int BITS, int T>
EDGELLM_INLINE void rows_parts(const XQ& xq, int64_t m0, int64_t b, const uint8_t* codes, int64_t rb,
                               typename V::I part[][4]) {
  const int64_t xstride = xq.nc * 256;
  typename V::I lo[4], hi[4];
  rows_codes<V, BITS>(codes, b, rb, lo, hi);
  const int8_t* x0 = xq.qrow(m0);
  const int64_t off0 = xq_off(b, 0), off1 = xq_off(b, 1);
  for (int t = 0; t < T; ++t) {
    const int8_t* xl = x0 + t * xstride + off0;
    const int8_t* xh = x0 + t * xstride + off1;
    for (int j = 0; j < 4; ++j) {
      if (BITS == 4) {
        part[t][j] = V::dot_bcast(V::dot_bcast(V::izero(), lo[j], xl + 4 * j), hi[j], xh + 4 * j);
      } else {  // |w| against x with w's sign: exact, no offset to take off
        part[t][j] = V::dot(V::dot(V::izero(), V::abs8(lo[j]), V::sign8(V::bcast(xl + 4 * j), lo[j])),
                            V::abs8(hi[j]), V::sign8(V::bcast(xh + 4 * j), hi[j]));
      }
    }
  }
}

// Rows n0..n0+R-1 (codes at `codes`, row stride rb bytes) against activation rows m0..m0+T-1, by exactly the
// float operations of the one-row kernel (qdot_row) for each (row, token), so that a row's result does not
// depend on the kernel nor on the number of tokens: its accumulator lane j is kept here as acc[j] (the full
// chunks' blocks b = j mod 8, in increasing order: sweep()),
// then the blocks after the last full chunk go in as qdot_row's pair loop and last block put them (partial
// sums into lanes 0-3 / 4-7 and the tail, offsets in the tail or `rest`), and the sum is hsum_tail's.
// pf: memory to prefetch over the blocks (or null).
template <class V, int BITS, bool ASYM, int T>
static inline void rows_tile(const XQ& xq, int64_t m0, const uint8_t* codes, int64_t rb, const float* wsc,
                             const float* wmn, const GroupOf& gof, float* out, int64_t ldo, const uint8_t* pf) {
  using F = typename V::F;
  using I = typename V::I;
  constexpr int64_t R = V::R;
  const int64_t nb = xq.nb, bf = xq.nfull * 8, dstride = xq.nc * 8;
  constexpr int64_t bpb = R * BITS * 4;  // bytes of one block of the R rows
  F acc[T][8], tail[T][4], rest[T];
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < 4; ++j) tail[t][j] = V::fzero();
    rest[t] = V::fzero();
  }
  sweep<V, BITS, ASYM, T, (T <= 2 ? 8 : (T <= 4 ? 4 : 2))>(xq, m0, codes, rb, wsc, wmn, gof, pf, bf, acc);
  I part[T][4];
  int64_t b = bf;
  for (; b + 2 <= nb; b += 2) {  // qdot_row's pair loop: block b into lanes 0-3, block b + 1 into lanes 4-7
    for (int h = 0; h < 2; ++h) {
      if (pf)
        for (int64_t o = 0; o < bpb; o += 64) prefetch(pf + (b + h) * bpb + o);
      rows_parts<V, BITS, T>(xq, m0, b + h, codes, rb, part);
      const F dw = V::load(wsc + gof(b + h) * R);
      for (int t = 0; t < T; ++t) {
        const int64_t o = (m0 + t) * dstride + b + h;
        const F c = V::mul(dw, V::set1(xq.d[o]));
        for (int j = 0; j < 4; ++j) acc[t][4 * h + j] = V::fmadd(V::cvt(part[t][j]), c, acc[t][4 * h + j]);
        if (BITS == 4) {
          if (ASYM)
            tail[t][h] = V::fmadd(V::load(wmn + gof(b + h) * R), V::set1(xq.s[o]), tail[t][h]);
          else
            tail[t][h] = V::fnmadd(c, V::set1((float)xq.q8[o]), tail[t][h]);
        }
      }
    }
  }
  if (b < nb) {  // qdot_row's last block: partial sums into the tail, the offset into `rest`
    if (pf)
      for (int64_t o = 0; o < bpb; o += 64) prefetch(pf + b * bpb + o);
    rows_parts<V, BITS, T>(xq, m0, b, codes, rb, part);
    const F dw = V::load(wsc + gof(b) * R);
    for (int t = 0; t < T; ++t) {
      const int64_t o = (m0 + t) * dstride + b;
      const F c = V::mul(dw, V::set1(xq.d[o]));
      if (BITS == 4)
        rest[t] = ASYM ? V::mul(V::load(wmn + gof(b) * R), V::set1(xq.s[o]))
                       : V::mul(V::neg(c), V::set1((float)xq.q8[o]));  // (-c0) * q8
      for (int j = 0; j < 4; ++j) tail[t][j] = V::fmadd(V::cvt(part[t][j]), c, tail[t][j]);
    }
  }
  for (int t = 0; t < T; ++t) {  // hsum_tail: ((a0 + a4) + t0 + (a2 + a6) + t2) + ((a1 + a5) + t1 + (a3 + a7) + t3)
    F s4[4];
    for (int j = 0; j < 4; ++j) s4[j] = V::add(V::add(acc[t][j], acc[t][j + 4]), tail[t][j]);
    const F sum = V::add(V::add(s4[0], s4[2]), V::add(s4[1], s4[3]));
    V::storeu(out + (m0 + t) * ldo, V::add(sum, rest[t]));
  }
}

template <class V, int BITS, bool ASYM>
static void rows_group(const XQ& xq, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* scales,
                       const uint16_t* mins, int64_t N, int64_t G, float* out, int64_t n0, float* wbuf) {
  constexpr int64_t R = V::R;
  const int64_t ng = K / G, rb = BITS == 4 ? K / 2 : K;
  const GroupOf gof(G);
  const uint8_t* c = codes + n0 * rb;
  // the next groups' codes stream in while this one computes (rows n0.. are contiguous: R * rb bytes)
  const int64_t ahead = std::max<int64_t>(1, (2 * PREFETCH_BYTES + R * rb - 1) / (R * rb)) * R * rb;
  const int64_t sahead = ahead / rb * ng;  // the same rows' scales (and mins): R * ng contiguous fp16
  for (int64_t o = 0; o < R * ng; o += 32) {
    prefetch(scales + n0 * ng + sahead + o);
    if (ASYM) prefetch(mins + n0 * ng + sahead + o);
  }
  float* wsc = wbuf;
  float* wmn = wbuf + ng * R;
  V::transpose_scales(scales + n0 * ng, ng, wsc);
  if (ASYM) V::transpose_scales(mins + n0 * ng, ng, wmn);
  // tiles of at most ROWS8_TILE tokens, as even as possible (5 = 3 + 2, not 4 + 1: a 1-token tile pays a
  // whole transpose per block for one token)
  const int64_t tiles = (M + ROWS8_TILE - 1) / ROWS8_TILE;
  const uint8_t* pf = c + ahead;  // swept a few lines per block by the first tile
  for (int64_t i = 0, m = 0; i < tiles; ++i, pf = nullptr) {
    const int64_t size = M / tiles + (i < M % tiles ? 1 : 0);
    switch (size) {
#if ROWS8_TILE > 4
      case 8: rows_tile<V, BITS, ASYM, 8>(xq, m, c, rb, wsc, wmn, gof, out + n0, N, pf); break;
      case 7: rows_tile<V, BITS, ASYM, 7>(xq, m, c, rb, wsc, wmn, gof, out + n0, N, pf); break;
      case 6: rows_tile<V, BITS, ASYM, 6>(xq, m, c, rb, wsc, wmn, gof, out + n0, N, pf); break;
      case 5: rows_tile<V, BITS, ASYM, 5>(xq, m, c, rb, wsc, wmn, gof, out + n0, N, pf); break;
#endif
      case 4: rows_tile<V, BITS, ASYM, 4>(xq, m, c, rb, wsc, wmn, gof, out + n0, N, pf); break;
      case 3: rows_tile<V, BITS, ASYM, 3>(xq, m, c, rb, wsc, wmn, gof, out + n0, N, pf); break;
      case 2: rows_tile<V, BITS, ASYM, 2>(xq, m, c, rb, wsc, wmn, gof, out + n0, N, pf); break;
      default: rows_tile<V, BITS, ASYM, 1>(xq, m, c, rb, wsc, wmn, gof, out + n0, N, pf); break;
    }
    m += size;
  }
}

template <class V, int BITS>
static void rows_group_any(const XQ& xq, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* scales,
                           const uint16_t* mins, int64_t N, int64_t G, float* out, int64_t n0, float* wbuf) {
  if (BITS == 8) rows_group<V, 8, false>(xq, M, K, codes, scales, nullptr, N, G, out, n0, wbuf);
  else if (mins) rows_group<V, 4, true>(xq, M, K, codes, scales, mins, N, G, out, n0, wbuf);
  else rows_group<V, 4, false>(xq, M, K, codes, scales, nullptr, N, G, out, n0, wbuf);
}

// Rows [n0, n1) of out[m, n] = W[n] . x[m] for all M activation rows: each weight row is read from memory once
// and used by every activation row (tiles of 4 from registers, further tiles from L1).
template <int BITS, bool ASYM, int GS>
static void qdot_range(const XQ& xq, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* scales,
                       const uint16_t* mins, int64_t N, int64_t G, float* out, int64_t n0, int64_t n1) {
  const int64_t ng = K / G, rb = BITS == 4 ? K / 2 : K;
  const GroupOf gof(G);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* crow = codes + n * rb;
    const uint16_t* srow = scales + n * ng;
    const uint16_t* mrow = ASYM ? mins + n * ng : nullptr;
    prefetch_row(crow, rb, srow, mrow, ng);
    if (M == 1) {
      qdot_row<BITS, ASYM, GS, 1>(xq, 0, crow, srow, mrow, G, gof, out + n, N);
      continue;
    }
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) qdot_row<BITS, ASYM, GS, 4>(xq, m, crow, srow, mrow, G, gof, out + n, N);
    switch (M - m) {
      case 3: qdot_row<BITS, ASYM, GS, 3>(xq, m, crow, srow, mrow, G, gof, out + n, N); break;
      case 2: qdot_row<BITS, ASYM, GS, 2>(xq, m, crow, srow, mrow, G, gof, out + n, N); break;
      case 1: qdot_row<BITS, ASYM, GS, 1>(xq, m, crow, srow, mrow, G, gof, out + n, N); break;
      default: break;
    }
  }
}

template <int BITS>
static void qdot(const XQ& xq, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* scales,
                 const uint16_t* mins, int64_t N, int64_t G, float* out, int64_t n0, int64_t n1) {
  if (BITS == 8) {
    if (G == 32) qdot_range<8, false, 32>(xq, M, K, codes, scales, nullptr, N, G, out, n0, n1);
    else qdot_range<8, false, 0>(xq, M, K, codes, scales, nullptr, N, G, out, n0, n1);
  } else if (mins) {
    if (G == 32) qdot_range<4, true, 32>(xq, M, K, codes, scales, mins, N, G, out, n0, n1);
    else qdot_range<4, true, 0>(xq, M, K, codes, scales, mins, N, G, out, n0, n1);
  } else {
    if (G == 32) qdot_range<4, false, 32>(xq, M, K, codes, scales, nullptr, N, G, out, n0, n1);
    else qdot_range<4, false, 0>(xq, M, K, codes, scales, nullptr, N, G, out, n0, n1);
  }
}

// A/B switches for benchmarks (set_kernel_tuning, from kernels/matmul.py's KernelTuning; the bits are the same
// either way, only the speed differs): rows16 = false keeps the 8-row kernel on AVX-512 VNNI builds;
// rows8_min_tokens = from how many tokens a call takes weight rows 8 at a time (AVX2 builds).
static std::atomic<bool> g_rows16{true};
static std::atomic<int64_t> g_rows8_min_tokens{2};

void set_kernel_tuning(bool rows16, int64_t rows8_min_tokens) {
  g_rows16.store(rows16);
  g_rows8_min_tokens.store(std::max<int64_t>(1, rows8_min_tokens));
}

#if defined(EDGELLM_VNNI)
static bool rows16_enabled() { return g_rows16.load(std::memory_order_relaxed); }
#endif

// Groups [g0, g1) of 8 rows (the last one may be partial: its rows go through the one-row kernel); two full
// groups side by side go through the 16-row kernel where there is one.
template <int BITS>
static void qdot_groups(const XQ& xq, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* scales,
                        const uint16_t* mins, int64_t N, int64_t G, float* out, int64_t g0, int64_t g1) {
  const int64_t full = N / ROWS8;
  float* wbuf = scale_scratch(static_cast<size_t>(2 * (K / G) * 2 * ROWS8));
  for (int64_t g = g0; g < g1;) {
    if (g >= full) {
      qdot<BITS>(xq, M, K, codes, scales, mins, N, G, out, full * ROWS8, N);
      break;
    }
#if defined(EDGELLM_VNNI)
    if (g + 1 < std::min(g1, full) && rows16_enabled()) {
      rows_group_any<V16, BITS>(xq, M, K, codes, scales, mins, N, G, out, g * ROWS8, wbuf);
      g += 2;
      continue;
    }
#endif
    rows_group_any<V8, BITS>(xq, M, K, codes, scales, mins, N, G, out, g * ROWS8, wbuf);
    ++g;
  }
}

// ---- int4, approach (b): dequantize a block to 4x8 fp32 in registers, FMA with fp32 x.
template <int T>
static void q4_rows_fma(const float* x, int64_t K, int64_t m0, const uint8_t* crow, const uint16_t* srow,
                        const uint16_t* mrow, int64_t G, float* out, int64_t ldo) {
  const int64_t ng = K / G, bpg = G / QK;
  const __m128i m4 = _mm_set1_epi8(0x0F);
  __m256 acc[T][2];
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    const float dws = _cvtsh_ss(srow[g]);
    const __m256 dw = _mm256_set1_ps(dws);
    const __m256 mw = _mm256_set1_ps(mrow ? _cvtsh_ss(mrow[g]) : -8.0f * dws);
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      const __m128i v = _mm_loadu_si128((const __m128i*)(crow + b * 16));
      const __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
      const __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), dw, mw);
      const __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), dw, mw);
      const __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dw, mw);
      const __m256 w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), dw, mw);
      for (int t = 0; t < T; ++t) {
        const float* xp = x + (m0 + t) * K + b * QK;
        acc[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xp), acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp + 8), acc[t][1]);
        acc[t][0] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xp + 16), acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xp + 24), acc[t][1]);
      }
    }
  }
  for (int t = 0; t < T; ++t) out[(m0 + t) * ldo] = hsum_ps(_mm256_add_ps(acc[t][0], acc[t][1]));
}

// ---- int8, approach (b).
template <int T>
static void q8_rows_fma(const float* x, int64_t K, int64_t m0, const int8_t* crow, const uint16_t* srow,
                        int64_t G, float* out, int64_t ldo) {
  const int64_t ng = K / G, bpg = G / QK;
  __m256 acc[T][2];
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    const __m256 dw = _mm256_set1_ps(_cvtsh_ss(srow[g]));
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      const int8_t* cp = crow + b * QK;
      __m256 w[4];
      for (int k = 0; k < 4; ++k)
        w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(cp + 8 * k)))), dw);
      for (int t = 0; t < T; ++t) {
        const float* xp = x + (m0 + t) * K + b * QK;
        acc[t][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xp), acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xp + 8), acc[t][1]);
        acc[t][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xp + 16), acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xp + 24), acc[t][1]);
      }
    }
  }
  for (int t = 0; t < T; ++t) out[(m0 + t) * ldo] = hsum_ps(_mm256_add_ps(acc[t][0], acc[t][1]));
}
#endif  // EDGELLM_AVX2

#ifdef EDGELLM_NEON
// =================================================================================================== NEON
static inline float h2f(const uint16_t* p) {
  return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vld1_dup_u16(p))), 0);
}

static inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, a, b);
#else
  // int16 products of int8 x int8 (|.| <= 128*127); two summed per lane still fit int16.
  int16x8_t p = vmull_s8(vget_low_s8(a), vget_low_s8(b));
  p = vmlal_s8(p, vget_high_s8(a), vget_high_s8(b));
  return vpadalq_s16(acc, p);
#endif
}

template <int T, bool ASYM>
static void q4_rows_dot(const XQ& xq, int64_t m0, const uint8_t* crow, const uint16_t* srow,
                        const uint16_t* mrow, int64_t /*G*/, const GroupOf& gof, float* out, int64_t ldo) {
  const int64_t nb = xq.nb;
  const uint8x16_t m4 = vdupq_n_u8(0x0F);
  float32x4_t acc[T];
  float off[T];
  for (int t = 0; t < T; ++t) { acc[t] = vdupq_n_f32(0.0f); off[t] = 0.0f; }
  for (int64_t b = 0; b < nb; ++b) {
    const float dw = h2f(srow + gof(b));
    const float mw = ASYM ? h2f(mrow + gof(b)) : 0.0f;
    const uint8x16_t v = vld1q_u8(crow + b * 16);
    const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(v, m4));
    const int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
    for (int t = 0; t < T; ++t) {
      const int8_t* xp = xq.qrow(m0 + t) + b * 32;
      const int64_t o = (m0 + t) * xq.nc * 8 + b;
      int32x4_t p = dot16(vdupq_n_s32(0), lo, vld1q_s8(xp));
      p = dot16(p, hi, vld1q_s8(xp + 16));
      const float sc = dw * xq.d[o];
      acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(p), sc);
      off[t] += ASYM ? mw * xq.s[o] : -sc * (float)xq.q8[o];
    }
  }
  for (int t = 0; t < T; ++t) out[(m0 + t) * ldo] = vaddvq_f32(acc[t]) + off[t];
}

template <int T>
static void q8_rows_dot(const XQ& xq, int64_t m0, const int8_t* crow, const uint16_t* srow, int64_t /*G*/,
                        const GroupOf& gof, float* out, int64_t ldo) {
  const int64_t nb = xq.nb;
  float32x4_t acc[T];
  for (int t = 0; t < T; ++t) acc[t] = vdupq_n_f32(0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    const float dw = h2f(srow + gof(b));
    const int8x16_t w0 = vld1q_s8(crow + b * 32), w1 = vld1q_s8(crow + b * 32 + 16);
    for (int t = 0; t < T; ++t) {
      const int8_t* xp = xq.qrow(m0 + t) + b * 32;
      int32x4_t p = dot16(vdupq_n_s32(0), w0, vld1q_s8(xp));
      p = dot16(p, w1, vld1q_s8(xp + 16));
      acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(p), dw * xq.d[(m0 + t) * xq.nc * 8 + b]);
    }
  }
  for (int t = 0; t < T; ++t) out[(m0 + t) * ldo] = vaddvq_f32(acc[t]);
}
#endif  // EDGELLM_NEON

// =================================================================================================== portable
// Dequantize a block to fp32 once, then one dot per activation row (approach b; also the path for shapes the
// vector kernels do not take: K or G not a multiple of 32).
static void q4_rows_scalar(const float* x, int64_t M, int64_t K, const uint8_t* crow, const uint16_t* srow,
                           const uint16_t* mrow, int64_t G, float* out, int64_t ldo) {
  float w[QK];
  float acc[16];
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t mt = std::min<int64_t>(16, M - m0);
    for (int64_t m = 0; m < mt; ++m) acc[m] = 0.0f;
    for (int64_t g = 0; g < K / G; ++g) {
      const float d = half_to_float(srow[g]);
      const float mn = mrow ? half_to_float(mrow[g]) : -8.0f * d;
      for (int64_t b = g * (G / QK); b < (g + 1) * (G / QK); ++b) {
        for (int j = 0; j < 16; ++j) {
          const uint8_t byte = crow[b * 16 + j];
          w[j] = (float)(byte & 0x0F) * d + mn;
          w[j + 16] = (float)(byte >> 4) * d + mn;
        }
        for (int64_t m = 0; m < mt; ++m) {
          const float* xp = x + (m0 + m) * K + b * QK;
          float s = 0.0f;
          for (int j = 0; j < QK; ++j) s += w[j] * xp[j];
          acc[m] += s;
        }
      }
    }
    for (int64_t m = 0; m < mt; ++m) out[(m0 + m) * ldo] = acc[m];
  }
}

static void q8_rows_scalar(const float* x, int64_t M, int64_t K, const int8_t* crow, const uint16_t* srow,
                           int64_t G, float* out, int64_t ldo) {
  // Any G dividing K, including per channel with K % 32 != 0.
  float w[QK];
  float acc[16];
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t mt = std::min<int64_t>(16, M - m0);
    for (int64_t m = 0; m < mt; ++m) acc[m] = 0.0f;
    for (int64_t g = 0; g < K / G; ++g) {
      const float d = half_to_float(srow[g]);
      for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += QK) {
        const int64_t len = std::min<int64_t>(QK, (g + 1) * G - k0);
        for (int64_t j = 0; j < len; ++j) w[j] = (float)crow[k0 + j] * d;
        for (int64_t m = 0; m < mt; ++m) {
          const float* xp = x + (m0 + m) * K + k0;
          float s = 0.0f;
          for (int64_t j = 0; j < len; ++j) s += w[j] * xp[j];
          acc[m] += s;
        }
      }
    }
    for (int64_t m = 0; m < mt; ++m) out[(m0 + m) * ldo] = acc[m];
  }
}

// Portable approach (a): the int-dot arithmetic in plain C++, compiled on every target (it is the int-dot path
// where there is no SIMD one, and variant 4 everywhere, so tests exercise it on any machine).  Reads the
// activation layout through xq_off / xq_pos, so it agrees with whichever layout this build uses.
static void q4_rows_dot_portable(const XQ& xq, int64_t m0, int64_t T, const uint8_t* crow, const uint16_t* srow,
                                 const uint16_t* mrow, const GroupOf& gof, float* out, int64_t ldo) {
  for (int64_t t = 0; t < T; ++t) {
    const int8_t* q = xq.qrow(m0 + t);
    float acc = 0.0f;
    for (int64_t b = 0; b < xq.nb; ++b) {
      const int8_t* qlo = q + xq_off(b, 0);
      const int8_t* qhi = q + xq_off(b, 1);
      int32_t s = 0;
      for (int j = 0; j < 16; ++j) {
        const uint8_t byte = crow[b * 16 + j];
        s += (int32_t)(byte & 0x0F) * qlo[j] + (int32_t)(byte >> 4) * qhi[j];
      }
      const int64_t o = (m0 + t) * xq.nc * 8 + xq_pos(b, xq.nfull);
      const float sc = xq.d[o] * half_to_float(srow[gof(b)]);
      acc += mrow ? (float)s * sc + half_to_float(mrow[gof(b)]) * xq.s[o] : (float)(s - xq.q8[o]) * sc;
    }
    out[(m0 + t) * ldo] = acc;
  }
}

static void q8_rows_dot_portable(const XQ& xq, int64_t m0, int64_t T, const int8_t* crow, const uint16_t* srow,
                                 const GroupOf& gof, float* out, int64_t ldo) {
  for (int64_t t = 0; t < T; ++t) {
    const int8_t* q = xq.qrow(m0 + t);
    float acc = 0.0f;
    for (int64_t b = 0; b < xq.nb; ++b) {
      const int8_t* qlo = q + xq_off(b, 0);
      const int8_t* qhi = q + xq_off(b, 1);
      int32_t s = 0;
      for (int j = 0; j < 16; ++j) s += (int32_t)crow[b * 32 + j] * qlo[j] + (int32_t)crow[b * 32 + 16 + j] * qhi[j];
      acc += (float)s * xq.d[(m0 + t) * xq.nc * 8 + xq_pos(b, xq.nfull)] * half_to_float(srow[gof(b)]);
    }
    out[(m0 + t) * ldo] = acc;
  }
}

#if !defined(EDGELLM_AVX2) && !defined(EDGELLM_NEON)
template <int T, bool ASYM>
static void q4_rows_dot(const XQ& xq, int64_t m0, const uint8_t* crow, const uint16_t* srow,
                        const uint16_t* mrow, int64_t /*G*/, const GroupOf& gof, float* out, int64_t ldo) {
  q4_rows_dot_portable(xq, m0, T, crow, srow, ASYM ? mrow : nullptr, gof, out, ldo);
}

template <int T>
static void q8_rows_dot(const XQ& xq, int64_t m0, const int8_t* crow, const uint16_t* srow, int64_t /*G*/,
                        const GroupOf& gof, float* out, int64_t ldo) {
  q8_rows_dot_portable(xq, m0, T, crow, srow, gof, out, ldo);
}
#endif

// =================================================================================================== drivers
// Activation rows per pass over a weight row: the unpacked weights are reused across TILE rows from
// registers; further tiles re-read the (L1-resident) packed row, never main memory.
static constexpr int TILE = 4;

static int64_t grain_for(int64_t K, int64_t M) {
  // Keep each thread's share above ~32K weights x rows: below that, waking threads costs more than it saves.
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, K * std::min<int64_t>(M, 4)));
}

enum Variant { AUTO = 0, INT_DOT = 1, FLOAT_FMA = 2, SCALAR = 3, INT_DOT_PORTABLE = 4, INT_DOT_RESIDUAL = 5 };

// INT_DOT_RESIDUAL: x [M, K] is its int8 blocks (exactly as quantize_x rounds them for the kernels) plus a
// residual r = x - d * q; r goes through the same int-dot kernel as M more rows (weights read once for all
// 2M rows), and out = W.x_int8 + W.r_int8. r's own blocks keep what the first rounding lost, so the
// activations are carried to ~2^-14 of each block's largest instead of 2^-8: the decode-path KL of the
// bundled int4 model drops from 0.0027 to the weights' own (benchmarks/results/quality.md), for the cost of
// a second row in the kernel (a decode step 1.3x as long on the bundled model at 2 threads, FLOAT_FMA 2.3x:
// benchmarks/results/activations-cpu.json).
template <class Gemm>
static void residual_gemm(const float* x, int64_t M, int64_t K, int64_t N, float* out, const Gemm& gemm) {
  thread_local std::vector<float> x2, o2;
  x2.resize((size_t)(2 * M * K));
  o2.resize((size_t)(2 * M * N));
  {
    const XQ xq = quantize_x(x, M, K);  // (its scratch is reused by the call below: done with it first)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < xq.nb; ++b) {
        const float d = xq.drow(m)[xq_pos(b, xq.nfull)];
        const int8_t* lo = xq.qrow(m) + xq_off(b, 0);
        const int8_t* hi = xq.qrow(m) + xq_off(b, 1);
        const float* xb = x + m * K + b * QK;
        float* r = x2.data() + (M + m) * K + b * QK;
        for (int i = 0; i < 16; ++i) {
          r[i] = xb[i] - d * (float)lo[i];
          r[i + 16] = xb[i + 16] - d * (float)hi[i];
        }
      }
  }
  std::memcpy(x2.data(), x, sizeof(float) * (size_t)(M * K));
  gemm(x2.data(), 2 * M, o2.data());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) out[m * N + n] = o2[m * N + n] + o2[(M + m) * N + n];
}

#ifdef EDGELLM_AVX2
// One token: the one-row kernel (memory-bound; the 8-row transpose would be pure overhead).  Several (a
// verification pass, a short prefill): groups of 8 rows, the transpose shared by up to 4 tokens.  Both give
// the same bits for a row (rows_tile), so the choice is free to follow speed.
static int64_t rows8_min_tokens() { return g_rows8_min_tokens.load(std::memory_order_relaxed); }

template <int BITS>
static void qdot_all(const XQ& xq, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* scales,
                     const uint16_t* mins, int64_t N, int64_t G, float* out) {
  if (M < rows8_min_tokens()) {
    edgellm_par::parallel_for(0, N, grain_for(K, M), [&](int64_t n0, int64_t n1) {
      qdot<BITS>(xq, M, K, codes, scales, mins, N, G, out, n0, n1);
    });
    return;
  }
  edgellm_par::parallel_for(0, (N + ROWS8 - 1) / ROWS8, (grain_for(K, M) + ROWS8 - 1) / ROWS8,
                            [&](int64_t g0, int64_t g1) { qdot_groups<BITS>(xq, M, K, codes, scales, mins, N, G, out, g0, g1); });
}
#endif

#ifndef EDGELLM_AVX2  // (the AVX2 build has qdot above)
template <bool ASYM>
static void q4_dot_range(const XQ& xq, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* scales,
                         const uint16_t* mins, int64_t N, int64_t G, float* out, int64_t n0, int64_t n1) {
  const int64_t ng = K / G;
  const GroupOf gof(G);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* crow = codes + n * (K / 2);
    const uint16_t* srow = scales + n * ng;
    const uint16_t* mrow = ASYM ? mins + n * ng : nullptr;
    prefetch_row(crow, K / 2, srow, mrow, ng);
    int64_t m = 0;
    for (; m + TILE <= M; m += TILE) q4_rows_dot<TILE, ASYM>(xq, m, crow, srow, mrow, G, gof, out + n, N);
    switch (M - m) {
      case 3: q4_rows_dot<3, ASYM>(xq, m, crow, srow, mrow, G, gof, out + n, N); break;
      case 2: q4_rows_dot<2, ASYM>(xq, m, crow, srow, mrow, G, gof, out + n, N); break;
      case 1: q4_rows_dot<1, ASYM>(xq, m, crow, srow, mrow, G, gof, out + n, N); break;
      default: break;
    }
  }
}
#endif

void q4_gemm(const float* x, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* scales,
             const uint16_t* mins, int64_t N, int64_t G, float* out, int variant) {
  if (M <= 0 || N <= 0) return;
  const int64_t ng = K / G;
  if (variant == AUTO) variant = INT_DOT;
#if !defined(EDGELLM_AVX2)
  if (variant == FLOAT_FMA) variant = SCALAR;
#endif
  if (K % QK != 0 || G % QK != 0) variant = SCALAR;
  if (variant == INT_DOT_RESIDUAL) {
    residual_gemm(x, M, K, N, out, [&](const float* x2, int64_t M2, float* o2) {
      q4_gemm(x2, M2, K, codes, scales, mins, N, G, o2, INT_DOT);
    });
    return;
  }
  if (variant == INT_DOT_PORTABLE) {
    const XQ xq = quantize_x(x, M, K);
    edgellm_par::parallel_for(0, N, grain_for(K, M), [&](int64_t n0, int64_t n1) {
      const GroupOf gof(G);
      for (int64_t n = n0; n < n1; ++n)
        q4_rows_dot_portable(xq, 0, M, codes + n * (K / 2), scales + n * ng, mins ? mins + n * ng : nullptr, gof,
                             out + n, N);
    });
    return;
  }
  if (variant == INT_DOT) {
    const XQ xq = quantize_x(x, M, K);
#ifdef EDGELLM_AVX2
    qdot_all<4>(xq, M, K, codes, scales, mins, N, G, out);
#else
    edgellm_par::parallel_for(0, N, grain_for(K, M), [&](int64_t n0, int64_t n1) {
      if (mins) q4_dot_range<true>(xq, M, K, codes, scales, mins, N, G, out, n0, n1);
      else q4_dot_range<false>(xq, M, K, codes, scales, mins, N, G, out, n0, n1);
    });
#endif
    return;
  }
#ifdef EDGELLM_AVX2
  if (variant == FLOAT_FMA) {
    edgellm_par::parallel_for(0, N, grain_for(K, M), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* crow = codes + n * (K / 2);
        const uint16_t* srow = scales + n * ng;
        const uint16_t* mrow = mins ? mins + n * ng : nullptr;
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) q4_rows_fma<2>(x, K, m, crow, srow, mrow, G, out + n, N);
        if (m < M) q4_rows_fma<1>(x, K, m, crow, srow, mrow, G, out + n, N);
      }
    });
    return;
  }
#endif
  edgellm_par::parallel_for(0, N, grain_for(K, M), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      q4_rows_scalar(x, M, K, codes + n * (K / 2), scales + n * ng, mins ? mins + n * ng : nullptr, G, out + n, N);
  });
}

void q8_gemm(const float* x, int64_t M, int64_t K, const int8_t* codes, const uint16_t* scales, int64_t N,
             int64_t G, float* out, int variant) {
  if (M <= 0 || N <= 0) return;
  const int64_t ng = K / G;
  if (variant == AUTO) variant = INT_DOT;
#if !defined(EDGELLM_AVX2)
  if (variant == FLOAT_FMA) variant = SCALAR;
#endif
  // The vector paths need 32-blocks that do not straddle groups.
  if (K % QK != 0 || G % QK != 0) variant = SCALAR;
  if (variant == INT_DOT_RESIDUAL) {
    residual_gemm(x, M, K, N, out, [&](const float* x2, int64_t M2, float* o2) {
      q8_gemm(x2, M2, K, codes, scales, N, G, o2, INT_DOT);
    });
    return;
  }
  if (variant == INT_DOT_PORTABLE) {
    const XQ xq = quantize_x(x, M, K);
    edgellm_par::parallel_for(0, N, grain_for(K, M), [&](int64_t n0, int64_t n1) {
      const GroupOf gof(G);
      for (int64_t n = n0; n < n1; ++n) q8_rows_dot_portable(xq, 0, M, codes + n * K, scales + n * ng, gof, out + n, N);
    });
    return;
  }
  if (variant == INT_DOT) {
    const XQ xq = quantize_x(x, M, K);
#ifdef EDGELLM_AVX2
    qdot_all<8>(xq, M, K, reinterpret_cast<const uint8_t*>(codes), scales, nullptr, N, G, out);
#else
    edgellm_par::parallel_for(0, N, grain_for(K, M), [&](int64_t n0, int64_t n1) {
      const GroupOf gof(G);
      for (int64_t n = n0; n < n1; ++n) {
        const int8_t* crow = codes + n * K;
        const uint16_t* srow = scales + n * ng;
        prefetch_row(crow, K, srow, nullptr, ng);
        int64_t m = 0;
        for (; m + TILE <= M; m += TILE) q8_rows_dot<TILE>(xq, m, crow, srow, G, gof, out + n, N);
        switch (M - m) {
          case 3: q8_rows_dot<3>(xq, m, crow, srow, G, gof, out + n, N); break;
          case 2: q8_rows_dot<2>(xq, m, crow, srow, G, gof, out + n, N); break;
          case 1: q8_rows_dot<1>(xq, m, crow, srow, G, gof, out + n, N); break;
          default: break;
        }
      }
    });
#endif
    return;
  }
#ifdef EDGELLM_AVX2
  if (variant == FLOAT_FMA) {
    edgellm_par::parallel_for(0, N, grain_for(K, M), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const int8_t* crow = codes + n * K;
        const uint16_t* srow = scales + n * ng;
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) q8_rows_fma<2>(x, K, m, crow, srow, G, out + n, N);
        if (m < M) q8_rows_fma<1>(x, K, m, crow, srow, G, out + n, N);
      }
    });
    return;
  }
#endif
  edgellm_par::parallel_for(0, N, grain_for(K, M), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) q8_rows_scalar(x, M, K, codes + n * K, scales + n * ng, G, out + n, N);
  });
}

// ---------------------------------------------------------------------------------------------- dequantize
// W [N, K] fp32 from the packed weights, rows split over threads: the prefill path (M > 16 tokens) runs the
// float GEMM on it.  Bit-identical to kernels/matmul.py's torch reference: (q - 8) * s (one rounding), or
// q * s + m with two roundings, never an FMA (an empty asm keeps the compiler from contracting them).
static inline float no_contract(float v) {
#if defined(__GNUC__) || defined(__clang__)
  __asm__("" : "+x"(v));
#endif
  return v;
}

#ifdef EDGELLM_AVX2
static inline __m256 no_contract8(__m256 v) {
#if defined(__GNUC__) || defined(__clang__)
  __asm__("" : "+x"(v));
#endif
  return v;
}
#endif

void dequant_int4(const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, int64_t N, int64_t K, int64_t G,
                  float* out) {
  const int64_t ng = K / G;
  edgellm_par::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* c = codes + n * (K / 2);
      const uint16_t* s = scales + n * ng;
      const uint16_t* mn = mins ? mins + n * ng : nullptr;
      float* o = out + n * K;
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* cb = c + b * 16;
        float* ob = o + b * 32;
#ifdef EDGELLM_AVX2
        const float d = _cvtsh_ss(s[b * 32 / G]);
        const float m = mn ? _cvtsh_ss(mn[b * 32 / G]) : 0.0f;
        const __m128i v = _mm_loadu_si128((const __m128i*)cb);
        const __m128i m4 = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
        const __m128i q[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m), eight = _mm256_set1_ps(8.0f);
        for (int j = 0; j < 4; ++j) {
          const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[j]));
          const __m256 w = mn ? _mm256_add_ps(no_contract8(_mm256_mul_ps(f, vd)), vm)
                              : _mm256_mul_ps(_mm256_sub_ps(f, eight), vd);
          _mm256_storeu_ps(ob + j * 8, w);
        }
#else
        const float d = half_to_float(s[b * 32 / G]);
        const float m = mn ? half_to_float(mn[b * 32 / G]) : 0.0f;
        for (int j = 0; j < 16; ++j) {
          const float q0 = (float)(cb[j] & 0x0F), q1 = (float)(cb[j] >> 4);
          ob[j] = mn ? no_contract(q0 * d) + m : (q0 - 8.0f) * d;
          ob[j + 16] = mn ? no_contract(q1 * d) + m : (q1 - 8.0f) * d;
        }
#endif
      }
    }
  });
}

void dequant_int8(const int8_t* codes, const uint16_t* scales, int64_t N, int64_t K, int64_t G, float* out) {
  const int64_t ng = K / G;
  edgellm_par::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* c = codes + n * K;
      const uint16_t* s = scales + n * ng;
      float* o = out + n * K;
      for (int64_t g = 0; g < ng; ++g) {
        int64_t k = g * G;
        const int64_t e = k + G;
#ifdef EDGELLM_AVX2
        const float d = _cvtsh_ss(s[g]);
        const __m256 vd = _mm256_set1_ps(d);
        for (; k + 8 <= e; k += 8)
          _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(c + k)))), vd));
#else
        const float d = half_to_float(s[g]);
#endif
        for (; k < e; ++k) o[k] = (float)c[k] * d;
      }
    }
  });
}

void parallel_run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
  edgellm_par::parallel_for(begin, end, grain, f);
}

int max_threads() {
#ifdef EDGELLM_STANDALONE
  return 1;
#else
  return at::get_num_threads();
#endif
}

const char* isa_name() {
#if defined(EDGELLM_VNNI)
  return "avx512vnni";
#elif defined(EDGELLM_AVX2) && defined(__AVXVNNI__)
  return "avx2vnni";  // (the GGUF kernels' integer dots take AVX-VNNI: cpu_gguf.cpp, dpbusd256.h)
#elif defined(EDGELLM_AVX2)
  return "avx2";
#elif defined(EDGELLM_NEON) && defined(__ARM_FEATURE_DOTPROD)
  return "neon-dotprod";
#elif defined(EDGELLM_NEON)
  return "neon";
#else
  return "scalar";
#endif
}

}  // namespace edgellm
