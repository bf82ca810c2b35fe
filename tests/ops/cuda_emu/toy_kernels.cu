// Small kernels that exercise every CUDA feature fw_emu.h emulates, written as real CUDA: nvcc
// compiles this file for sm_90a (tests/ops/test_cuda_emu.py checks ptxas reports no spills), g++
// with -DFW_EMULATE runs it on the CPU through the extern "C" entries at the end, which the
// tests call through ctypes. The template flag GOOD = false plants a missing barrier.
#include "fw_cuda.h"

// C[M, N] = A[M, K] B[K, N] (float32 in and out, T operands, float32 accumulation), one CTA;
// M, N, K multiples of 16. A sits row-major in shared memory, B transposed (read as a col_major
// matrix_b); each warp computes output tiles and copies them out through a staging tile.
template <class T, bool GOOD>
__global__ void toy_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  FW_DYNAMIC_SMEM(smem);
  const int ld = K + 8;
  T* As = reinterpret_cast<T*>(smem);
  T* Bt = As + M * ld;
  float* stage = reinterpret_cast<float*>(Bt + N * ld);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, nwarps = blockDim.x / 32;
  for (int i = tid; i < M * K; i += blockDim.x) As[(i / K) * ld + i % K] = fw_cvt<T>(A[i]);
  for (int i = tid; i < K * N; i += blockDim.x) Bt[(i % N) * ld + i / N] = fw_cvt<T>(B[i]);
  __syncthreads();
  float* st = stage + 256 * warp;
  for (int tile = warp; tile < (M / 16) * (N / 16); tile += nwarps) {
    const int ti = tile / (N / 16), tj = tile % (N / 16);
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int k0 = 0; k0 < K; k0 += 16) {
      wmma::load_matrix_sync(a, As + 16 * ti * ld + k0, ld);
      wmma::load_matrix_sync(b, Bt + 16 * tj * ld + k0, ld);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(st, acc, 16, wmma::mem_row_major);
    if (GOOD) __syncwarp();  // every lane reads the tile that all lanes stored
    for (int e = lane; e < 256; e += 32) C[(16 * ti + e / 16) * N + 16 * tj + e % 16] = st[e];
    __syncwarp();  // before the next tile's store overwrites the staging tile
  }
}

// Clusters of 4 CTAs of 128 threads: CTA r of cluster g holds x[4 g + r, :] (L floats) in shared
// memory; every CTA writes the cluster's sum over its 4 CTAs, read through distributed shared
// memory in rank order. BUG 1 leaves out the cluster.sync() before the peers' reads, BUG 2 the
// one before the CTAs leave; BUG 3 splits the first into barrier_arrive / barrier_wait around
// independent work (out holds the CTA's own row until the sums replace it), BUG 4 does so but
// reads the peers before waiting.
template <int BUG>
__global__ void __cluster_dims__(4, 1, 1) toy_cluster_sum(const float* x, float* out, int L) {
  FW_DYNAMIC_SMEM(smem);
  cg::cluster_group cluster = cg::this_cluster();
  float* buf = reinterpret_cast<float*>(smem);
  const long long row = blockIdx.x;
  for (int i = threadIdx.x; i < L; i += blockDim.x) buf[i] = x[row * L + i];
  if (BUG == 3 || BUG == 4) {
    cluster.barrier_arrive();
    for (int i = threadIdx.x; i < L; i += blockDim.x) out[row * L + i] = x[row * L + i];
    if (BUG == 3) cluster.barrier_wait();
  } else if (BUG != 1) {
    cluster.sync();  // every CTA's slice is in place before any peer reads it
  }
  for (int i = threadIdx.x; i < L; i += blockDim.x) {
    float s = 0.0f;
    for (unsigned r = 0; r < cluster.num_blocks(); ++r) s += cluster.map_shared_rank(buf, r)[i];
    out[row * L + i] = s;
  }
  if (BUG == 4) cluster.barrier_wait();
  if (BUG != 2) cluster.sync();  // no CTA leaves while a peer may still read its shared memory
}

// Per thread i of a warp: out[0][i] = the warp's sum (xor butterfly), out[1][i] = x[31 - i]
// (__shfl_sync), out[2][i] = x[i + 1] or x[i] for the last lane (__shfl_down_sync).
__global__ void toy_warp_shuffles(const float* x, float* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x, n = gridDim.x * blockDim.x;
  const int lane = threadIdx.x % 32;
  const float v = x[i];
  float s = v;
  for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
  out[i] = s;
  out[n + i] = __shfl_sync(0xffffffffu, v, 31 - lane);
  out[2 * n + i] = __shfl_down_sync(0xffffffffu, v, 1);
}

// out[0] = sum of x[0 .. blockDim.x), summed by thread 0 from shared memory.
template <bool GOOD>
__global__ void toy_block_sum(const float* x, float* out) {
  FW_DYNAMIC_SMEM(smem);
  float* s = reinterpret_cast<float*>(smem);
  s[threadIdx.x] = x[threadIdx.x];
  if (GOOD) __syncthreads();
  if (threadIdx.x == 0) {
    float acc = 0.0f;
    for (unsigned i = 0; i < blockDim.x; ++i) acc += s[i];
    out[0] = acc;
  }
}

// A barrier only half of a warp reaches (which = 0), or the two halves of the block at two
// different barriers (which = 1): both misuse __syncthreads.
__global__ void toy_divergent_barrier(float* out, int which) {
  if (which == 0) {
    if (threadIdx.x < 16) __syncthreads();
  } else {
    if (threadIdx.x < 64)
      __syncthreads();
    else
      __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}

// Misuses the emulator reports (each undefined behaviour on the GPU): 0 the lanes of a warp load
// different tiles, 1 a WMMA pointer not 32-byte aligned, 2 a shuffle after half the warp has
// left, 3 half a warp at __syncwarp and half at a shuffle, 4 a partial warp mask, 5 a
// distributed-shared-memory mapping of a pointer that is not into shared memory, 6 a cluster
// barrier_wait without a barrier_arrive.
__global__ void toy_misuse(float* out, int which) {
  FW_DYNAMIC_SMEM(smem);
  fw_half* h = reinterpret_cast<fw_half*>(smem);
  const int lane = threadIdx.x % 32;
  float v = 0.0f;
  if (which == 0 || which == 1) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, fw_half, wmma::row_major> a;
    wmma::load_matrix_sync(a, h + (which == 0 ? 16 * (lane % 2) : 8), 32);
  } else if (which == 2) {
    if (lane >= 16) return;
    v = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
  } else if (which == 3) {
    if (lane < 16)
      __syncwarp();
    else
      v = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
  } else if (which == 4) {
    __syncwarp(0x0000ffffu);
  } else if (which == 5) {
    v = *cg::this_cluster().map_shared_rank(out, 0);
  } else {
    cg::this_cluster().barrier_wait();
  }
  out[threadIdx.x] = v;
}

// out[i] = shared memory that nobody wrote.
__global__ void toy_read_unwritten(float* out) {
  FW_DYNAMIC_SMEM(smem);
  out[threadIdx.x] = reinterpret_cast<const float*>(smem)[threadIdx.x];
}

// out[0][i], out[1][i]: when thread i ran before and after a __syncthreads (0 = first): the
// emulator's schedule (on the GPU, some order of the warps).
__global__ void toy_schedule(int* counter, int* out) {
  out[threadIdx.x] = atomicAdd(counter, 1);
  __syncthreads();
  out[blockDim.x + threadIdx.x] = atomicAdd(counter, 1) - static_cast<int>(blockDim.x);
}

// `rounds` rounds of __syncwarp, __syncthreads and cluster.sync: the emulator's barrier cost.
__global__ void __cluster_dims__(4, 1, 1) toy_barriers(float* out, int rounds) {
  cg::cluster_group cluster = cg::this_cluster();
  float acc = 0.0f;
  for (int r = 0; r < rounds; ++r) {
    acc += 1.0f;
    __syncwarp();
    __syncthreads();
    cluster.sync();
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

#ifndef FW_EMULATE
template __global__ void toy_matmul<fw_bf16, true>(const float*, const float*, float*, int, int, int);
template __global__ void toy_matmul<fw_half, true>(const float*, const float*, float*, int, int, int);
template __global__ void toy_cluster_sum<0>(const float*, float*, int);
template __global__ void toy_cluster_sum<3>(const float*, float*, int);
template __global__ void toy_block_sum<true>(const float*, float*);
#else
#include <stdint.h>

namespace {
template <class T>
fw_emu::Config matmul_config(int M, int N, int K, unsigned order) {
  const size_t bytes = static_cast<size_t>(M + N) * (K + 8) * sizeof(T) + 4 * 256 * sizeof(float);
  return fw_emu::Config{dim3(1), dim3(128), 1, bytes, order};
}
}  // namespace

// dtype: 0 float32, 1 bfloat16, 2 float16 operands.
extern "C" const char* emu_matmul(int dtype, int good, const float* A, const float* B, float* C,
                                  int M, int N, int K, unsigned order) {
  return fw_emu::catch_error([&] {
    if (M % 16 || N % 16 || K % 16) throw std::invalid_argument("M, N, K must be multiples of 16");
    if (dtype == 0)
      fw_emu::launch(good ? toy_matmul<float, true> : toy_matmul<float, false>,
                     matmul_config<float>(M, N, K, order), A, B, C, M, N, K);
    else if (dtype == 1)
      fw_emu::launch(good ? toy_matmul<fw_bf16, true> : toy_matmul<fw_bf16, false>,
                     matmul_config<fw_bf16>(M, N, K, order), A, B, C, M, N, K);
    else
      fw_emu::launch(good ? toy_matmul<fw_half, true> : toy_matmul<fw_half, false>,
                     matmul_config<fw_half>(M, N, K, order), A, B, C, M, N, K);
  });
}

extern "C" const char* emu_cluster_sum(int bug, const float* x, float* out, int clusters, int L,
                                       unsigned order) {
  return fw_emu::catch_error([&] {
    fw_emu::Config cfg{dim3(4 * clusters), dim3(128), 4, sizeof(float) * L, order};
    void (*kernels[])(const float*, float*, int) = {toy_cluster_sum<0>, toy_cluster_sum<1>,
                                                    toy_cluster_sum<2>, toy_cluster_sum<3>,
                                                    toy_cluster_sum<4>};
    if (bug < 0 || bug > 4) throw std::invalid_argument("bug must be in [0, 4]");
    fw_emu::launch(kernels[bug], cfg, x, out, L);
  });
}

extern "C" const char* emu_warp_shuffles(const float* x, float* out, int blocks, int threads,
                                         unsigned order) {
  return fw_emu::catch_error([&] {
    fw_emu::launch(toy_warp_shuffles, fw_emu::Config{dim3(blocks), dim3(threads), 1, 0, order}, x,
                   out);
  });
}

extern "C" const char* emu_block_sum(int good, const float* x, float* out, int n, unsigned order) {
  return fw_emu::catch_error([&] {
    fw_emu::Config cfg{dim3(1), dim3(n), 1, sizeof(float) * n, order};
    fw_emu::launch(good ? toy_block_sum<true> : toy_block_sum<false>, cfg, x, out);
  });
}

extern "C" const char* emu_divergent_barrier(float* out, int which, unsigned order) {
  return fw_emu::catch_error([&] {
    fw_emu::launch(toy_divergent_barrier, fw_emu::Config{dim3(1), dim3(128), 1, 0, order}, out,
                   which);
  });
}

extern "C" const char* emu_misuse(float* out, int which) {
  return fw_emu::catch_error([&] {
    fw_emu::launch(toy_misuse, fw_emu::Config{dim3(1), dim3(64), 1, 2048, 0}, out, which);
  });
}

extern "C" const char* emu_read_unwritten(float* out, int n) {
  return fw_emu::catch_error([&] {
    fw_emu::launch(toy_read_unwritten, fw_emu::Config{dim3(1), dim3(n), 1, sizeof(float) * n, 0},
                   out);
  });
}

extern "C" const char* emu_barriers(float* out, int rounds, int threads, unsigned order) {
  return fw_emu::catch_error([&] {
    fw_emu::launch(toy_barriers, fw_emu::Config{dim3(4), dim3(threads), 4, 0, order}, out, rounds);
  });
}

extern "C" const char* emu_schedule(int* counter, int* out, int n, unsigned order) {
  return fw_emu::catch_error([&] {
    fw_emu::launch(toy_schedule, fw_emu::Config{dim3(1), dim3(n), 1, 0, order}, counter, out);
  });
}

// The emulator's conversions, for the test against torch's.
extern "C" void emu_convert(const float* x, uint16_t* bf, uint16_t* h, float* bf_back,
                            float* h_back, int n) {
  for (int i = 0; i < n; ++i) {
    const fw_bf16 b = fw_cvt<fw_bf16>(x[i]);
    const fw_half f = fw_cvt<fw_half>(x[i]);
    bf[i] = b.bits;
    h[i] = f.bits;
    bf_back[i] = fw_f32(b);
    h_back[i] = fw_f32(f);
  }
}
#endif
