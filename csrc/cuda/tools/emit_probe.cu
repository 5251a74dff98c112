// The bare probe behind docs/benchmarks.md's roofline of the CUDA emit: what the GPU and the
// link allow for writing N bytes into registered (mapped, cacheable) host memory, with none of
// the op's work. Each line is one case:
//   empty      an empty kernel (the launch floor);
//   write      N bytes stored by `blocks` blocks (16 bytes a thread, coalesced), nothing else;
//   write4     the same with 4-byte stores (what the op's columns use);
//   fence      write + per block a barrier, one __threadfence_system() and a commit word;
//   last       write + the op's commit protocol: per block a gpu-scope fence and a counter,
//              the last block one system-scope release store of the commit word;
//   loads      one block, a chain of `blocks` dependent loads from device memory (the cost of
//              one round trip to L2/HBM, times the chain);
//   memcpy     cudaMemcpyAsync of N bytes from device memory into the registered buffer.
// Times: b2b = CUDA events around 500 launches back to back / 500 (what the case adds to a busy
// stream); bracket = events around one launch, the stream held by a spinning kernel while the
// launches queue (median of 200), as bench_emit.py times the op. GB/s = N / b2b.
// `emit_probe` runs every case at 2 KB .. 1 MiB; `emit_probe last BYTES...` runs the empty
// kernel, then `last` and `memcpy` only, at the sizes given (scripts/bench_roofline.py passes
// the emit's frame sizes).
// Build: nvcc -arch=sm_90 -O2 -std=c++17 csrc/cuda/tools/emit_probe.cu -o emit_probe
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#define CUDA_OK(expr)                                                                                       \
  do {                                                                                                      \
    cudaError_t e_ = (expr);                                                                                \
    if (e_ != cudaSuccess) {                                                                                \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__, #expr); \
      std::exit(2);                                                                                         \
    }                                                                                                       \
  } while (0)

namespace {

__global__ void empty_kernel() {}

__global__ void spin(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

__device__ __forceinline__ void st_release_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// mode 0 write, 1 fence, 2 last, 3 write4
__global__ void write_kernel(uint8_t* dst, uint64_t bytes, int mode, uint64_t* commit, unsigned* done, uint64_t seq) {
  const uint64_t tid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t nthreads = uint64_t(gridDim.x) * blockDim.x;
  if (mode == 3) {
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    for (uint64_t i = tid; i < bytes / 4; i += nthreads) reinterpret_cast<volatile uint32_t*>(d)[i] = uint32_t(i ^ seq);
    return;
  }
  uint4* d = reinterpret_cast<uint4*>(dst);
  for (uint64_t i = tid; i < bytes / 16; i += nthreads) {
    const uint32_t v = uint32_t(i ^ seq);
    d[i] = make_uint4(v, v, v, v);
  }
  if (mode == 0) return;
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (mode == 1) {
    __threadfence_system();
    reinterpret_cast<volatile uint64_t*>(commit)[blockIdx.x & 7] = seq;
    return;
  }
  __threadfence();
  if (atomicAdd(done, 1u) != gridDim.x - 1) return;
  *reinterpret_cast<volatile unsigned*>(done) = 0;
  st_release_sys_u64(commit, seq);
}

__global__ void loads_kernel(const uint64_t* chain, int n, uint64_t* out) {
  if (threadIdx.x != 0) return;
  uint64_t i = 0;
  for (int k = 0; k < n; ++k) i = reinterpret_cast<const volatile uint64_t*>(chain)[i];
  *out = i;
}

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : double(v[v.size() / 2]);
}

struct Timer {
  cudaStream_t s;
  cudaEvent_t ev[402];
  Timer() {
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (auto& e : ev) CUDA_OK(cudaEventCreate(&e));
  }
  // b2b and bracket microseconds of launch(s)
  std::pair<double, double> time(const std::function<void(cudaStream_t)>& launch) {
    for (int i = 0; i < 20; ++i) launch(s);
    CUDA_OK(cudaEventRecord(ev[0], s));
    for (int i = 0; i < 500; ++i) launch(s);
    CUDA_OK(cudaEventRecord(ev[1], s));
    CUDA_OK(cudaStreamSynchronize(s));
    CUDA_OK(cudaGetLastError());
    float ms;
    CUDA_OK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
    std::vector<float> t;
    for (int round = 0; round < 4; ++round) {
      spin<<<1, 1, 0, s>>>(3000000);
      for (int i = 0; i < 50; ++i) {
        CUDA_OK(cudaEventRecord(ev[2 + 2 * i], s));
        launch(s);
        CUDA_OK(cudaEventRecord(ev[3 + 2 * i], s));
      }
      CUDA_OK(cudaStreamSynchronize(s));
      for (int i = 0; i < 50; ++i) {
        float x;
        CUDA_OK(cudaEventElapsedTime(&x, ev[2 + 2 * i], ev[3 + 2 * i]));
        t.push_back(x * 1000.f);
      }
    }
    return {ms * 1000.0 / 500, median(t)};
  }
};

void line(const char* mode, uint64_t bytes, unsigned blocks, std::pair<double, double> us) {
  std::printf("probe mode=%s bytes=%llu blocks=%u b2b_us=%.2f bracket_us=%.2f gbps=%.1f\n", mode,
              (unsigned long long)bytes, blocks, us.first, us.second, us.first > 0 ? bytes / (us.first * 1e3) : 0.0);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<uint64_t> sizes = {2048, 8192, 32768, 65536, 131072, 268480, 524288, 1u << 20};
  const bool last_only = argc > 1;
  if (last_only) {
    if (std::strcmp(argv[1], "last") != 0 || argc < 3) {
      std::fprintf(stderr, "usage: %s [last BYTES...]\n", argv[0]);
      return 2;
    }
    sizes.clear();
    for (int i = 2; i < argc; ++i) {
      char* end = nullptr;
      const unsigned long long b = std::strtoull(argv[i], &end, 10);
      if (end == argv[i] || *end != '\0' || b < 16 || b > (1u << 20)) {
        std::fprintf(stderr, "BYTES = %s: expected an integer in 16..1048576\n", argv[i]);
        return 2;
      }
      sizes.push_back(b);
    }
  }
  const std::vector<int> modes = last_only ? std::vector<int>{2} : std::vector<int>{0, 1, 2, 3};
  const uint64_t max_bytes = 1u << 20;
  const size_t region = 64u << 20;  // writes rotate over 64 MiB, as a ring's data area does
  void* host = mmap(nullptr, region, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (host == MAP_FAILED) return 2;
  std::memset(host, 0, region);
  CUDA_OK(cudaHostRegister(host, region, cudaHostRegisterMapped | cudaHostRegisterPortable));
  uint8_t* dhost = nullptr;
  CUDA_OK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dhost), host, 0));
  uint8_t* dev = nullptr;
  CUDA_OK(cudaMalloc(&dev, max_bytes));
  CUDA_OK(cudaMemset(dev, 1, max_bytes));
  unsigned* done = nullptr;
  CUDA_OK(cudaMalloc(&done, 64));
  CUDA_OK(cudaMemset(done, 0, 64));
  uint64_t* chain = nullptr;
  CUDA_OK(cudaMalloc(&chain, 1 << 20));
  {  // a pointer chase over 16 KiB: every load depends on the one before
    std::vector<uint64_t> c(2048);
    for (size_t i = 0; i < c.size(); ++i) c[i] = (i * 97 + 13) % c.size();
    CUDA_OK(cudaMemcpy(chain, c.data(), c.size() * 8, cudaMemcpyHostToDevice));
  }
  uint64_t* commit = reinterpret_cast<uint64_t*>(dhost);  // the first 64 bytes: commit words
  Timer tm;
  uint64_t seq = 0, off = 4096;
  auto next_dst = [&](uint64_t bytes) {
    if (off + bytes > region) off = 4096;
    uint8_t* d = dhost + off;
    off += (bytes + 4095) & ~uint64_t(4095);
    return d;
  };
  line("empty", 0, 1, tm.time([](cudaStream_t s) { empty_kernel<<<1, 32, 0, s>>>(); }));
  for (int n : {1, 4, 16}) {
    if (last_only) break;
    const auto us = tm.time([&](cudaStream_t s) { loads_kernel<<<1, 32, 0, s>>>(chain, n, reinterpret_cast<uint64_t*>(done) + 4); });
    line("loads", 0, unsigned(n), us);
  }
  const char* names[] = {"write", "fence", "last", "write4"};
  for (uint64_t bytes : sizes) {
    const unsigned natural = unsigned(std::min<uint64_t>(264, std::max<uint64_t>(1, bytes / 4096)));
    std::vector<unsigned> grids = {1u, natural};
    if (natural != 32 && bytes >= 65536) grids.push_back(32);
    if (natural != 132 && bytes >= 262144) grids.push_back(132);
    std::sort(grids.begin(), grids.end());
    grids.erase(std::unique(grids.begin(), grids.end()), grids.end());
    for (int mode : modes) {
      for (unsigned g : grids) {
        const auto us = tm.time([&](cudaStream_t s) {
          write_kernel<<<g, 256, 0, s>>>(next_dst(bytes), bytes, mode, commit, done, ++seq);
        });
        line(names[mode], bytes, g, us);
      }
    }
    const auto us = tm.time([&](cudaStream_t s) {
      uint8_t* d = static_cast<uint8_t*>(host) + (next_dst(bytes) - dhost);
      CUDA_OK(cudaMemcpyAsync(d, dev, bytes, cudaMemcpyDeviceToHost, s));
    });
    line("memcpy", bytes, 0, us);
  }
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaHostUnregister(host));
  std::printf("probe done\n");
  return 0;
}
