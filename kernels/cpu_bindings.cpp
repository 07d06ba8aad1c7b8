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

namespace edgellm {
void q4_gemm(const float* x, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* scales,
             const uint16_t* mins, int64_t N, int64_t G, float* out, int variant);
void q8_gemm(const float* x, int64_t M, int64_t K, const int8_t* codes, const uint16_t* scales, int64_t N,
             int64_t G, float* out, int variant);
const char* isa_name();
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
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
  m.def("isa", &isa, "the instruction set the kernels were compiled for");
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
