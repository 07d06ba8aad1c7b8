// Python bindings for cpu_kernels.cpp, twice:
//  - a pybind11 module (what cpu_ext.get_extension() returns): ~2.5 us per call from Python, against ~6 us
//    through the torch dispatcher; at ~120 matmuls per decoded token that difference is ~0.4 ms/token;
//  - torch ops torch.ops.edgellm_cpu.* (same functions), so torch.compile can call them (cpu_ext.py
//    registers their fake implementations).
// Kept apart from the kernels so ninja compiles the two files in parallel.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <optional>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cpu_decode.h"
#include "cpu_gguf.h"

namespace edgellm {
void q4_gemm(const float* x, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* scales,
             const uint16_t* mins, int64_t N, int64_t G, float* out, int variant);
void q8_gemm(const float* x, int64_t M, int64_t K, const int8_t* codes, const uint16_t* scales, int64_t N,
             int64_t G, float* out, int variant);
const char* isa_name();
void set_kernel_tuning(bool rows16, int64_t rows8_min_tokens);
void dequant_int4(const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, int64_t N, int64_t K, int64_t G,
                  float* out);
void dequant_int8(const int8_t* codes, const uint16_t* scales, int64_t N, int64_t K, int64_t G, float* out);
bool flash_causal_fast();
void gated_mlp(const float* gu, int64_t M, int64_t H, bool gelu, float* y);
void rms_norm(const float* x, const float* w, int64_t M, int64_t N, float eps, float* y);
void flash_causal(const float* q, const float* k, const float* v, int64_t kvs, float* out, float* lse, int64_t Hq,
                  int64_t Hkv, int64_t T, int64_t D, int64_t pos0, bool amx);
}  // namespace edgellm

namespace {

at::Tensor as_f32_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "edgellm int gemm: x must be 2-D [M, K], got ", x.sizes());
  TORCH_CHECK(x.device().is_cpu(), "edgellm int gemm: x must be on the CPU");
  return x.to(at::kFloat).contiguous();
}

void check_scales(const at::Tensor& s, int64_t N, int64_t K, int64_t G, const char* what) {
  TORCH_CHECK(G > 0 && K % G == 0, "edgellm int gemm: group_size ", G, " must divide K=", K);
  TORCH_CHECK(s.scalar_type() == at::kHalf, "edgellm int gemm: ", what, " must be float16, got ", s.scalar_type());
  TORCH_CHECK(s.dim() == 2 && s.size(0) == N && s.size(1) == K / G, "edgellm int gemm: ", what,
              " must be [", N, ", ", K / G, "], got ", s.sizes());
}

at::Tensor check_out(const std::optional<at::Tensor>& out, int64_t M, int64_t N, const at::Tensor& x) {
  if (!out.has_value()) return at::empty({M, N}, x.options());
  const at::Tensor& o = *out;
  TORCH_CHECK(o.scalar_type() == at::kFloat && o.is_contiguous() && o.device().is_cpu() && o.dim() == 2 &&
                  o.size(0) == M && o.size(1) == N,
              "edgellm int gemm: out must be a contiguous fp32 CPU tensor [", M, ", ", N, "], got ", o.sizes());
  return o;
}

at::Tensor int4_gemm_impl(const at::Tensor& x_, const at::Tensor& codes_, const at::Tensor& scales_,
                          const at::Tensor& mins_, int64_t group_size, int64_t variant,
                          const std::optional<at::Tensor>& out_) {
  const at::Tensor x = as_f32_rows(x_);
  TORCH_CHECK(codes_.scalar_type() == at::kByte && codes_.dim() == 2, "edgellm int4_gemm: codes must be uint8 [N, K/2]");
  const int64_t M = x.size(0), K = x.size(1), N = codes_.size(0);
  TORCH_CHECK(K % 32 == 0 && codes_.size(1) * 2 == K, "edgellm int4_gemm: codes ", codes_.sizes(),
              " do not match K=", K, " (K must be a multiple of 32)");
  TORCH_CHECK(group_size % 32 == 0, "edgellm int4_gemm: group_size must be a multiple of 32, got ", group_size);
  check_scales(scales_, N, K, group_size, "scales");
  const bool asym = mins_.numel() > 0;
  if (asym) check_scales(mins_, N, K, group_size, "mins");
  const at::Tensor codes = codes_.contiguous(), scales = scales_.contiguous();
  const at::Tensor mins = asym ? mins_.contiguous() : mins_;
  at::Tensor out = check_out(out_, M, N, x);
  edgellm::q4_gemm(x.data_ptr<float>(), M, K, codes.data_ptr<uint8_t>(),
                   reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                   asym ? reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()) : nullptr, N, group_size,
                   out.data_ptr<float>(), (int)variant);
  return out;
}

at::Tensor int8_gemm_impl(const at::Tensor& x_, const at::Tensor& codes_, const at::Tensor& scales_,
                          int64_t group_size, int64_t variant, const std::optional<at::Tensor>& out_) {
  const at::Tensor x = as_f32_rows(x_);
  TORCH_CHECK(codes_.scalar_type() == at::kChar && codes_.dim() == 2, "edgellm int8_gemm: codes must be int8 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes_.size(0);
  TORCH_CHECK(codes_.size(1) == K, "edgellm int8_gemm: codes ", codes_.sizes(), " do not match K=", K);
  check_scales(scales_, N, K, group_size, "scales");
  const at::Tensor codes = codes_.contiguous(), scales = scales_.contiguous();
  at::Tensor out = check_out(out_, M, N, x);
  edgellm::q8_gemm(x.data_ptr<float>(), M, K, codes.data_ptr<int8_t>(),
                   reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), N, group_size,
                   out.data_ptr<float>(), (int)variant);
  return out;
}

at::Tensor int4_gemm_variant(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const at::Tensor& mins, int64_t group_size, int64_t variant) {
  return int4_gemm_impl(x, codes, scales, mins, group_size, variant, std::nullopt);
}

at::Tensor int8_gemm_variant(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             int64_t group_size, int64_t variant) {
  return int8_gemm_impl(x, codes, scales, group_size, variant, std::nullopt);
}

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                     int64_t group_size) {
  return int4_gemm_impl(x, codes, scales, mins, group_size, 0, std::nullopt);
}

at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group_size) {
  return int8_gemm_impl(x, codes, scales, group_size, 0, std::nullopt);
}

// Write into a preallocated out (fp32 [M, N], contiguous): no allocation per decode step.
at::Tensor int4_gemm_out(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& mins, int64_t group_size, const at::Tensor& out) {
  return int4_gemm_impl(x, codes, scales, mins, group_size, 0, out);
}

at::Tensor int8_gemm_out(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group_size,
                         const at::Tensor& out) {
  return int8_gemm_impl(x, codes, scales, group_size, 0, out);
}

std::string isa() { return edgellm::isa_name(); }

// Dequantize into a caller's fp32 buffer (at least N*K elements; a reused one saves the page faults of a fresh
// multi-MB tensor per layer per prefill chunk); returns the [N, K] view of it.
at::Tensor dequant_out(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, int64_t group_size,
                       int64_t bits, const at::Tensor& buf) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.device().is_cpu(),
              "edgellm dequantize: codes must be a contiguous 2-D CPU tensor");
  const int64_t N = codes.size(0), K = bits == 4 ? codes.size(1) * 2 : codes.size(1);
  TORCH_CHECK(bits == 4 ? codes.scalar_type() == at::kByte && K % 32 == 0 && group_size % 32 == 0
                        : codes.scalar_type() == at::kChar,
              "edgellm dequantize: codes do not match bits=", bits, " / group ", group_size);
  check_scales(scales, N, K, group_size, "scales");
  TORCH_CHECK(scales.is_contiguous(), "edgellm dequantize: scales must be contiguous");
  const bool asym = mins.numel() > 0;
  if (asym) {
    TORCH_CHECK(bits == 4 && mins.is_contiguous(), "edgellm dequantize: mins are for int4 only");
    check_scales(mins, N, K, group_size, "mins");
  }
  TORCH_CHECK(buf.scalar_type() == at::kFloat && buf.is_contiguous() && buf.device().is_cpu() && buf.numel() >= N * K,
              "edgellm dequantize: buf must be a contiguous fp32 CPU tensor of at least ", N * K, " elements");
  float* out = buf.data_ptr<float>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  if (bits == 4)
    edgellm::dequant_int4(codes.data_ptr<uint8_t>(), s,
                          asym ? reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()) : nullptr, N, K,
                          group_size, out);
  else
    edgellm::dequant_int8(codes.data_ptr<int8_t>(), s, N, K, group_size, out);
  return buf.view({-1}).narrow(0, 0, N * K).view({N, K});
}

// ------------------------------------------------------------------------------------------------ GGUF
// A GGUF tensor's raw blocks (uint8, [N, row_bytes] or 1-D, typically memory-mapped through torch.frombuffer and
// so read-only): checked and used in place, never copied nor written.
namespace py = pybind11;

struct GgufPartView {
  int type = 0;
  int64_t N = 0;
  const uint8_t* data = nullptr;
  const int32_t* out_index = nullptr;
};

GgufPartView gguf_part(const py::handle& item, int64_t K, const char* what) {
  const py::tuple t = item.cast<py::tuple>();
  TORCH_CHECK(t.size() == 4, what, ": a GGUF part is (raw uint8 tensor, type, rows, out_index or None)");
  const at::Tensor raw = py::cast<at::Tensor>(t[0]);
  GgufPartView p;
  p.type = t[1].cast<int>();
  p.N = t[2].cast<int64_t>();
  TORCH_CHECK(edgellm::gguf_supported(p.type), what, ": GGML type ", p.type, " is not multiplied natively (types: 2, 3, 6, "
              "7, 8, 10, 11, 12, 13, 14)");
  const int64_t qv = edgellm::gguf_block_values(p.type);
  TORCH_CHECK(K > 0 && K % qv == 0, what, ": K=", K, " is not a multiple of the type's ", qv, "-value blocks");
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.is_contiguous() &&
                  (raw.dim() == 1 || raw.dim() == 2), what, ": raw blocks must be a contiguous uint8 CPU tensor, got ",
              raw.scalar_type(), " ", raw.sizes());
  TORCH_CHECK(!edgellm::gguf_is_x8(p.type) || p.N % 8 == 0, what, ": an x8 part holds a multiple of 8 rows, not ", p.N);
  const int64_t rb = edgellm::gguf_row_bytes(p.type, K);
  TORCH_CHECK(p.N >= 0 && raw.numel() == p.N * rb && (raw.dim() == 1 || raw.size(1) == rb), what, ": ", raw.numel(),
              " raw bytes ", raw.sizes(), " do not hold ", p.N, " rows of ", rb, " bytes (type ", p.type, ", K=", K, ")");
  p.data = raw.data_ptr<uint8_t>();
  if (!t[3].is_none()) {
    const at::Tensor idx = py::cast<at::Tensor>(t[3]);
    TORCH_CHECK(idx.device().is_cpu() && idx.scalar_type() == at::kInt && idx.is_contiguous() && idx.numel() == p.N,
                what, ": out_index must be a contiguous int32 CPU tensor of ", p.N, " entries, got ", idx.scalar_type(),
                " ", idx.sizes());
    p.out_index = idx.data_ptr<int32_t>();
  }
  return p;
}

// The parts' output columns: each of [0, N_total) exactly once (a part without out_index takes the next rows).
void check_gguf_columns(const std::vector<GgufPartView>& parts, int64_t N_total, const char* what) {
  std::vector<uint8_t> seen((size_t)std::max<int64_t>(N_total, 0), 0);
  int64_t offset = 0, rows = 0;
  for (const auto& p : parts) {
    for (int64_t n = 0; n < p.N; ++n) {
      const int64_t c = p.out_index ? p.out_index[n] : offset + n;
      TORCH_CHECK(c >= 0 && c < N_total && !seen[(size_t)c], what, ": output column ", c, " is out of [0, ", N_total,
                  ") or written twice");
      seen[(size_t)c] = 1;
    }
    offset += p.N;
    rows += p.N;
  }
  TORCH_CHECK(rows == N_total, what, ": the parts hold ", rows, " rows, expected ", N_total);
}

// x fp32 [M, K] @ (the parts' rows)^T -> fp32 [M, N_total]; x quantized once for all parts.  prompt: the int8 panel
// GEMM (gguf_gemm_prompt, equal to the row kernels to fp32 rounding) rather than the row kernels (gguf_gemm).
at::Tensor gguf_product(const at::Tensor& x_, const py::list& parts_, int64_t N_total, bool prompt) {
  const char* what = prompt ? "edgellm gguf_linear_prompt" : "edgellm gguf_linear";
  const at::Tensor x = as_f32_rows(x_);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0, what, ": K=", K, " must be a multiple of 32");
  std::vector<GgufPartView> parts;
  for (const py::handle& item : parts_) parts.push_back(gguf_part(item, K, what));
  check_gguf_columns(parts, N_total, what);
  at::Tensor out = at::empty({M, N_total}, x.options());
  float* y = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  {
    py::gil_scoped_release nogil;
    const edgellm::GgufActs acts = edgellm::gguf_quantize_acts(xp, M, K, /*paired=*/!prompt);
    int64_t offset = 0;
    for (const auto& p : parts) {
      float* yp = p.out_index ? y : y + offset;
      if (prompt) edgellm::gguf_gemm_prompt(acts, p.data, p.type, p.N, K, yp, N_total, p.out_index);
      else edgellm::gguf_gemm(acts, p.data, p.type, p.N, K, yp, N_total, p.out_index);
      offset += p.N;
    }
  }
  return out;
}

// bf16 rows [Mp, K] of x (Mp: M rounded up to 16, the rows past M zeros), as the AMX kernels take x.
at::Tensor amx_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), Mp = (M + 15) / 16 * 16;
  at::Tensor xb = at::empty({Mp, x.size(1)}, x.options().dtype(at::kBFloat16));
  xb.narrow(0, 0, M).copy_(x);  // torch's rounding to nearest even
  if (Mp > M) xb.narrow(0, M, Mp - M).zero_();
  return xb;
}

// The same product on AMX tiles in bf16 (gguf_gemm_amx): x rounded to bf16 once for all parts, as rows of a
// buffer whose row count is a multiple of 16.
at::Tensor gguf_linear_amx(const at::Tensor& x_, const py::list& parts_, int64_t N_total) {
  const char* what = "edgellm gguf_linear_amx";
  TORCH_CHECK(edgellm::gguf_amx_available(), what, ": no AMX here (", edgellm::isa_name(), " build; see gguf_amx_available)");
  TORCH_CHECK(x_.dim() == 2 && x_.device().is_cpu() && (x_.scalar_type() == at::kFloat || x_.scalar_type() == at::kBFloat16),
              what, ": x must be an fp32 or bf16 CPU tensor [M, K], got ", x_.scalar_type(), " ", x_.sizes());
  const int64_t M = x_.size(0), K = x_.size(1);
  TORCH_CHECK(K % 32 == 0, what, ": K=", K, " must be a multiple of 32");
  std::vector<GgufPartView> parts;
  for (const py::handle& item : parts_) parts.push_back(gguf_part(item, K, what));
  check_gguf_columns(parts, N_total, what);
  const at::Tensor xb = amx_rows(x_);
  at::Tensor out = at::empty({M, N_total}, x_.options().dtype(at::kFloat));
  float* y = out.data_ptr<float>();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  {
    py::gil_scoped_release nogil;
    int64_t offset = 0;
    for (const auto& p : parts) {
      edgellm::gguf_gemm_amx(xp, M, K, p.data, p.type, p.N, p.out_index ? y : y + offset, N_total, p.out_index);
      offset += p.N;
    }
  }
  return out;
}

at::Tensor gguf_linear(const at::Tensor& x, const py::list& parts, int64_t N_total) {
  return gguf_product(x, parts, N_total, false);
}

at::Tensor gguf_linear_prompt(const at::Tensor& x, const py::list& parts, int64_t N_total) {
  return gguf_product(x, parts, N_total, true);
}

// Causal attention of T rows at positions [pos0, pos0 + T) over keys [0, pos0 + T) (cpu_attention.cpp): q [Hq, T, D]
// already scaled, k and v [Hkv, pos0 + T, D], fp32 -> (out [Hq, T, D], log-sum-exp [Hq, T]).
std::tuple<at::Tensor, at::Tensor> flash_causal(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                                int64_t pos0, bool amx) {
  const char* what = "edgellm flash_causal";
  TORCH_CHECK(edgellm::flash_causal_fast(), what, ": not in this build (", edgellm::isa_name(), ")");
  TORCH_CHECK(!amx || edgellm::gguf_amx_available(), what, ": no AMX here (", edgellm::isa_name(), " build)");
  TORCH_CHECK(pos0 >= 0 && q_.dim() == 3 && k_.dim() == 3 && k_.sizes() == v_.sizes() && pos0 + q_.size(1) == k_.size(1) &&
                  q_.size(2) == k_.size(2) && k_.size(0) > 0 && q_.size(0) % k_.size(0) == 0,
              what, ": q must be [Hq, T, D] and k, v [Hkv, pos0 + T, D] with Hkv dividing Hq, got ", q_.sizes(), ", ",
              k_.sizes(), ", ", v_.sizes(), " for pos0 = ", pos0);
  for (const at::Tensor* t : {&q_, &k_, &v_})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), what, ": q, k, v must be fp32 CPU tensors");
  const int64_t Hq = q_.size(0), Hkv = k_.size(0), T = q_.size(1), D = q_.size(2);
  TORCH_CHECK(D % 16 == 0 && D <= 256, what, ": head dim ", D, " must be a multiple of 16, at most 256");
  // k and v as slices of a cache [Hkv, max_len, D] read in place: rows of D contiguous, one stride between heads
  const bool rows_dense = k_.stride(2) == 1 && k_.stride(1) == D && v_.stride(2) == 1 && v_.stride(1) == D &&
                          k_.stride(0) == v_.stride(0);
  const at::Tensor q = q_.contiguous(), k = rows_dense ? k_ : k_.contiguous(), v = rows_dense ? v_ : v_.contiguous();
  at::Tensor out = at::empty({Hq, T, D}, q.options()), lse = at::empty({Hq, T}, q.options());
  {
    py::gil_scoped_release nogil;
    edgellm::flash_causal(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), k.stride(0),
                          out.data_ptr<float>(), lse.data_ptr<float>(), Hq, Hkv, T, D, pos0, amx);
  }
  return {out, lse};
}

// act(gate) * up from the fused gate/up product gu [..., 2H] (cpu_pointwise.cpp) -> fp32 [..., H].
at::Tensor gated_mlp(const at::Tensor& gu_, bool gelu) {
  TORCH_CHECK(gu_.scalar_type() == at::kFloat && gu_.device().is_cpu() && gu_.dim() >= 1 && gu_.size(-1) % 2 == 0,
              "edgellm gated_mlp: gu must be an fp32 CPU tensor [..., 2H], got ", gu_.sizes());
  const at::Tensor gu = gu_.contiguous();
  const int64_t H = gu.size(-1) / 2, M = H ? gu.numel() / (2 * H) : 0;
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = H;
  at::Tensor y = at::empty(shape, gu.options());
  edgellm::gated_mlp(gu.data_ptr<float>(), M, H, gelu, y.data_ptr<float>());
  return y;
}

// x / sqrt(mean(x^2) + eps) * w over the last dim of x [..., N], w [N] (cpu_pointwise.cpp) -> fp32 [..., N].
at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& w_, double eps) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && w_.scalar_type() == at::kFloat && x_.device().is_cpu() &&
                  w_.device().is_cpu() && x_.dim() >= 1 && w_.dim() == 1 && w_.size(0) == x_.size(-1),
              "edgellm rms_norm: x must be fp32 [..., N] and w fp32 [N] on the CPU, got ", x_.sizes(), ", ", w_.sizes());
  const at::Tensor x = x_.contiguous(), w = w_.contiguous();
  const int64_t N = x.size(-1), M = N ? x.numel() / N : 0;
  at::Tensor y = at::empty(x.sizes(), x.options());
  edgellm::rms_norm(x.data_ptr<float>(), w.data_ptr<float>(), M, N, (float)eps, y.data_ptr<float>());
  return y;
}

// x fp32 [M, K] @ W^T for our int8 / int4 weights (quant/groups.py layout) through the prompt GEMM -> fp32 [M, N]:
// the prefill of QuantLinear (kernels/matmul.py), x rounded to int8 per 32 values as in the decode kernels.
at::Tensor quant_linear_prompt(const at::Tensor& x_, const at::Tensor& codes_, const at::Tensor& scales_,
                               const at::Tensor& mins_, int64_t group_size, int64_t bits, bool amx) {
  const char* what = "edgellm quant_linear_prompt";
  TORCH_CHECK(!amx || edgellm::gguf_amx_available(), what, ": no AMX here (", edgellm::isa_name(), " build)");
  const at::Tensor x = as_f32_rows(x_);
  const at::Tensor codes = codes_.contiguous(), scales = scales_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(bits == 4 || bits == 8, what, ": bits must be 4 or 8");
  TORCH_CHECK(codes.dim() == 2 && codes.device().is_cpu() && codes.size(1) == (bits == 8 ? K : K / 2) &&
                  codes.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              what, ": codes must be ", bits == 8 ? "int8 [N, K]" : "uint8 [N, K / 2]", " for K = ", K);
  TORCH_CHECK(K % 32 == 0 && group_size > 0 && group_size % 32 == 0 && K % group_size == 0, what,
              ": K = ", K, " and the group size ", group_size, " must be multiples of 32, K of the group size");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.numel() == N * (K / group_size), what,
              ": scales must be float16 [N, K / group]");
  at::Tensor mins;
  if (mins_.numel() > 0) {
    mins = mins_.contiguous();
    TORCH_CHECK(bits == 4 && mins.scalar_type() == at::kHalf && mins.numel() == scales.numel(), what,
                ": mins (int4 asymmetric only) must be float16 like the scales");
  }
  at::Tensor out = at::empty({M, N}, x.options());
  edgellm::QuantWeights w;
  w.codes = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  w.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  w.mins = mins.defined() ? reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()) : nullptr;
  w.bits = (int)bits;
  w.group = group_size;
  if (amx) {
    const at::Tensor xb = amx_rows(x);
    py::gil_scoped_release nogil;
    edgellm::quant_gemm_amx(reinterpret_cast<const uint16_t*>(xb.data_ptr()), M, K, w, N, out.data_ptr<float>(), N);
    return out;
  }
  {
    py::gil_scoped_release nogil;
    const edgellm::GgufActs acts = edgellm::gguf_quantize_acts(x.data_ptr<float>(), M, K, /*paired=*/false);
    edgellm::quant_gemm_prompt(acts, w, N, out.data_ptr<float>(), N);
  }
  return out;
}

at::Tensor gguf_dequantize(const at::Tensor& raw, int64_t type, int64_t N, int64_t K, const std::optional<at::Tensor>& out_) {
  const GgufPartView p = gguf_part(py::make_tuple(raw, type, N, py::none()), K, "edgellm gguf_dequantize");
  at::Tensor out;
  if (out_.has_value()) {
    out = *out_;
    TORCH_CHECK((out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) && out.is_contiguous() &&
                    out.device().is_cpu() && out.numel() == N * K,
                "edgellm gguf_dequantize: out must be a contiguous fp32 or bf16 CPU tensor of ", N, " x ", K, " elements");
    out = out.view({N, K});
  } else {
    out = at::empty({N, K}, at::TensorOptions().dtype(at::kFloat));
  }
  py::gil_scoped_release nogil;
  if (out.scalar_type() == at::kBFloat16)
    edgellm::gguf_dequantize_rows_bf16(p.data, p.type, N, K, reinterpret_cast<uint16_t*>(out.data_ptr()));
  else
    edgellm::gguf_dequantize_rows(p.data, p.type, N, K, out.data_ptr<float>());
  return out;
}

// A grid / ternary type's rows as the converters below take them: K a multiple of 256, raw a contiguous uint8 CPU
// tensor of N rows of that type; returns the bytes of a row.
int64_t check_grid_rows(const at::Tensor& raw, int64_t type, int64_t N, int64_t K, const char* what) {
  TORCH_CHECK(N >= 0 && K > 0 && K % 256 == 0, what, ": K=", K, " must be a multiple of 256");
  const int64_t rb = edgellm::gguf_grid_row_bytes((int)type, K);
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.numel() == N * rb,
              what, ": expected a contiguous uint8 CPU tensor of ", N * rb, " bytes, got ", raw.scalar_type(), " ",
              raw.sizes());
  return rb;
}

// A grid / ternary type's tables from the caller (gguf.quants'; edgellm/quant/gguf_grid.py passes them), checked:
// grid int8 [entries, width] (none for TQ1_0 / TQ2_0), ksigns uint8 [128] (IQ2_XXS, IQ2_XS, IQ3_XXS); an undefined
// tensor where the type needs none.
edgellm::GridTables grid_tables(int64_t type, const at::Tensor& grid, const at::Tensor& ksigns, const char* what) {
  const bool ternary = type == 34 || type == 35, signed_grid = type == 16 || type == 17 || type == 18;
  const int64_t entries = type == 22 ? 1024 : (type == 19 || type == 29) ? 2048 : (type == 17 || type == 21) ? 512 : 256;
  const int64_t width = (type == 18 || type == 21) ? 4 : 8;
  TORCH_CHECK(ternary || (grid.defined() && grid.device().is_cpu() && grid.scalar_type() == at::kChar &&
                          grid.is_contiguous() && grid.numel() == entries * width),
              what, ": type ", type, " needs its grid as int8 [", entries, ", ", width, "] (a contiguous CPU tensor)");
  TORCH_CHECK(!signed_grid || (ksigns.defined() && ksigns.device().is_cpu() && ksigns.scalar_type() == at::kByte &&
                               ksigns.is_contiguous() && ksigns.numel() == 128),
              what, ": type ", type, " needs the 128 sign bytes as a contiguous uint8 CPU tensor");
  edgellm::GridTables tables;
  if (!ternary) tables.grid = grid.data_ptr<int8_t>();
  if (signed_grid) tables.ksigns = ksigns.data_ptr<uint8_t>();
  return tables;
}

// The grid / ternary types without a kernel (cpu_gguf_grid.cpp): raw [N, row bytes] -> fp32 [N, K] (q8_0 false)
// or Q8_0 blocks uint8 [N, K / 32 x 34] (q8_0 true). grid, ksigns: as grid_tables takes them.
at::Tensor gguf_grid_convert(const at::Tensor& raw, int64_t type, int64_t N, int64_t K, const at::Tensor& grid,
                             const at::Tensor& ksigns, bool q8_0) {
  const char* what = "edgellm gguf_grid_convert";
  TORCH_CHECK(edgellm::gguf_grid_row_bytes((int)type, K) > 0, what, ": GGML type ", type, " with rows of ", K,
              " values is not one this converts (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0; "
              "K a multiple of 256)");
  check_grid_rows(raw, type, N, K, what);
  const edgellm::GridTables tables = grid_tables(type, grid, ksigns, what);
  at::Tensor out = q8_0 ? at::empty({N, K / 32 * 34}, raw.options()) : at::empty({N, K}, raw.options().dtype(at::kFloat));
  {
    py::gil_scoped_release nogil;
    edgellm::gguf_grid_rows(raw.data_ptr<uint8_t>(), (int)type, N, K, tables, q8_0 ? nullptr : out.data_ptr<float>(),
                            q8_0 ? out.data_ptr<uint8_t>() : nullptr);
  }
  return out;
}

// IQ2_XXS / IQ3_XXS / IQ3_S / IQ1_S rows -> the same values as GGUF_L4 blocks (type + 100; cpu_gguf.h), IQ2_XS /
// IQ2_S / IQ1_M rows as L4-per-16 blocks, or either straight in their x8 layout (x8: N % 8 == 0). grid, ksigns: IQ1_S's,
// IQ1_M's, IQ2_XS's, IQ2_S's tables as grid_tables takes them (none for the others, whose codebooks the build has).
py::object gguf_grid_l4(const at::Tensor& raw, int64_t type, int64_t N, int64_t K, bool x8,
                        const std::optional<at::Tensor>& grid, const std::optional<at::Tensor>& ksigns) {
  const char* what = "edgellm gguf_grid_to_l4";
  TORCH_CHECK(edgellm::gguf_l4_base((int)type), what, ": type ", type,
              " is not IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S or IQ1_M");
  check_grid_rows(raw, type, N, K, what);
  const bool tables_given = type == 19 || type == 17 || type == 22 || type == 29;
  const edgellm::GridTables tables = tables_given ? grid_tables(type, grid.value_or(at::Tensor()),
                                                                ksigns.value_or(at::Tensor()), what)
                                                  : edgellm::GridTables();
  const int l4 = (int)type + edgellm::GGUF_L4;
  TORCH_CHECK(!x8 || (N % 8 == 0 && edgellm::gguf_x8_supported(l4)), "edgellm gguf_grid_to_l4: the x8 layout needs "
              "a multiple of 8 rows (got ", N, ") and a build with x8 kernels");
  at::Tensor out = at::empty({N, edgellm::gguf_row_bytes(x8 ? l4 + edgellm::GGUF_X8 : l4, K)}, raw.options());
  bool done;
  {
    py::gil_scoped_release nogil;
    done = x8 ? edgellm::gguf_grid_to_l4_x8(raw.data_ptr<uint8_t>(), (int)type, N, K, tables, out.data_ptr<uint8_t>())
              : edgellm::gguf_grid_to_l4(raw.data_ptr<uint8_t>(), (int)type, N, K, tables, out.data_ptr<uint8_t>());
  }
  return done ? py::cast(out) : py::none();
}

// TQ1_0 / TQ2_0 rows [N, row bytes] -> Q2_K rows [N, K / 256 x 84] of the same values (cpu_gguf_grid.cpp).
at::Tensor gguf_ternary_q2_k(const at::Tensor& raw, int64_t type, int64_t N, int64_t K) {
  TORCH_CHECK(type == 34 || type == 35, "edgellm gguf_ternary_to_q2_k: type ", type, " is not TQ1_0 or TQ2_0");
  check_grid_rows(raw, type, N, K, "edgellm gguf_ternary_to_q2_k");
  at::Tensor out = at::empty({N, K / 256 * 84}, raw.options());
  {
    py::gil_scoped_release nogil;
    edgellm::gguf_ternary_to_q2_k(raw.data_ptr<uint8_t>(), (int)type, N * (K / 256), out.data_ptr<uint8_t>());
  }
  return out;
}

// IQ1_S / IQ1_M rows [N, row bytes] -> Q6_K rows [N, K / 256 x 210] of the same values (cpu_gguf_grid.cpp), or None
// where a block's d / 8 is not an fp16. grid: the type's, int8 [2048, 8] (gguf.quants').
py::object gguf_iq1_q6_k(const at::Tensor& raw, int64_t type, int64_t N, int64_t K, const at::Tensor& grid) {
  TORCH_CHECK(type == 19 || type == 29, "edgellm gguf_iq1_to_q6_k: type ", type, " is not IQ1_S or IQ1_M");
  check_grid_rows(raw, type, N, K, "edgellm gguf_iq1_to_q6_k");
  const edgellm::GridTables tables = grid_tables(type, grid, at::Tensor(), "edgellm gguf_iq1_to_q6_k");
  at::Tensor out = at::empty({N, K / 256 * 210}, raw.options());
  bool exact;
  {
    py::gil_scoped_release nogil;
    exact = edgellm::gguf_iq1_to_q6_k(raw.data_ptr<uint8_t>(), (int)type, N * (K / 256), tables,
                                      out.data_ptr<uint8_t>());
  }
  return exact ? py::cast(out) : py::none();
}

// x8: a K-quant's or Q5_0 / Q5_1's rows repacked 8 at a time (cpu_gguf_x8.cpp); raw [N, row bytes] -> x8 [N, x8 row bytes] and back.
at::Tensor gguf_x8_convert(const at::Tensor& src, int64_t type, int64_t N, int64_t K, bool to_x8) {
  TORCH_CHECK(edgellm::gguf_x8_supported((int)type), "edgellm gguf_repack: type ", type, " has no x8 kernels in this build");
  const int64_t qv = edgellm::gguf_block_values((int)type);
  TORCH_CHECK(N > 0 && N % 8 == 0 && K > 0 && K % qv == 0, "edgellm gguf_repack: N=", N, " must be a multiple of 8 "
              "and K=", K, " of ", qv);
  const int64_t rb = edgellm::gguf_row_bytes((int)type, K), xb = edgellm::gguf_row_bytes((int)type + edgellm::GGUF_X8, K);
  TORCH_CHECK(src.device().is_cpu() && src.scalar_type() == at::kByte && src.is_contiguous() &&
                  src.numel() == N * (to_x8 ? rb : xb), "edgellm gguf_repack: expected a contiguous uint8 CPU tensor of ",
              N * (to_x8 ? rb : xb), " bytes, got ", src.scalar_type(), " ", src.sizes());
  at::Tensor out = at::empty({N, to_x8 ? xb : rb}, src.options());
  {
    py::gil_scoped_release nogil;
    if (to_x8) edgellm::gguf_repack_x8(src.data_ptr<uint8_t>(), (int)type, N, K, out.data_ptr<uint8_t>());
    else edgellm::gguf_unrepack_x8(src.data_ptr<uint8_t>(), (int)type, N, K, out.data_ptr<uint8_t>());
  }
  return out;
}

// r8: a Q5_0 / Q5_1 tensor's rows with their runs of 8 blocks regrouped (cpu_gguf.cpp); raw [N, row bytes] -> the
// same shape in the other layout.
at::Tensor gguf_r8_convert(const at::Tensor& src, int64_t type, int64_t N, int64_t K, bool to_r8) {
  TORCH_CHECK(edgellm::gguf_r8_supported((int)type), "edgellm gguf_repack_r8: type ", type, " has no r8 kernels in this build");
  TORCH_CHECK(N >= 0 && K > 0 && K % 32 == 0, "edgellm gguf_repack_r8: K=", K, " must be a positive multiple of 32");
  const int64_t rb = edgellm::gguf_row_bytes((int)type, K);
  TORCH_CHECK(src.device().is_cpu() && src.scalar_type() == at::kByte && src.is_contiguous() && src.numel() == N * rb,
              "edgellm gguf_repack_r8: expected a contiguous uint8 CPU tensor of ", N * rb, " bytes, got ",
              src.scalar_type(), " ", src.sizes());
  at::Tensor out = at::empty({N, rb}, src.options());
  {
    py::gil_scoped_release nogil;
    edgellm::gguf_convert_r8(src.data_ptr<uint8_t>(), (int)type, N, K, out.data_ptr<uint8_t>(), to_r8);
  }
  return out;
}

// The type ids below `end` (GGML ids: 0..63) for which `has` says yes.
std::vector<int> gguf_types_where(bool (*has)(int), int end = 64) {
  std::vector<int> r;
  for (int t = 0; t < end; ++t)
    if (has(t)) r.push_back(t);
  return r;
}

// ------------------------------------------------------------------------------------------------ decode plan
// The fused decode step's plan: cpu_decode.py passes the model's tensors; the plan keeps a reference to each,
// so the raw pointers in edgellm::DecodeModel stay valid for its lifetime.

struct DecodePlan {
  edgellm::DecodeModel m;
  std::vector<at::Tensor> keep;
  int64_t n_layers = 0;

  const at::Tensor& hold(const at::Tensor& t, at::ScalarType dtype, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype, "edgellm decode plan: ", what,
                " must be a contiguous CPU ", dtype, " tensor, got ", t.scalar_type(), " ", t.sizes());
    keep.push_back(t);
    return keep.back();
  }
  const float* f32(const py::handle& o, int64_t numel, const char* what) {
    if (o.is_none()) return nullptr;
    const at::Tensor& t = hold(py::cast<at::Tensor>(o), at::kFloat, what);
    TORCH_CHECK(numel < 0 || t.numel() == numel, "edgellm decode plan: ", what, " has ", t.numel(),
                " elements, expected ", numel);
    return t.data_ptr<float>();
  }
  // (kind, group, weight-or-codes, scales, mins, bias); kind 0 = fp32 [N, K], 4 = int4, 8 = int8, 1 = GGUF parts
  // (weight-or-codes: the list of gguf_linear's part tuples; group, scales, mins unused)
  edgellm::DecodeLinear linear(const py::tuple& spec, int64_t N, int64_t K, const char* what) {
    TORCH_CHECK(spec.size() == 6, "edgellm decode plan: ", what, ": a linear spec has 6 fields");
    edgellm::DecodeLinear L;
    L.kind = spec[0].cast<int>();
    L.G = spec[1].cast<int64_t>();
    L.N = N;
    L.K = K;
    if (L.kind == edgellm::DecodeLinear::F32) {
      L.w = f32(spec[2], N * K, what);
      TORCH_CHECK(L.w, "edgellm decode plan: ", what, ": no weight");
    } else if (L.kind == edgellm::DecodeLinear::GGUF) {  // spec[2]: [(raw uint8, type, rows, out_index or None)]
      const std::string where = std::string("edgellm decode plan: ") + what;
      TORCH_CHECK(K % 32 == 0, where, ": K=", K, " must be a multiple of 32");
      std::vector<GgufPartView> views;
      for (const py::handle& item : spec[2].cast<py::list>()) {
        const py::tuple t = item.cast<py::tuple>();
        keep.push_back(py::cast<at::Tensor>(t[0]));
        if (!t[3].is_none()) keep.push_back(py::cast<at::Tensor>(t[3]));
        views.push_back(gguf_part(item, K, where.c_str()));
      }
      check_gguf_columns(views, N, where.c_str());
      for (const auto& v : views) {
        TORCH_CHECK(std::string(what) != "embedding" || !v.out_index, where, ": embedding parts take no out_index");
        L.parts.push_back({v.type, v.N, edgellm::gguf_row_bytes(v.type, K), v.data, v.out_index});
      }
    } else {
      TORCH_CHECK(L.kind == 4 || L.kind == 8, "edgellm decode plan: ", what, ": unknown kind ", L.kind);
      TORCH_CHECK(L.G > 0 && L.G % 32 == 0 && K % L.G == 0, "edgellm decode plan: ", what, ": group ", L.G,
                  " must be a multiple of 32 dividing K=", K);
      const at::Tensor& c = hold(py::cast<at::Tensor>(spec[2]), L.kind == 4 ? at::kByte : at::kChar, what);
      TORCH_CHECK(c.dim() == 2 && c.size(0) == N && c.size(1) == (L.kind == 4 ? K / 2 : K), "edgellm decode plan: ",
                  what, ": codes ", c.sizes(), " do not fit [", N, ", ", K, "]");
      L.codes = reinterpret_cast<const uint8_t*>(c.data_ptr());
      const at::Tensor& sc = hold(py::cast<at::Tensor>(spec[3]), at::kHalf, what);
      TORCH_CHECK(sc.numel() == N * (K / L.G), "edgellm decode plan: ", what, ": scales ", sc.sizes());
      L.scales = reinterpret_cast<const uint16_t*>(sc.data_ptr());
      if (!spec[4].is_none()) {
        TORCH_CHECK(L.kind == 4, "edgellm decode plan: ", what, ": mins are for int4 only");
        const at::Tensor& mn = hold(py::cast<at::Tensor>(spec[4]), at::kHalf, what);
        TORCH_CHECK(mn.numel() == N * (K / L.G), "edgellm decode plan: ", what, ": mins ", mn.sizes());
        L.mins = reinterpret_cast<const uint16_t*>(mn.data_ptr());
      }
    }
    L.bias = f32(spec[5], N, what);
    return L;
  }

  // One layer's K or V: an fp32 or fp16 tensor [Hkv, S, D], or (kind 8 | 4, group, codes, fp16 scales, fp16 mins or
  // None).
  edgellm::DecodeKV kv(const py::handle& o, const char* what) {
    const int64_t Hkv = m.n_kv_heads, S = m.max_seq_len, D = m.head_dim;
    edgellm::DecodeKV c;
    if (!py::isinstance<py::tuple>(o) && !o.is_none() && py::cast<at::Tensor>(o).scalar_type() == at::kHalf) {
      const at::Tensor& t = hold(py::cast<at::Tensor>(o), at::kHalf, what);
      TORCH_CHECK(t.numel() == Hkv * S * D, "edgellm decode plan: ", what, ": fp16 cache ", t.sizes());
      c.kind = edgellm::DecodeKV::F16;
      c.G = D;
      c.h = reinterpret_cast<uint16_t*>(t.data_ptr());
      return c;
    }
    if (!py::isinstance<py::tuple>(o)) {
      c.f = const_cast<float*>(f32(o, Hkv * S * D, what));
      TORCH_CHECK(c.f, "edgellm decode plan: ", what, ": no tensor");
      return c;
    }
    const py::tuple spec = o.cast<py::tuple>();
    TORCH_CHECK(spec.size() == 6, "edgellm decode plan: ", what, ": a quantized cache spec has 6 fields");
    c.kind = spec[0].cast<int>();
    c.G = spec[1].cast<int64_t>();
    TORCH_CHECK((c.kind == 8 || c.kind == 4) && c.G > 0 && D % c.G == 0, "edgellm decode plan: ", what,
                ": kind ", c.kind, " group ", c.G);
    const at::Tensor& codes = hold(py::cast<at::Tensor>(spec[2]), c.kind == 8 ? at::kChar : at::kByte, what);
    TORCH_CHECK(codes.numel() == Hkv * S * (c.kind == 8 ? D : D / 2), "edgellm decode plan: ", what, ": codes ",
                codes.sizes());
    c.codes = reinterpret_cast<uint8_t*>(codes.data_ptr());
    const at::Tensor& sc = hold(py::cast<at::Tensor>(spec[3]), at::kHalf, what);
    TORCH_CHECK(sc.numel() == Hkv * S * (D / c.G), "edgellm decode plan: ", what, ": scales ", sc.sizes());
    c.scales = reinterpret_cast<uint16_t*>(sc.data_ptr());
    TORCH_CHECK((c.kind == 4) == !spec[4].is_none(), "edgellm decode plan: ", what, ": mins go with int4 only");
    if (c.kind == 4) {
      const at::Tensor& mn = hold(py::cast<at::Tensor>(spec[4]), at::kHalf, what);
      TORCH_CHECK(mn.numel() == sc.numel(), "edgellm decode plan: ", what, ": mins ", mn.sizes());
      c.mins = reinterpret_cast<uint16_t*>(mn.data_ptr());
    }
    if (!spec[5].is_none()) {  // fp32 [Hkv, n_sink + 1, D], written as well as read
      const at::Tensor& sk = hold(py::cast<at::Tensor>(spec[5]), at::kFloat, what);
      TORCH_CHECK(sk.dim() == 3 && sk.size(0) == Hkv && sk.size(1) >= 1 && sk.size(2) == D && sk.is_contiguous() &&
                      sk.data_ptr() == py::cast<at::Tensor>(spec[5]).data_ptr(),
                  "edgellm decode plan: ", what, ": sink rows must be contiguous fp32 [Hkv, n + 1, D]");
      c.sink = sk.data_ptr<float>();
      c.n_sink = std::min<int64_t>(sk.size(1) - 1, S);
    }
    return c;
  }

  // dims: dim, n_heads, n_kv_heads, head_dim, hidden, vocab, max_seq_len; layers: (qkv, o, w13, w2, attn_norm,
  // ffn_norm, k cache, v cache) each; kv_rot: [D, D] fp32 for a quantized cache, else None; kv_center
  // [layers, 2, Hkv, D] and kv_key_scale [layers, Hkv, D]: its calibration (edgellm/kv_calibration.py), or None;
  // family: None (Llama's graph), or (rotary_dim, act, embed_scale, attn_softcap, final_softcap, rope_cos_local,
  // rope_sin_local, per-layer (q_norm, k_norm, post_attn_norm, post_ffn_norm, window, local_rope)) (see cpu_decode.h)
  DecodePlan(const std::vector<int64_t>& dims, double eps, double attn_scale, const py::tuple& embedding,
             const py::list& layers, const py::handle& norm, const py::tuple& output, const py::handle& rope_cos,
             const py::handle& rope_sin, const py::handle& kv_rot, const py::handle& kv_center,
             const py::handle& kv_key_scale, const py::handle& family) {
    TORCH_CHECK(dims.size() == 7, "edgellm decode plan: dims has 7 entries");
    auto& M = m;
    M.dim = dims[0]; M.n_heads = dims[1]; M.n_kv_heads = dims[2]; M.head_dim = dims[3]; M.hidden = dims[4];
    M.vocab = dims[5]; M.max_seq_len = dims[6];
    M.eps = (float)eps;
    M.attn_scale = (float)attn_scale;
    TORCH_CHECK(M.n_kv_heads > 0 && M.n_heads % M.n_kv_heads == 0 && M.head_dim % 2 == 0 && M.head_dim <= 1024 &&
                    M.n_heads / M.n_kv_heads <= 64, "edgellm decode plan: unsupported head layout");
    const int64_t D = M.head_dim, S = M.max_seq_len, qkv_n = (M.n_heads + 2 * M.n_kv_heads) * D;
    M.rotary_dim = D;
    py::tuple fam;
    if (!family.is_none()) {
      fam = family.cast<py::tuple>();
      TORCH_CHECK(fam.size() == 8, "edgellm decode plan: family has 8 fields");
      M.rotary_dim = fam[0].cast<int64_t>();
      M.act = fam[1].cast<int>();
      M.embed_scale = (float)fam[2].cast<double>();
      M.attn_softcap = (float)fam[3].cast<double>();
      M.final_softcap = (float)fam[4].cast<double>();
      TORCH_CHECK(M.rotary_dim > 0 && M.rotary_dim <= D && M.rotary_dim % 2 == 0 && (M.act == 0 || M.act == 1),
                  "edgellm decode plan: rotary dim ", M.rotary_dim, " / activation ", M.act);
    }
    const int64_t R = M.rotary_dim;
    M.embedding = linear(embedding, M.vocab, M.dim, "embedding");
    for (const py::handle& item : layers) {
      const py::tuple t = item.cast<py::tuple>();
      TORCH_CHECK(t.size() == 8, "edgellm decode plan: a layer has 8 fields");
      edgellm::DecodeLayer L;
      L.qkv = linear(t[0].cast<py::tuple>(), qkv_n, M.dim, "wqkv");
      L.o = linear(t[1].cast<py::tuple>(), M.dim, M.n_heads * D, "wo");
      L.w13 = linear(t[2].cast<py::tuple>(), 2 * M.hidden, M.dim, "w13");
      L.w2 = linear(t[3].cast<py::tuple>(), M.dim, M.hidden, "w2");
      L.attn_norm = f32(t[4], M.dim, "attention_norm");
      L.ffn_norm = f32(t[5], M.dim, "ffn_norm");
      L.k = kv(t[6], "k cache");
      L.v = kv(t[7], "v cache");
      TORCH_CHECK(L.k.kind == L.v.kind, "edgellm decode plan: K and V caches of one layer differ in kind");
      M.layers.push_back(L);
    }
    n_layers = (int64_t)M.layers.size();
    M.norm = f32(norm, M.dim, "norm");
    M.output = linear(output, M.vocab, M.dim, "output");
    const at::Tensor& c = hold(py::cast<at::Tensor>(rope_cos), at::kFloat, "rope_cos");
    const at::Tensor& s = hold(py::cast<at::Tensor>(rope_sin), at::kFloat, "rope_sin");
    TORCH_CHECK(c.numel() >= S * R && s.numel() == c.numel(), "edgellm decode plan: rope tables shorter than the cache");
    M.rope_cos = c.data_ptr<float>();
    M.rope_sin = s.data_ptr<float>();
    if (!family.is_none()) {
      M.rope_cos_local = f32(fam[5], c.numel(), "rope_cos_local");
      M.rope_sin_local = f32(fam[6], c.numel(), "rope_sin_local");
      const py::list extras = fam[7].cast<py::list>();
      TORCH_CHECK((int64_t)extras.size() == n_layers, "edgellm decode plan: family extras for ", extras.size(),
                  " layers, the model has ", n_layers);
      for (int64_t i = 0; i < n_layers; ++i) {
        const py::tuple e = extras[i].cast<py::tuple>();
        TORCH_CHECK(e.size() == 6, "edgellm decode plan: a layer's family extras have 6 fields");
        edgellm::DecodeLayer& L = M.layers[i];
        L.q_norm = f32(e[0], D, "q_norm");
        L.k_norm = f32(e[1], D, "k_norm");
        TORCH_CHECK((L.q_norm == nullptr) == (L.k_norm == nullptr), "edgellm decode plan: q and k norms go together");
        L.post_attn_norm = f32(e[2], M.dim, "post_attention_norm");
        L.post_ffn_norm = f32(e[3], M.dim, "post_ffn_norm");
        L.window = e[4].cast<int64_t>();
        L.local_rope = e[5].cast<bool>();
        TORCH_CHECK(L.window >= 0 && (!L.local_rope || M.rope_cos_local), "edgellm decode plan: layer ", i,
                    ": window ", L.window, " / local RoPE without its table");
      }
    }
    M.kv_rot = f32(kv_rot, D * D, "kv rotation");
    M.kv_center = f32(kv_center, (int64_t)M.layers.size() * 2 * M.n_kv_heads * D, "kv centres");
    TORCH_CHECK(M.kv_center == nullptr || M.kv_rot != nullptr, "edgellm decode plan: KV centres without a quantized cache");
    M.kv_key_scale = f32(kv_key_scale, (int64_t)M.layers.size() * M.n_kv_heads * D, "kv key scales");
    TORCH_CHECK(M.kv_key_scale == nullptr || M.kv_center != nullptr, "edgellm decode plan: key scales without KV centres");
    const int kind = M.layers.empty() ? edgellm::DecodeKV::F32 : M.layers[0].k.kind;
    const bool quantized = kind == edgellm::DecodeKV::INT8 || kind == edgellm::DecodeKV::INT4;
    for (const auto& L : M.layers)
      TORCH_CHECK(L.k.kind == kind && L.v.kind == kind, "edgellm decode plan: mixed KV kinds");
    TORCH_CHECK(quantized == (M.kv_rot != nullptr), "edgellm decode plan: a quantized cache needs its rotation");
    edgellm::decode_prepare(M);
  }

  at::Tensor step(const at::Tensor& token, int64_t pos, const at::Tensor& logits, int64_t variant) {
    TORCH_CHECK(token.device().is_cpu() && token.scalar_type() == at::kLong && token.numel() == 1,
                "edgellm decode step: token must be one int64 CPU element");
    TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                    logits.numel() == m.vocab, "edgellm decode step: logits must be contiguous fp32 [", m.vocab, "]");
    TORCH_CHECK(pos >= 0 && pos < m.max_seq_len, "edgellm decode step: position ", pos, " outside the cache of ",
                m.max_seq_len);
    const int64_t tok = token.data_ptr<int64_t>()[0];
    TORCH_CHECK(tok >= 0 && tok < m.vocab, "edgellm decode step: token id ", tok, " outside the vocabulary");
    float* out = logits.data_ptr<float>();
    {
      py::gil_scoped_release nogil;  // a chat UI thread keeps running while the token computes
      edgellm::decode_step(m, tok, pos, out, (int)variant);
    }
    return logits;
  }

  at::Tensor step_many(const at::Tensor& tokens, int64_t pos, const at::Tensor& logits, int64_t variant,
                       bool last_only) {
    TORCH_CHECK(tokens.device().is_cpu() && tokens.scalar_type() == at::kLong && tokens.is_contiguous(),
                "edgellm decode tokens: tokens must be contiguous int64 on the CPU");
    const int64_t T = tokens.numel();
    TORCH_CHECK(T >= 1 && T <= edgellm::kDecodeMaxRows, "edgellm decode tokens: 1..", edgellm::kDecodeMaxRows,
                " tokens per call, got ", T);
    const int64_t rows = last_only ? 1 : T;
    TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                    logits.numel() >= rows * m.vocab, "edgellm decode tokens: logits must be contiguous fp32 [>= ",
                rows, ", ", m.vocab, "]");
    TORCH_CHECK(pos >= 0 && pos + T <= m.max_seq_len, "edgellm decode tokens: positions [", pos, ", ", pos + T,
                ") outside the cache of ", m.max_seq_len);
    const int64_t* ids = tokens.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(ids[t] >= 0 && ids[t] < m.vocab, "edgellm decode tokens: token id ", ids[t], " outside the vocabulary");
    float* out = logits.data_ptr<float>();
    {
      py::gil_scoped_release nogil;
      edgellm::decode_tokens(m, ids, T, pos, out, (int)variant, last_only);
    }
    return logits;
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "edgellm int4/int8 weight-only GEMM for small M (decode, speculative verification)";
  m.def("int4_gemm", &int4_gemm, py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("mins"),
        py::arg("group_size"), "x fp32 [M,K] @ dequant(int4 codes [N,K/2])^T -> fp32 [M,N]; mins empty = symmetric");
  m.def("int8_gemm", &int8_gemm, py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("group_size"),
        "x fp32 [M,K] @ dequant(int8 codes [N,K])^T -> fp32 [M,N]");
  m.def("int4_gemm_variant", &int4_gemm_variant, py::arg("x"), py::arg("codes"), py::arg("scales"),
        py::arg("mins"), py::arg("group_size"), py::arg("variant"),
        "variant: 0 auto, 1 int-dot (x rounded to int8 per 32-block), 2 float-fma, 3 portable float,"
        " 4 portable int-dot");
  m.def("int8_gemm_variant", &int8_gemm_variant, py::arg("x"), py::arg("codes"), py::arg("scales"),
        py::arg("group_size"), py::arg("variant"));
  m.def("int4_gemm_out", &int4_gemm_out, py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("mins"),
        py::arg("group_size"), py::arg("out"), "int4_gemm into a preallocated fp32 [M,N] out; returns out");
  m.def("int8_gemm_out", &int8_gemm_out, py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("group_size"),
        py::arg("out"), "int8_gemm into a preallocated fp32 [M,N] out; returns out");
  m.def("gguf_linear", &gguf_linear, py::arg("x"), py::arg("parts"), py::arg("n_total"),
        "x fp32 [M,K] @ GGUF parts^T -> fp32 [M, n_total]; parts: [(raw uint8, type, rows, int32 out_index or None)]");
  m.def("gguf_linear_prompt", &gguf_linear_prompt, py::arg("x"), py::arg("parts"), py::arg("n_total"),
        "gguf_linear for prompt chunks: the int8 panel GEMM (equal to fp32 rounding, not bit for bit)");
  m.def("quant_linear_prompt", &quant_linear_prompt, py::arg("x"), py::arg("codes"), py::arg("scales"),
        py::arg("mins"), py::arg("group_size"), py::arg("bits"), py::arg("amx") = false,
        "x fp32 [M, K] @ W^T for int8 / int4 codes (quant/groups.py) through the int8 prompt GEMM -> fp32 [M, N]; "
        "amx: on AMX tiles in bf16 instead (gguf_linear_amx's kernel)");
  m.def("gguf_linear_amx", &gguf_linear_amx, py::arg("x"), py::arg("parts"), py::arg("n_total"),
        "gguf_linear for prompt chunks on AMX tiles: x and the weights rounded to bf16, fp32 sums");
  m.def("gguf_amx_available", &edgellm::gguf_amx_available,
        "True where gguf_linear_amx runs (AVX-512 VNNI build, AMX-BF16 CPU, tile state granted by Linux)");
  m.def("gguf_prompt_gemm_fast", &edgellm::gguf_prompt_gemm_fast,
        "True where gguf_linear_prompt is vectorized (AVX2 / AVX-512 VNNI), False for the portable version");
  m.def("gguf_dequantize", &gguf_dequantize, py::arg("raw"), py::arg("type"), py::arg("n"), py::arg("k"),
        py::arg("out") = py::none(), "GGUF blocks -> fp32 [n, k], bit-identical to gguf.quants.dequantize (out bf16: "
        "those values rounded as torch's .to(bfloat16))");
  m.def("gguf_types", [] { return gguf_types_where(edgellm::gguf_supported); }, "the GGML type ids this build multiplies natively");
  m.def("gguf_grid_convert", &gguf_grid_convert, py::arg("raw"), py::arg("type"), py::arg("n"), py::arg("k"),
        py::arg("grid"), py::arg("ksigns"), py::arg("q8_0"),
        "a grid / ternary type's blocks [n, row bytes] (no product kernel) -> fp32 [n, k] as gguf.quants.dequantize, "
        "or (q8_0) Q8_0 blocks [n, k / 32 * 34] as gguf.quants.quantize rounds those values");
  m.def("gguf_to_l4", &gguf_grid_l4, py::arg("raw"), py::arg("type"), py::arg("n"), py::arg("k"),
        py::arg("x8") = false, py::arg("grid") = py::none(), py::arg("ksigns") = py::none(),
        "IQ2_XXS / IQ3_XXS / IQ3_S / IQ1_S blocks [n, row bytes] -> the same values as L4 blocks (type + 100: IQ4_XS "
        "blocks whose codes index the type's levels) [n, k / 256 * 136]; IQ2_XS / IQ2_S / IQ1_M -> L4-per-16 blocks "
        "[n, k / 256 * 146]; or (x8) in that type's x8 layout (type + 1100). IQ1_S, IQ1_M, IQ2_S need their grid, "
        "IQ2_XS its grid and sign bytes (gguf.quants')");
  m.def("gguf_ternary_to_q2_k", &gguf_ternary_q2_k, py::arg("raw"), py::arg("type"), py::arg("n"), py::arg("k"),
        "TQ1_0 / TQ2_0 blocks [n, row bytes] -> Q2_K blocks [n, k / 256 * 84] of the same values bit for bit");
  m.def("gguf_iq1_to_q6_k", &gguf_iq1_q6_k, py::arg("raw"), py::arg("type"), py::arg("n"), py::arg("k"),
        py::arg("grid"), "IQ1_S / IQ1_M blocks [n, row bytes] -> Q6_K blocks [n, k / 256 * 210] of the same values "
        "bit for bit, or None where a block's d / 8 is not an fp16");
  m.def("gguf_l4_types", [] { return gguf_types_where(edgellm::gguf_l4_base); }, "the GGML type ids gguf_to_l4 recodes");
  m.def("gguf_x8_types", [] { return gguf_types_where(edgellm::gguf_x8_supported, edgellm::GGUF_L4 + 64); }, "the GGML type ids (and L4 ids, cpu_gguf.h) this build also multiplies repacked 8 rows at a time "
        "(their type id + 1000)");
  m.def("gguf_repack", [](const at::Tensor& raw, int64_t type, int64_t n, int64_t k) {
          return gguf_x8_convert(raw, type, n, k, true); }, py::arg("raw"), py::arg("type"), py::arg("n"), py::arg("k"),
        "GGUF blocks [n, row bytes] -> the x8 layout [n, x8 row bytes] (type + 1000), the same bytes reordered");
  m.def("gguf_unrepack", [](const at::Tensor& x8, int64_t type, int64_t n, int64_t k) {
          return gguf_x8_convert(x8, type, n, k, false); }, py::arg("x8"), py::arg("type"), py::arg("n"), py::arg("k"),
        "the x8 layout -> the GGUF blocks as stored, bit for bit");
  m.def("gguf_r8_types", [] { return gguf_types_where(edgellm::gguf_r8_supported); }, "the GGML type ids this build also multiplies with each row's runs of 8 "
        "blocks regrouped (their type id + 2000)");
  m.def("gguf_repack_r8", [](const at::Tensor& raw, int64_t type, int64_t n, int64_t k) {
          return gguf_r8_convert(raw, type, n, k, true); }, py::arg("raw"), py::arg("type"), py::arg("n"), py::arg("k"),
        "Q5_0 / Q5_1 blocks [n, row bytes] -> the r8 layout (type + 2000), the same bytes reordered");
  m.def("gguf_unrepack_r8", [](const at::Tensor& r8, int64_t type, int64_t n, int64_t k) {
          return gguf_r8_convert(r8, type, n, k, false); }, py::arg("r8"), py::arg("type"), py::arg("n"), py::arg("k"),
        "the r8 layout -> the GGUF blocks as stored, bit for bit");
  m.def("isa", &isa, "the instruction set the kernels were compiled for");
  m.def("flash_causal", &flash_causal, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("pos0") = 0,
        py::arg("amx") = false,
        "causal attention of T rows at positions pos0.. over keys [0, pos0 + T): q [Hq,T,D] (scaled), k, v "
        "[Hkv,pos0+T,D] -> (out, lse [Hq,T]); amx: Q K^T and P V on AMX tiles in bf16 (head dims % 32 == 0; "
        "others as without)");
  m.def("flash_causal_fast", &edgellm::flash_causal_fast, "whether this build has flash_causal (AVX2 + FMA)");
  m.def("gated_mlp", &gated_mlp, py::arg("gu"), py::arg("gelu"),
        "silu(gu[..., :H]) * gu[..., H:] (gelu: gelu_tanh) for the fused gate/up product, fp32");
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("w"), py::arg("eps"), "RMSNorm over the last dim, fp32");
  m.def("dequant_out", &dequant_out, py::arg("codes"), py::arg("scales"), py::arg("mins"), py::arg("group_size"),
        py::arg("bits"), py::arg("buf"),
        "dequantize int4 (mins empty = symmetric) / int8 codes into fp32 buf (>= N*K elements); returns [N, K]");
  m.def("set_kernel_tuning", &edgellm::set_kernel_tuning, py::arg("rows16"), py::arg("rows8_min_tokens"),
        "A/B switches of the int kernels (same bits, other speed): 16-row groups on AVX-512 VNNI; from how many "
        "tokens a call takes weight rows 8 at a time (AVX2)");
  py::class_<DecodePlan>(m, "DecodePlan", "the fused CPU decode step of one model + KV cache (see cpu_decode.py)")
      .def(py::init<const std::vector<int64_t>&, double, double, const py::tuple&, const py::list&, const py::handle&,
                    const py::tuple&, const py::handle&, const py::handle&, const py::handle&, const py::handle&,
                    const py::handle&, const py::handle&>(),
           py::arg("dims"), py::arg("eps"), py::arg("attn_scale"), py::arg("embedding"), py::arg("layers"),
           py::arg("norm"), py::arg("output"), py::arg("rope_cos"), py::arg("rope_sin"), py::arg("kv_rot") = py::none(),
           py::arg("kv_center") = py::none(), py::arg("kv_key_scale") = py::none(), py::arg("family") = py::none())
      .def("step", &DecodePlan::step, py::arg("token"), py::arg("pos"), py::arg("logits"), py::arg("variant"),
           "logits [vocab] of token (int64 [1] or [1, 1]) at position pos; writes its K/V into the cache")
      .def("step_many", &DecodePlan::step_many, py::arg("tokens"), py::arg("pos"), py::arg("logits"),
           py::arg("variant"), py::arg("last_only") = false,
           "logits [T, vocab] of T tokens at positions [pos, pos + T), causal; each row as step gives it; "
           "last_only: the last token's row alone, in logits' first row")
      .def_property("attention_rows", [](const DecodePlan& p) { return p.m.attention_rows; },
                    [](DecodePlan& p, bool on) { p.m.attention_rows = on; },
                    "fp32 cache, T-token passes: every token's attention tiles in one parallel region (A/B)")
      .def_property("int_attention", [](const DecodePlan& p) { return p.m.int_attention; },
                    [](DecodePlan& p, bool on) { p.m.int_attention = on; },
                    "int8/int4 cache on AVX-512 VNNI: integer scores and register-dequantized values (A/B)")
      .def_property_readonly_static("max_rows", [](py::object) { return edgellm::kDecodeMaxRows; })
      .def("set_profile", [](DecodePlan& p, bool on) {
             p.m.profile = on;
             p.m.t_matmul = p.m.t_attention = p.m.t_other = 0;
             p.m.steps = 0;
           }, py::arg("on"), "start (and zero) or stop the per-part timers of the step")
      .def("profile", [](const DecodePlan& p) {
             py::dict d;
             d["steps"] = p.m.steps;
             d["matmul_s"] = p.m.t_matmul;
             d["attention_s"] = p.m.t_attention;
             d["other_s"] = p.m.t_other;
             return d;
           }, "seconds spent per part since set_profile(True)");
}

TORCH_LIBRARY(edgellm_cpu, m) {
  m.def("int4_gemm(Tensor x, Tensor codes, Tensor scales, Tensor mins, int group_size) -> Tensor");
  m.def("int8_gemm(Tensor x, Tensor codes, Tensor scales, int group_size) -> Tensor");
  // variant: 0 auto, 1 int-dot (x quantized to int8 per 32-block), 2 float-fma (dequantize in registers),
  // 3 portable float, 4 portable int-dot.  For benchmarks and tests.
  m.def("int4_gemm_variant(Tensor x, Tensor codes, Tensor scales, Tensor mins, int group_size, int variant) -> Tensor");
  m.def("int8_gemm_variant(Tensor x, Tensor codes, Tensor scales, int group_size, int variant) -> Tensor");
  m.def("isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(edgellm_cpu, CPU, m) {
  m.impl("int4_gemm", &int4_gemm);
  m.impl("int8_gemm", &int8_gemm);
  m.impl("int4_gemm_variant", &int4_gemm_variant);
  m.impl("int8_gemm_variant", &int8_gemm_variant);
}
