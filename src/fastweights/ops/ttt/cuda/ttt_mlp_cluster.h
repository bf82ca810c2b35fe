// The arguments of the TTT-MLP cluster forward (ttt_mlp_cluster.cu), shared by the kernel, its
// CUDA launcher (called through ctypes, ops/ttt/cluster.py) and the CPU emulation entry (docs/gpu_ttt_kernels.md,
// "TTT-MLP on a thread-block cluster"). Plain C layout: the emulation tests fill it through
// ctypes (tests/ops/test_ttt_cluster_kernel.py mirrors the field order).
//
// Dimension legend: B batch, T time, H heads, D = Dk = Dv head size, Dh = 4 D hidden units,
// b mini-batch size (<= 16), N = ceil(T / b) mini-batches, NF = floor(T / b) full ones,
// NC = ceil(NF / seg) checkpoints.
#pragma once

struct FwTTTMLPClusterArgs {
  const void* q;    // [B, T, H, D] in the operand dtype
  const void* k;    // [B, T, H, D]
  const void* v;    // [B, T, H, D]
  const float* eta;  // [B, T, H]
  const float* tau;  // [H, b]
  const float* lnw;  // [H, D] (read when has_ln)
  const float* lnb;  // [H, D] (read when has_lnb)
  float* w1;  // [B*H, D, Dh]: the start weights in, the weights after the last full mini-batch out
  float* c1;  // [B*H, Dh] (zeros without b1)
  float* w2;  // [B*H, Dh, D]
  float* c2;  // [B*H, D] (zeros without b2)
  void* o;    // [B, T, H, D] in the operand dtype
  float* s1;   // [B*H, D, Dh]: gradient sums of a last partial mini-batch (written if NF < N)
  float* sb1;  // [B*H, Dh]
  float* s2;   // [B*H, Dh, D]
  float* sb2;  // [B*H, D]
  float* ck1;   // [B*H, NC, D, Dh]: the weights entering every seg-th mini-batch (store_ck)
  float* ckb1;  // [B*H, NC, Dh]
  float* ck2;   // [B*H, NC, Dh, D]
  float* ckb2;  // [B*H, NC, D]
  int B, T, H, b, N, NF, seg, store_ck;
  int has_b1, has_b2, has_ln, has_lnb, residual;
};
