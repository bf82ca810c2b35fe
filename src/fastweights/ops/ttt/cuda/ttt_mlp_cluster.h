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

// The arguments of the backward's sequential pass on a cluster (ttt_mlp_cluster.cu,
// ``ttt_mlp_cluster_bwd_b``): one launch of ops/ttt/triton.py's ``_mlp_bwd_b_kernel`` over a
// full segment (mini-batches n1-1 down to n0), the same tensors (its rows written by
// ``_mlp_bwd_a_kernel``), the arithmetic of ops/ttt/cluster_bwd_model.py.
struct FwTTTMLPClusterBwdArgs {
  const void* q;      // [B, T, H, D] in the operand dtype
  const void* k;      // [B, T, H, D]
  const void* v;      // [B, T, H, D]
  const float* eta;   // [B, T, H]
  const float* tau;   // [H, b]
  const float* A;     // [B*H, N, 16, 16]: the scores tiles A1^T (+1 with b1)
  const float* lnw;   // [H, D] (read when has_ln)
  const float* lnb;   // [H, D] (read when has_lnb)
  const float* w1;    // slots [., D, Dh]: mini-batch n0 + j's start weights at bh * w_bh + j * w_j
  const float* w2;    // slots [., Dh, D]
  float* dw1;         // [B*H, D, Dh]: the carried gradients, in and out
  float* db1;         // [B*H, Dh]
  float* dw2;         // [B*H, Dh, D]
  float* db2;         // [B*H, D]
  const float* hs;    // [B*H, seg, 4, Dh, 16]: Z1, A, Zbar1, dZbar1 (hidden rows, transposed)
  const float* vs;    // [B*H, seg, 5, D, 16]: G2, dZbar2, dG2's read-out share, x_hat, g
  const float* rr;    // [B*H, seg, 16]: 1 / s of the keys' LayerNorm
  const float* at;    // [B*H, seg, 16, 16]: dA2^T
  float* acc;         // [B*H, 2, D]: dgamma, dbeta (added to)
  float* dtau;        // [B*H, 16]: tau_b's share at b - 1 (added to)
  float* dk;          // [B, T, H, D] float32 (added to)
  float* dv;          // [B, T, H, D] float32 (written)
  float* deta;        // [B, T, H] float32 (added to)
  int B, T, H, b, N, n0, n1, seg, w_bh, w_j;
  int has_b1, has_b2, has_ln, has_lnb, residual;
};

// The arguments of the read-out's backward on a cluster (ttt_mlp_cluster.cu,
// ``ttt_mlp_cluster_bwd_a``): one launch of ops/ttt/triton.py's ``_mlp_bwd_a_kernel`` over a
// full segment (mini-batches n0 .. n1-1, one cluster each, in parallel), the same tensors: it
// writes the rows ``_mlp_bwd_b_kernel`` / ``ttt_mlp_cluster_bwd_b`` read, dq and the read-out's
// shares of dk, deta, dtau, dgamma and dbeta.
struct FwTTTMLPClusterBwdAArgs {
  const void* q;      // [B, T, H, D] in the operand dtype
  const void* k;      // [B, T, H, D]
  const void* v;      // [B, T, H, D]
  const float* eta;   // [B, T, H]
  const float* tau;   // [H, b]
  const float* A;     // [B*H, N, 16, 16]: the scores tiles A1^T (+1 with b1)
  const float* lnw;   // [H, D] (read when has_ln)
  const float* lnb;   // [H, D] (read when has_lnb)
  const float* w1;    // slots [., D, Dh]: mini-batch n0 + j's start weights at bh * w_bh + j * w_j
  const float* b1;    // slots [., Dh] (read when has_b1)
  const float* w2;    // slots [., Dh, D]
  const float* b2;    // slots [., D] (read when has_b2)
  const float* dout;  // [B, T, H, D] float32: the outputs' gradient
  float* hs;          // [B*H, seg, 4, Dh, 16]: Z1, A, Zbar1, dZbar1 (hidden rows, transposed; written)
  float* vs;          // [B*H, seg, 5, D, 16]: G2, dZbar2, dG2's read-out share, x_hat, g (written)
  float* rr;          // [B*H, seg, 16]: 1 / s of the keys' LayerNorm (written when has_ln)
  float* at;          // [B*H, seg, 16, 16]: dA2^T (written)
  float* acc;         // [B*H, N, 2, D]: dgamma, dbeta of each mini-batch (written when has_ln)
  float* dtau;        // [B*H, N, 16]: tau's gradient from each mini-batch's read-out (written)
  float* dq;          // [B, T, H, D] float32 (written)
  float* dk;          // [B, T, H, D] float32: the read-out's share (written)
  float* deta;        // [B, T, H] float32: the read-out's share (written)
  int B, T, H, b, N, n0, n1, seg, w_bh, w_j;
  int has_b1, has_b2, has_ln, has_lnb, residual;
};
