// Calibration micro-benchmarks for the TTT on-chip kernels (docs/gpu_ttt_kernels.md, "What only a
// GPU can tell"): what one round of each kind of synchronisation costs on the device, in SM
// cycles (clock64), as a chain of dependent rounds so that latency, not throughput, is timed.
//
//   reduce_cta<W>  column sums of a [64*W/4 x 16] float32 tile held as wgmma accumulators (W
//                  warps, each thread 2 rows x 4 columns): in-thread adds, 3 shuffle levels, one
//                  shared-memory exchange between the warps, one __syncthreads (double-buffered);
//                  the LayerNorm statistics round of ops/ttt/triton_resident.py (W = 8: head
//                  dim 128, W = 4: 64)
//   bar_cta<W>     __syncthreads alone
//   cluster<N>     the same round on a thread-block cluster of N CTAs (2, 4): each CTA's partial
//                  sums to its shared memory, a cluster barrier, every CTA reads its peers'
//                  partials through distributed shared memory (TTT-MLP's hidden units split over
//                  a cluster, docs/gpu_ttt_kernels.md)
//   fence_load     a fence.proxy.async.shared::cta issued right after a global load from HBM
//                  whose value is not yet used, against the same fence with no load in flight:
//                  whether the fence Triton puts before every wgmma waits for loads in flight
//                  (the resident forward prefetches the next mini-batch's inputs before them)
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v
//        ttt_sync_micro.cu -o ttt_sync_micro   (benchmarks/ttt_sync_micro.py does this)
// Prints one JSON object per line; exits 2 with one line on stderr where no GPU is present.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace cg = cooperative_groups;

constexpr int COLS = 16;  // the tokens of a mini-batch (b = 16): the columns of the tile
constexpr int ROUNDS = 4096;

#define CHECK(x)                                                                    \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      fprintf(stderr, "ttt_sync_micro: %s: %s\n", #x, cudaGetErrorString(e_));      \
      exit(2);                                                                      \
    }                                                                               \
  } while (0)

// One round's in-warp part: a thread holds v[2 rows][4 columns]; sum its rows, then over the 8
// lane groups holding the other rows of the warp (lane bits 2..4).
__device__ __forceinline__ void warp_columns(const float (&v)[2][4], float (&s)[4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    s[c] = v[0][c] + v[1][c];
#pragma unroll
    for (int m = 4; m < 32; m <<= 1) s[c] += __shfl_xor_sync(0xffffffffu, s[c], m);
  }
}

// Column c of thread lane: 2 * (lane % 4) + {0, 1} + 8 * {0, 1}, as the accumulator layout.
__device__ __forceinline__ int column(int lane, int c) { return 2 * (lane & 3) + (c & 1) + 8 * (c >> 1); }

// The thread's values v [2 rows][4 columns] of a tile held as W warps' accumulators: one
// round's in-thread and in-warp part, the warp's column sums into p[warp], then __syncthreads.
template <int W>
__device__ __forceinline__ void warp_partials(const float (&v)[2][4], float (*p)[COLS], int lane,
                                              int warp) {
  float s[4];
  warp_columns(v, s);
  if (lane < 4) {
#pragma unroll
    for (int c = 0; c < 4; ++c) p[warp][column(lane, c)] = s[c];
  }
  __syncthreads();
}

// The thread's values v [2][4] of a tile as above.
__device__ __forceinline__ void init_values(float (&v)[2][4], int seed) {
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) v[r][c] = 1e-3f * (seed + r + c);
}

template <int W>
__global__ void reduce_cta(float* out, long long* cycles, int rounds) {
  __shared__ float part[2][W][COLS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float v[2][4];
  init_values(v, threadIdx.x);
  __syncthreads();
  long long t0 = clock64();
  for (int i = 0; i < rounds; ++i) {
    float(*p)[COLS] = part[i & 1];
    warp_partials<W>(v, p, lane, warp);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < W; ++w) total += p[w][column(lane, c)];
      v[0][c] += 1e-7f * total;  // the next round depends on this one's result
    }
  }
  long long t1 = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
  out[blockIdx.x * blockDim.x + threadIdx.x] = v[0][0] + v[0][1] + v[0][2] + v[0][3];
}

template <int W>
__global__ void bar_cta(long long* cycles, int rounds) {
  __syncthreads();
  long long t0 = clock64();
  for (int i = 0; i < rounds; ++i) __syncthreads();
  long long t1 = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

// The round of reduce_cta over a cluster: the CTA's column sums (a shared-memory round inside
// the CTA), then the cluster's (distributed shared memory, one cluster barrier per round,
// double-buffered).
template <int N>
__global__ void cluster(float* out, long long* cycles, int rounds) {
  constexpr int W = 8;
  __shared__ float part[2][W][COLS];
  __shared__ float cta[2][COLS];
  cg::cluster_group cl = cg::this_cluster();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float v[2][4];
  init_values(v, threadIdx.x + blockIdx.x);
  cl.sync();
  long long t0 = clock64();
  for (int i = 0; i < rounds; ++i) {
    float(*p)[COLS] = part[i & 1];
    warp_partials<W>(v, p, lane, warp);
    if (threadIdx.x < COLS) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < W; ++w) total += p[w][threadIdx.x];
      cta[i & 1][threadIdx.x] = total;
    }
    cl.sync();  // every CTA's partial is visible to its peers
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float total = 0.f;
#pragma unroll
      for (int r = 0; r < N; ++r) total += cl.map_shared_rank(&cta[i & 1][0], r)[column(lane, c)];
      v[0][c] += 1e-7f * total;
    }
  }
  long long t1 = clock64();
  cl.sync();  // no CTA leaves while a peer may still read its shared memory
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
  out[blockIdx.x * blockDim.x + threadIdx.x] = v[0][0] + v[0][1] + v[0][2] + v[0][3];
}

// Cycles of a fence.proxy.async right after a load (from a line no one touched) that is still in
// flight (with_load = 1), or with nothing in flight (0); per round, averaged over rounds lines.
__global__ void fence_load(const float* cold, float* out, long long* cycles, int rounds,
                           int with_load) {
  float acc = 0.f;
  long long spent = 0;
  for (int i = 0; i < rounds; ++i) {
    float x = 0.f;
    if (with_load) asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(x) : "l"(cold + i * 4096) : "memory");
    long long t0 = clock64();
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    long long t1 = clock64();
    spent += t1 - t0;
    acc += x;  // the load is used only after the timed fence
  }
  cycles[threadIdx.x] = spent;
  out[threadIdx.x] = acc;
}

static double per_round(long long* d_cycles, int n, int rounds) {
  long long h[64];
  CHECK(cudaMemcpy(h, d_cycles, n * sizeof(long long), cudaMemcpyDeviceToHost));
  long long worst = 0;
  for (int i = 0; i < n; ++i) worst = h[i] > worst ? h[i] : worst;
  return double(worst) / rounds;
}

template <int N>
static void run_cluster(float* d_out, long long* d_cycles) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(N);
  cfg.blockDim = dim3(256);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = N;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  for (int rep = 0; rep < 2; ++rep) {  // the first launch warms up
    CHECK(cudaLaunchKernelEx(&cfg, cluster<N>, d_out, d_cycles, ROUNDS));
    CHECK(cudaDeviceSynchronize());
  }
  printf("{\"bench\": \"cluster_round\", \"ctas\": %d, \"warps_per_cta\": 8, "
         "\"cycles_per_round\": %.1f}\n", N, per_round(d_cycles, N, ROUNDS));
}

template <int W>
static void run_cta(float* d_out, long long* d_cycles) {
  for (int rep = 0; rep < 2; ++rep) {
    reduce_cta<W><<<1, 32 * W>>>(d_out, d_cycles, ROUNDS);
    CHECK(cudaDeviceSynchronize());
  }
  printf("{\"bench\": \"cta_reduce_round\", \"warps\": %d, \"cycles_per_round\": %.1f}\n", W,
         per_round(d_cycles, 1, ROUNDS));
  for (int rep = 0; rep < 2; ++rep) {
    bar_cta<W><<<1, 32 * W>>>(d_cycles, ROUNDS);
    CHECK(cudaDeviceSynchronize());
  }
  printf("{\"bench\": \"syncthreads\", \"warps\": %d, \"cycles_per_round\": %.1f}\n", W,
         per_round(d_cycles, 1, ROUNDS));
}

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    fprintf(stderr, "ttt_sync_micro: no CUDA GPU here: nothing to measure\n");
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  printf("{\"device\": \"%s\", \"sm\": %d, \"sms\": %d, \"clock_mhz\": %.0f}\n", prop.name,
         prop.major * 10 + prop.minor, prop.multiProcessorCount, clock_khz / 1e3);
  if (prop.major < 9) {
    fprintf(stderr, "ttt_sync_micro: sm_%d%d has no thread-block clusters (sm_90 and up)\n",
            prop.major, prop.minor);
    return 2;
  }
  float* d_out;
  long long* d_cycles;
  float* d_cold;
  const size_t cold_floats = size_t(ROUNDS) * 4096 + 32;  // 64 MiB: a fresh line per round
  CHECK(cudaMalloc(&d_out, 4 * 256 * sizeof(float)));
  CHECK(cudaMalloc(&d_cycles, 64 * sizeof(long long)));
  CHECK(cudaMalloc(&d_cold, cold_floats * sizeof(float)));
  CHECK(cudaMemset(d_cold, 0, cold_floats * sizeof(float)));
  run_cta<4>(d_out, d_cycles);
  run_cta<8>(d_out, d_cycles);
  run_cluster<2>(d_out, d_cycles);
  run_cluster<4>(d_out, d_cycles);
  for (int with_load = 0; with_load < 2; ++with_load) {
    CHECK(cudaMemset(d_cold, 0, cold_floats * sizeof(float)));  // evicts nothing from L2 by
    // itself; the 64 MiB written exceed the 50 MiB L2, so most lines come from HBM
    fence_load<<<1, 32>>>(d_cold, d_out, d_cycles, 1024, with_load);
    CHECK(cudaDeviceSynchronize());
    printf("{\"bench\": \"fence_after_load\", \"load_in_flight\": %d, "
           "\"cycles_per_fence\": %.1f}\n", with_load, per_round(d_cycles, 1, 1024));
  }
  CHECK(cudaFree(d_out));
  CHECK(cudaFree(d_cycles));
  CHECK(cudaFree(d_cold));
  return 0;
}
