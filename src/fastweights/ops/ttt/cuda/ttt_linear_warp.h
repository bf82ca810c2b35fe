// The arguments of the TTT-Linear warp forward (ttt_linear_warp.cu), shared by the kernel, its
// CUDA launcher (called through ctypes, ops/ttt/linear_cuda.py) and the CPU emulation entry
// (docs/gpu_ttt_kernels.md, "Four warps per head"). Plain C layout, the order of
// ops/ttt/triton.py ``_linear_fwd_kernel``'s pointer arguments; tests/ops/test_ttt_linear_cuda.py
// checks ops/ttt/linear_cuda.py's field names against it.
//
// Dimension legend: B batch, T time, H heads, D = Dk = Dv = 64 head size, b mini-batch size
// (<= 16), N = ceil(T / b) mini-batches, NF = floor(T / b) full ones, NC = ceil(NF / seg)
// checkpoints.
#pragma once

struct FwTTTLinearWarpArgs {
  const void* q;     // [B, T, H, D] in the operand dtype
  const void* k;     // [B, T, H, D]
  const void* v;     // [B, T, H, D]
  const float* eta;  // [B, T, H]
  const float* tau;  // [H, b]
  const float* A;    // [B*H, N, 16, 16]: the scores A^T = (Q K^T [+1])^T of ``_qk_kernel``
  const float* lnw;  // [H, D] (read when has_ln)
  const float* lnb;  // [H, D] (read when has_lnb)
  const float* b0;   // [B*H, D] the start bias (read when has_bias)
  void* o;           // [B, T, H, D] in the operand dtype
  float* w;     // [B*H, D, D]: the start weights in, the weights after the last full mini-batch out
  float* bias;  // [B*H, D]: the bias after the last full mini-batch (written when has_bias)
  float* sw;    // [B*H, D, D]: gradient sums S = K^T (eta G) of a last partial mini-batch
  float* sb;    // [B*H, D]: s = sum eta G (when has_bias)
  float* ckw;   // [B*H, NC, D, D]: the weights entering every seg-th mini-batch (store_ck)
  float* ckb;   // [B*H, NC, D] (store_ck and has_bias)
  int B, T, H, b, N, NF, seg, store_ck;
  int has_bias, has_ln, has_lnb, residual;
};
