// A/B harness for benchmarks/gguf_kernel_ab.py: two builds of kernels/cpu_gguf.cpp in one process (the old one
// compiled with -Dedgellm=edgellm_old), run alternately on the same memory-mapped GGUF tensors, so a loaded
// machine slows both alike.  Reads the tensor list (offset, type, N, K, kind) from a text file; prints one line
// per (kind, M, build) with the best and median time of the rounds.
#include <sys/mman.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <immintrin.h>

#include "cpu_gguf.h"

// ------------------------------------------------------------------------------------------------ thread pool
// One worker beside the calling thread: the calling thread runs the first half of a range, the worker the second.
namespace {
struct Pool {
  std::thread th;
  std::atomic<int> gen{0}, done{0};
  std::atomic<bool> stop{false};
  const std::function<void(int64_t, int64_t)>* f = nullptr;
  int64_t b = 0, e = 0;
  Pool() {
    th = std::thread([this] {
      int seen = 0;
      while (true) {
        int spins = 0;
        while (gen.load(std::memory_order_acquire) == seen && !stop.load()) {
          if (++spins > 20000) std::this_thread::yield();
        }
        if (stop.load()) return;
        seen = gen.load();
        (*f)(b, e);
        done.store(seen, std::memory_order_release);
      }
    });
  }
  ~Pool() {
    stop = true;
    th.join();
  }
  void run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    const int64_t n = end - begin;
    if (n <= grain) { fn(begin, end); return; }
    const int64_t mid = begin + n / 2;
    f = &fn;
    b = mid;
    e = end;
    const int g = gen.load() + 1;
    gen.store(g, std::memory_order_release);
    fn(begin, mid);
    while (done.load(std::memory_order_acquire) != g) {}
  }
};
Pool* pool = nullptr;
int threads = 2;
}  // namespace

namespace edgellm {
void parallel_run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
  if (threads < 2) f(begin, end);
  else pool->run(begin, end, grain, f);
}
int max_threads() { return threads; }
}  // namespace edgellm
namespace edgellm_old {
// The old build's x8 entry points: the tensors here are as stored (never x8), so these are never called; defined
// because the old cpu_gguf.cpp refers to them (cpu_gguf_x8.cpp is built once, for the new one).
struct GgufActs;
bool gguf_x8_supported(int) { return false; }
int64_t gguf_x8_bytes(int) { return 0; }
void gguf_x8_panel_sb(const uint8_t*, int, uint8_t*, int64_t, float*, float*, int64_t) {}
void gguf_gemm_x8(const GgufActs&, const uint8_t*, int, int64_t, float*, int64_t, const int32_t*) {}
void gguf_repack_x8(const uint8_t*, int, int64_t, int64_t, uint8_t*) {}
void gguf_unrepack_x8(const uint8_t*, int, int64_t, int64_t, uint8_t*) {}
void gguf_unrepack_x8_group(const uint8_t*, int, int64_t, uint8_t*) {}
void parallel_run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
  edgellm::parallel_run(begin, end, grain, f);
}
int max_threads() { return edgellm::max_threads(); }
}  // namespace edgellm_old

// the old build's entry point (gguf_kernel_ab.py appends it to the old source: quantize x, then gguf_gemm)
namespace edgellm_old {
void gguf_linear_old(const float* x, int64_t M, int64_t K, const uint8_t* blocks, int type, int64_t N, float* y,
                     bool prompt);
}

// One thread: this thread's CPU time (the time other processes take the core is not counted: a loaded machine's
// figure); more threads: wall time.
double now() {
  if (threads < 2) {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Tensor {
  int64_t offset;
  int type;
  int64_t N, K;
  std::string kind;
};

// The ceiling: streaming read of a 512 MiB buffer (256-bit loads, 4 accumulators) split over the threads, GB/s of
// the best of `rounds`.
double read_bandwidth(int rounds) {
  const size_t bytes = size_t(512) << 20;
  uint8_t* buf = (uint8_t*)aligned_alloc(64, bytes);
  for (size_t i = 0; i < bytes; i += 4096) buf[i] = (uint8_t)i;
  std::memset(buf, 1, bytes);
  double best = 0;
  long long sink = 0;
  for (int r = 0; r < rounds; ++r) {
    std::vector<long long> part(2, 0);
    const auto t0 = std::chrono::steady_clock::now();
    edgellm::parallel_run(0, 2, 1, [&](int64_t b, int64_t e) {
      for (int64_t h = b; h < e; ++h) {
        const __m256i* p = (const __m256i*)(buf + (threads < 2 ? 0 : bytes / 2 * h));
        const size_t n = (threads < 2 ? bytes : bytes / 2) / 32;
        if (threads < 2 && h > 0) break;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (size_t i = 0; i < n; i += 4) {
          a0 = _mm256_add_epi64(a0, _mm256_load_si256(p + i));
          a1 = _mm256_add_epi64(a1, _mm256_load_si256(p + i + 1));
          a2 = _mm256_add_epi64(a2, _mm256_load_si256(p + i + 2));
          a3 = _mm256_add_epi64(a3, _mm256_load_si256(p + i + 3));
        }
        part[h] = _mm256_extract_epi64(_mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)), 0);
      }
    });
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    sink += part[0] + part[1];
    best = std::max(best, bytes / t / 1e9);
  }
  std::free(buf);
  return sink == 42 ? -best : best;
}

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "read") {
    threads = std::atoi(argv[2]);
    Pool pl;
    pool = &pl;
    std::printf("read_GBps %.2f\n", read_bandwidth(std::atoi(argv[3])));
    return 0;
  }
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s FILE.gguf TENSORS.txt THREADS ROUNDS M[,M...] [REPEATS [PROMPT]]\n", argv[0]);
    return 2;
  }
  threads = std::atoi(argv[3]);
  const int rounds = std::atoi(argv[4]);
  const int repeats = argc > 6 ? std::atoi(argv[6]) : 1;  // calls per tensor and round (hot: the same cached rows)
  const bool prompt = argc > 7 && std::atoi(argv[7]) != 0;  // the prompt GEMM rather than the row kernel
  std::vector<int64_t> ms;
  for (char* p = argv[5]; *p;) {
    ms.push_back(std::strtol(p, &p, 10));
    if (*p == ',') ++p;
  }
  Pool pl;
  pool = &pl;
  const int fd = open(argv[1], O_RDONLY);
  struct stat st;
  fstat(fd, &st);
  const uint8_t* file = (const uint8_t*)mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
  std::vector<Tensor> ts;
  FILE* tf = std::fopen(argv[2], "r");
  char kind[256];
  Tensor t;
  while (std::fscanf(tf, "%ld %d %ld %ld %255s", &t.offset, &t.type, &t.N, &t.K, kind) == 5) {
    t.kind = kind;
    ts.push_back(t);
  }
  std::fclose(tf);
  int64_t maxk = 0, maxn = 0;
  for (auto& x : ts) { maxk = std::max(maxk, x.K); maxn = std::max(maxn, x.N); }
  std::mt19937 rng(0);
  std::normal_distribution<float> nd;
  for (int64_t M : ms) {
    std::vector<float> x(M * maxk), y(M * maxn);
    for (auto& v : x) v = nd(rng);
    // per build, kind: the times of each round (summed over the tensors of that kind)
    std::map<std::string, std::vector<double>> tm[2];
    for (int r = 0; r < rounds + 1; ++r) {
      for (int b = 0; b < 2; ++b) {
        const int build = (r & 1) ? 1 - b : b;  // alternate which build goes first
        std::map<std::string, double> acc;
        for (auto& w : ts) {
          const double t0 = now();
          for (int rep = 0; rep < repeats; ++rep) {
            if (build == 0) {
              edgellm_old::gguf_linear_old(x.data(), M, w.K, file + w.offset, w.type, w.N, y.data(), prompt);
            } else {
              const edgellm::GgufActs a = edgellm::gguf_quantize_acts(x.data(), M, w.K);
              if (prompt) edgellm::gguf_gemm_prompt(a, file + w.offset, w.type, w.N, w.K, y.data(), w.N, nullptr);
              else edgellm::gguf_gemm(a, file + w.offset, w.type, w.N, w.K, y.data(), w.N, nullptr);
            }
          }
          acc[w.kind] += now() - t0;
        }
        if (r == 0) continue;  // warm-up round
        double tot = 0;
        for (auto& kv : acc) { tm[build][kv.first].push_back(kv.second); tot += kv.second; }
        tm[build]["TOTAL"].push_back(tot);
      }
    }
    for (int b = 0; b < 2; ++b)
      for (auto& kv : tm[b]) {
        auto v = kv.second;
        std::sort(v.begin(), v.end());
        std::printf("%s M=%ld %s best_s=%.6f median_s=%.6f\n", b == 0 ? "old" : "new", M, kv.first.c_str(), v.front(),
                    v[v.size() / 2]);
      }
    std::fflush(stdout);
  }
  return 0;
}
