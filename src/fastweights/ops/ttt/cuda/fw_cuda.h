// Portability header of the project's CUDA C++ kernels: the same kernel source builds with nvcc
// for the GPU, or with g++ and -DFW_EMULATE against the CPU emulator tests/ops/cuda_emu/fw_emu.h
// (on the include path), which provides the same names (docs/cuda_emulation.md).
//
// What a kernel may use: wmma (m16n16k16, float accumulators), cg::this_cluster() (block_rank,
// num_blocks, sync, map_shared_rank), __syncthreads, __syncwarp, __shfl_*_sync (full warp),
// dynamic shared memory declared in the kernel body with FW_DYNAMIC_SMEM(name), the operand
// types fw_bf16 / fw_half and the conversions fw_cvt<T>(float) / fw_f32(x).
#pragma once

#ifdef FW_EMULATE
#include "fw_emu.h"
#else
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

namespace wmma = nvcuda::wmma;
namespace cg = cooperative_groups;

#define FW_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]

typedef __nv_bfloat16 fw_bf16;
typedef __half fw_half;

// float32 -> T, round to nearest even; T -> float32 (exact).
template <class T>
__device__ __forceinline__ T fw_cvt(float x);
template <>
__device__ __forceinline__ float fw_cvt<float>(float x) { return x; }
template <>
__device__ __forceinline__ fw_bf16 fw_cvt<fw_bf16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ fw_half fw_cvt<fw_half>(float x) { return __float2half_rn(x); }
__device__ __forceinline__ float fw_f32(float x) { return x; }
__device__ __forceinline__ float fw_f32(fw_bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float fw_f32(fw_half x) { return __half2float(x); }
#endif

// The WMMA fragments of the kernels: a float32 accumulator tile, and 16 x 16 operand tiles of T
// read row-major or column-major (the transpose of a row-major block).
using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
template <class T>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <class T>
using FragAT = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major>;
template <class T>
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
template <class T>
using FragBT = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
