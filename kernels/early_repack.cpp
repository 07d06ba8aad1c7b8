// The x8 repack (cpu_gguf_x8.cpp) as a plain C library, without torch: the `edgellm` command loads it with ctypes
// and repacks a GGUF's matrices on a second core while the first imports torch (edgellm/early_repack.py).
// Built beside the extension from the same source and flags (kernels/cpu_ext.py), so its bytes are the
// extension's gguf_repack's; each caller of edgellm_repack_run is one worker thread. It also splits Q4_0 / Q4_1 /
// Q8_0 blocks into edgellm's own int4 / int8 layout, as quant/groups.gguf_into does, and recodes the grid i-quants
// as their L4 forms straight into those forms' x8 layout, as the extension's gguf_to_l4(x8=True) (cpu_gguf_grid.cpp).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <functional>

#include "cpu_gguf.h"

namespace edgellm {
void parallel_run(int64_t begin, int64_t end, int64_t, const std::function<void(int64_t, int64_t)>& f) {
  if (begin < end) f(begin, end);
}
int max_threads() { return 1; }
}  // namespace edgellm

// One matrix of `rows` rows of `k` values (src_bytes of stored blocks). A type with an x8 layout: its rows (a multiple
// of 8) into dst in that layout. Q4_0 / Q4_1 / Q8_0: its blocks split into codes (dst), fp16 scales (scales) and
// mins (Q4_1: mins), rows of each as edgellm's QuantizedTensor holds them; heads > 0: llama.cpp's Q/K row order
// undone on the way (edgellm.gguf_file.unpermute_rope_rows). A grid i-quant (gguf_l4_base): its rows (a multiple of
// 8) recoded into dst in its L4 form's x8 layout, grid / ksigns the tables gguf_to_l4 takes for it (or null). done:
// 1 once made, -1 where the recoding refused the blocks.
struct RepackJob {
  const uint8_t* src;
  uint8_t *dst, *scales, *mins;
  const int8_t* grid;
  const uint8_t* ksigns;
  int64_t type, rows, k, heads, src_bytes, done;
};

namespace {

void split_blocks(const RepackJob& j) {
  using namespace edgellm;
  const int64_t payload = j.type == GGUF_Q8_0 ? 32 : 16, fields = j.type == GGUF_Q4_1 ? 2 : 1;
  const int64_t block = 2 * fields + payload, blocks = j.k / 32;
  const int64_t half = j.heads > 0 ? j.rows / j.heads / 2 : 0;
  for (int64_t r = 0; r < j.rows; ++r) {
    int64_t ours = r;  // stored row h * 2 half + 2 i + p is our row h * 2 half + p half + i
    if (half > 0) ours = r / (2 * half) * (2 * half) + (r % 2) * half + r % (2 * half) / 2;
    const uint8_t* b = j.src + r * blocks * block;
    uint8_t* codes = j.dst + ours * blocks * payload;
    uint8_t* scales = j.scales + ours * blocks * 2;
    uint8_t* mins = j.mins ? j.mins + ours * blocks * 2 : nullptr;
    for (int64_t g = 0; g < blocks; ++g, b += block) {
      std::memcpy(scales + 2 * g, b, 2);
      if (mins) std::memcpy(mins + 2 * g, b + 2, 2);
      std::memcpy(codes + payload * g, b + 2 * fields, (size_t)payload);
    }
  }
}

}  // namespace

extern "C" {

// Bytes per row of the x8 layout a matrix of `type` is copied into at k values a row: the K-quants' and IQ4_XS' per
// 256 values; Q5_0's, Q5_1's and IQ4_NL's per 32 (the loader's default layouts for them); a grid i-quant's L4 form's
// per 256. 0 where this build has none or k does not fit it.
int64_t edgellm_x8_row_bytes(int64_t type, int64_t k) {
  using namespace edgellm;
  const bool per_256 = (type >= GGUF_Q2_K && type <= GGUF_Q6_K) || type == GGUF_IQ4_XS;
  const bool per_32 = type == GGUF_Q5_0 || type == GGUF_Q5_1 || type == GGUF_IQ4_NL;
  const int layout = gguf_l4_base((int)type) ? (int)type + GGUF_L4 : (int)type;
  const int64_t values = per_256 || layout != type ? 256 : per_32 ? 32 : 0;
  if (!values || !gguf_x8_supported(layout) || k <= 0 || k % values) return 0;
  return k / values * gguf_x8_bytes(layout) / 8;
}

// Takes jobs from *next until none are left or *stop is set; each done one has done = 1 and its source's whole pages
// dropped from this process's memory (they are a read-only map of the file: only the copy is used from here on).
void edgellm_repack_run(RepackJob* jobs, int64_t n, int64_t* next, const int64_t* stop) {
  const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
  for (;;) {
    if (__atomic_load_n(stop, __ATOMIC_ACQUIRE)) return;
    const int64_t i = __atomic_fetch_add(next, 1, __ATOMIC_ACQ_REL);
    if (i >= n) return;
    RepackJob& j = jobs[i];
    if (edgellm::gguf_l4_base((int)j.type)) {
      edgellm::GridTables tables;
      tables.grid = j.grid;
      tables.ksigns = j.ksigns;
      if (!edgellm::gguf_grid_to_l4_x8(j.src, (int)j.type, j.rows, j.k, tables, j.dst)) {
        __atomic_store_n(&j.done, -1, __ATOMIC_RELEASE);
        continue;  // (the loader recodes it, and reports what is wrong with it)
      }
    } else if (j.type == edgellm::GGUF_Q4_0 || j.type == edgellm::GGUF_Q4_1 || j.type == edgellm::GGUF_Q8_0) {
      split_blocks(j);
    } else {
      edgellm::gguf_repack_x8(j.src, (int)j.type, j.rows, j.k, j.dst);
    }
    const uintptr_t begin = ((uintptr_t)j.src + page - 1) / page * page;
    const uintptr_t end = ((uintptr_t)j.src + (uintptr_t)j.src_bytes) / page * page;
    if (end > begin) madvise((void*)begin, end - begin, MADV_DONTNEED);
    __atomic_store_n(&j.done, 1, __ATOMIC_RELEASE);
  }
}

}  // extern "C"
