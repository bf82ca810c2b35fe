// TTT-Linear's dual-form forward at head size 64, one CTA of four warps per (batch, head):
// docs/gpu_ttt_kernels.md, "Four warps per head". Same contract as ops/ttt/triton.py's
// ``_linear_fwd_kernel`` and ops/ttt/triton_resident.py's ``_linear_fwd_res_kernel`` (outputs,
// final weights and bias, a partial last mini-batch's gradient sums, the backward's
// checkpoints), with that kernel's precision rule: every product's operands in the inputs'
// dtype (bfloat16 or float16; float32 only in the CPU emulation), every sum float32.
//
// The tokens of a mini-batch (b <= 16) are the 16 rows of WMMA tiles. Warp w owns the value
// columns [16 w, 16 w + 16): its block of the float32 master W [64, 16] lives in four WMMA
// accumulator fragments (registers) for the whole sequence, its operand copy in the inputs'
// dtype in shared memory. Per mini-batch, with E_ij = tau_i eta_j (j <= i), A = Q K^T [+1]
// (``_qk_kernel``'s), coef = -tau_b (1 for a partial last one):
//   columns (warp w): Zk_w = K W_w, Zq_w = Q W_w                 (8 m16n16k16 products)
//   rows (warp w: rows 4 w .. 4 w + 3, 8 lanes a row, 8 columns a lane): G = dl/dZk (+ b),
//       every LayerNorm statistic a sum in the lane and 3 shuffles in its group of 8
//   columns: Zbar_w = Zq_w - (E * A) G_w, W_w += K^T (coef eta G)_w   (5 products), the
//       bias's update, W_w's operand copy
//   rows, in the next mini-batch's row phase (beside its G, the two LayerNorms' statistics in
//       the same shuffle chains): o = [LN](Zbar + b) [+ q]; the last one's after the loop
// Three CTA barriers a mini-batch, between the column and the row phases (each a hand-over of
// a [16, 64] tile through shared memory; the input rows are double-buffered, the bias
// ping-pongs); the next mini-batch's global loads are issued at the top of this one. The
// one-warp-per-head layout (every phase in one warp, no CTA barrier)
// was built first and estimated at 2.9-3.9 us per mini-batch, issue-bound on one scheduler
// (benchmarks/results/ttt_linear_warp_sass/one_warp_per_head.txt).
//
// Builds: nvcc for sm_90 into a shared library whose C launcher (at the end)
// ops/ttt/linear_cuda.py calls through ctypes, or g++ with -DFW_EMULATE against
// tests/ops/cuda_emu (the emulation entry at the end).
#include <string.h>

#include "fw_cuda.h"
#include "ttt_linear_warp.h"

namespace fw_ttt_linear {

constexpr int D = 64;        // head size (Dk = Dv)
constexpr int BB = 16;       // tokens per mini-batch tile: one WMMA tile of rows
constexpr int NW = 4;        // warps per CTA (one head), each 16 value columns
constexpr int NT = 32 * NW;  // threads per CTA
constexpr int LDF = D + 4;   // row stride of the float [16, 64] tiles
constexpr int LDT = D + 8;   // row stride of the operand tiles (16-byte rows, conflict-free)
constexpr float LN_EPS = 1e-6f;  // ops/ttt/common.py LN_EPS

// Byte offsets of the CTA's shared-memory buffers (128-aligned) for operand type T.
template <class T>
struct Smem {
  static constexpr unsigned long al(unsigned long x) { return (x + 127) / 128 * 128; }
  static constexpr unsigned long stage = 0;                           // float [NW][D][16]
  static constexpr unsigned long wo = stage + al(4ul * NW * D * 16);  // T [D][LDT] W's operand
  static constexpr unsigned long kt = wo + al(sizeof(T) * D * LDT);        // T [2][BB][LDT] K
  static constexpr unsigned long qt = kt + al(sizeof(T) * 2 * BB * LDT);   // T [2][BB][LDT] Q
  static constexpr unsigned long vt = qt + al(sizeof(T) * 2 * BB * LDT);   // T [2][BB][LDT] V
  static constexpr unsigned long gt = vt + al(sizeof(T) * 2 * BB * LDT);   // T [BB][LDT] G
  static constexpr unsigned long hm = gt + al(sizeof(T) * BB * LDT);  // T [BB][LDT] coef eta G
  static constexpr unsigned long mt = hm + al(sizeof(T) * BB * LDT);  // T [BB][BB] -(E*A), col-major
  static constexpr unsigned long zs = mt + al(sizeof(T) * BB * BB);   // float [BB][LDF] Zk
  static constexpr unsigned long zo = zs + al(4ul * BB * LDF);        // float [BB][LDF] Zbar
  static constexpr unsigned long hf = zo + al(4ul * BB * LDF);        // float [BB][LDF] coef eta G
  static constexpr unsigned long bias = hf + al(4ul * BB * LDF);      // float [2][D] (ping-pong)
  static constexpr unsigned long eta = bias + al(4ul * 2 * D);        // float [BB]
  static constexpr unsigned long tau = eta + al(4ul * BB);            // float [BB]
  static constexpr unsigned long bytes = tau + al(4ul * BB);
};


// Raw bits of N bytes (8 or 16), aligned to N: the unit of a thread's vector accesses.
template <int N>
struct alignas(N) Bits {
  unsigned u[N / 4];
};

// 8 elements of T (a lane's share of an input row), 4 elements of T (a quarter of its
// columns in the row phases), as raw bits.
template <class T>
using B8 = Bits<8 * sizeof(T) <= 16 ? 8 * sizeof(T) : 16>;
template <class T>
struct In8 {  // 8 elements of T: one or two 16-byte units
  B8<T> v[8 * sizeof(T) / sizeof(B8<T>)];
};

template <class T>
__device__ __forceinline__ In8<T> ld_in8(const T* p, bool ok) {
  In8<T> c;
  constexpr int n = sizeof(c.v) / sizeof(c.v[0]);
#pragma unroll
  for (int i = 0; i < n; ++i) {
    if (ok) {
      c.v[i] = reinterpret_cast<const B8<T>*>(p)[i];
    } else {
#pragma unroll
      for (int k = 0; k < (int)(sizeof(B8<T>) / 4); ++k) c.v[i].u[k] = 0u;
    }
  }
  return c;
}

template <class T>
__device__ __forceinline__ void st_in8(T* p, const In8<T>& c) {
  constexpr int n = sizeof(c.v) / sizeof(c.v[0]);
#pragma unroll
  for (int i = 0; i < n; ++i) reinterpret_cast<B8<T>*>(p)[i] = c.v[i];
}

// 4 elements of type T at p (aligned to their size) as float32; 4 float32 stored as T.
template <class T>
__device__ __forceinline__ void ld4(const T* p, float (&x)[4]) {
  const Bits<4 * sizeof(T)> b = *reinterpret_cast<const Bits<4 * sizeof(T)>*>(p);
  T t[4];
  memcpy(t, &b, sizeof(t));
#pragma unroll
  for (int e = 0; e < 4; ++e) x[e] = fw_f32(t[e]);
}

template <class T>
__device__ __forceinline__ void st4(T* p, const float (&x)[4]) {
  T t[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) t[e] = fw_cvt<T>(x[e]);
  Bits<4 * sizeof(T)> b;
  memcpy(&b, t, sizeof(t));
  *reinterpret_cast<Bits<4 * sizeof(T)>*>(p) = b;
}

__device__ __forceinline__ void ld4f(const float* p, float (&x)[4]) {
  const Bits<16> b = *reinterpret_cast<const Bits<16>*>(p);
  memcpy(x, &b, 16);
}

__device__ __forceinline__ void st4f(float* p, const float (&x)[4]) {
  Bits<16> b;
  memcpy(&b, x, 16);
  *reinterpret_cast<Bits<16>*>(p) = b;
}

template <class T>
struct Inputs {  // one mini-batch's global loads, held in registers until they are stored
  In8<T> k, q, v;  // row tid / 8, columns 8 (tid % 8) .. + 7
  float eta;       // row tid / 8's
  Bits<8> a;       // A^T's elements 2 tid, 2 tid + 1
};

// Mini-batch n's loads (rows past m and mini-batches past N: zeros).
template <class T>
__device__ __forceinline__ void load_inputs(Inputs<T>& in, const FwTTTLinearWarpArgs& a,
                                            long long bh, long long bb, int h, int n, int tid) {
  const int t0 = n * a.b, r = tid / 8;
  const int m = n < a.N ? (a.b < a.T - t0 ? a.b : a.T - t0) : 0;
  const bool ok = r < m;
  const long long row = ((bb * a.T + t0 + r) * a.H + h) * D + 8 * (tid % 8);
  in.k = ld_in8((const T*)a.k + row, ok);
  in.q = ld_in8((const T*)a.q + row, ok);
  in.v = ld_in8((const T*)a.v + row, ok);
  in.eta = ok ? a.eta[(bb * a.T + t0 + r) * a.H + h] : 0.0f;
  if (n < a.N) {
    in.a = reinterpret_cast<const Bits<8>*>(a.A + ((bh * a.N + n) * BB) * BB)[tid];
  } else {
    in.a.u[0] = 0u;
    in.a.u[1] = 0u;
  }
}

// W_w's operand copy: the warp's four accumulator tiles (W's rows 16 i.., columns 16 w..)
// through its float staging area into wo's column block, in the operand dtype.
template <class T>
__device__ __forceinline__ void to_operand(const Acc (&W)[4], float* stage, T* wo, int w,
                                           int lane) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
    wmma::store_matrix_sync(stage + 256 * i, W[i], 16, wmma::mem_row_major);
  __syncwarp();
  float x[8][4];  // 4-float chunks 32 u + lane of the [64][16] staging area, all loaded first
#pragma unroll
  for (int u = 0; u < 8; ++u) ld4f(stage + 4 * (32 * u + lane), x[u]);
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const int e = 4 * (32 * u + lane), row = e / 16, col = e % 16;
    st4(wo + row * LDT + 16 * w + col, x[u]);
  }
  // (no barrier here: the copy is read, and the staging area written again, after the next
  // mini-batch's first CTA barrier)
}

// Mini-batch n's output row r, the thread's columns: y (its LayerNorm applied) [+ q as loaded]
// stored in the operand dtype, if row r is one of its tokens.
template <class T>
__device__ __forceinline__ void store_output(const FwTTTLinearWarpArgs& a, float (&y)[2][4],
                                             const float (&q)[2][4], bool residual,
                                             long long bb, int h, int n, int r, int j) {
  const int t0 = n * a.b, m = a.b < a.T - t0 ? a.b : a.T - t0;
  if (r >= m) return;
  T* og = (T*)a.o + ((bb * a.T + t0 + r) * a.H + h) * D;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    if (residual)
#pragma unroll
      for (int e = 0; e < 4; ++e) y[c][e] += q[c][e];
    st4(og + 32 * c + 4 * j, y[c]);
  }
}

// The flags are read at run time (uniform branches); FW_LINEAR_ALL_FLAGS (the SASS estimate's
// build, benchmarks/ttt_linear_warp_sass.py) makes them all true at compile time, the layers'
// case, so that the loop's common path is straight-line code.
#ifdef FW_LINEAR_ALL_FLAGS
#define FW_FLAG(x) true
#else
#define FW_FLAG(x) (x)
#endif

// A row's two sums at once (one shuffle chain for both): sa += over a's, sb over b's.
__device__ __forceinline__ void row_sum2(const float (&x)[2][4], const float (&y)[2][4],
                                         float& sa, float& sb) {
  sa = (x[0][0] + x[0][1]) + (x[0][2] + x[0][3]) + ((x[1][0] + x[1][1]) + (x[1][2] + x[1][3]));
  sb = (y[0][0] + y[0][1]) + (y[0][2] + y[0][3]) + ((y[1][0] + y[1][1]) + (y[1][2] + y[1][3]));
#pragma unroll
  for (int m = 1; m < 8; m <<= 1) {
    const float oa = __shfl_xor_sync(0xffffffffu, sa, m);
    const float ob = __shfl_xor_sync(0xffffffffu, sb, m);
    sa += oa;
    sb += ob;
  }
}

// The LayerNorms of two rows held by the same 8 lanes (``layer_norm``), their statistics
// reduced together: x_hat in place, 1 / sqrt(var + eps) of each.
__device__ __forceinline__ void layer_norm2(float (&z)[2][4], float (&y)[2][4], float& rz,
                                            float& ry) {
  float sz, sy;
  row_sum2(z, y, sz, sy);
  const float mz = sz * (1.0f / D), my = sy * (1.0f / D);
  float zc[2][4], yc[2][4];
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      zc[c][e] = (z[c][e] - mz) * (z[c][e] - mz);
      yc[c][e] = (y[c][e] - my) * (y[c][e] - my);
    }
  row_sum2(zc, yc, sz, sy);
  rz = rsqrtf(sz * (1.0f / D) + LN_EPS);
  ry = rsqrtf(sy * (1.0f / D) + LN_EPS);
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      z[c][e] = (z[c][e] - mz) * rz;
      y[c][e] = (y[c][e] - my) * ry;
    }
}

template <class T>
__global__ void __launch_bounds__(NT, 1) ttt_linear_warp_fwd(FwTTTLinearWarpArgs a) {
  using L = Smem<T>;
  FW_DYNAMIC_SMEM(smem);
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32;
  const long long bh = blockIdx.x;
  const int H = a.H, h = (int)(bh % H);
  const long long bb = bh / H;
  float* stage = (float*)(smem + L::stage) + w * D * 16;
  T* wo = (T*)(smem + L::wo);
  T* kt2 = (T*)(smem + L::kt);
  T* qt2 = (T*)(smem + L::qt);
  T* vt2 = (T*)(smem + L::vt);
  T* gt = (T*)(smem + L::gt);
  T* hm = (T*)(smem + L::hm);
  T* mt = (T*)(smem + L::mt);
  float* zs = (float*)(smem + L::zs);
  float* zo = (float*)(smem + L::zo);
  float* hf = (float*)(smem + L::hf);
  float* bias = (float*)(smem + L::bias);
  float* eta_s = (float*)(smem + L::eta);
  float* tau_s = (float*)(smem + L::tau);

  const bool has_bias = FW_FLAG(a.has_bias), has_ln = FW_FLAG(a.has_ln);
  const bool has_lnb = FW_FLAG(a.has_lnb), residual = FW_FLAG(a.residual);
  // the thread's row and columns in the row phases: row r, columns 32 c + 4 j + {0..3}
  const int r = tid / 8, j = tid % 8;
  const int NC = (a.NF + a.seg - 1) / a.seg;
  const float tau_b = a.tau[h * a.b + a.b - 1];
  float* wg = a.w + bh * D * D;

  Inputs<T> in;
  load_inputs(in, a, bh, bb, h, 0, tid);
  float gam[2][4], bet[2][4];  // the LayerNorm's gain and bias at the thread's columns
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = 32 * c + 4 * j + e;
      gam[c][e] = has_ln ? a.lnw[h * D + col] : 1.0f;
      bet[c][e] = has_lnb ? a.lnb[h * D + col] : 0.0f;
    }
  if (tid < D) {
    bias[tid] = has_bias ? a.b0[bh * D + tid] : 0.0f;
    bias[D + tid] = 0.0f;
  }
  if (tid < BB) tau_s[tid] = tid < a.b ? a.tau[h * a.b + tid] : 0.0f;
  // the warp's block of the master: W[i] = W's rows 16 i.., columns 16 w..
  Acc W[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    wmma::load_matrix_sync(W[i], wg + (16 * i) * D + 16 * w, D, wmma::mem_row_major);
  to_operand(W, stage, wo, w, lane);

  // Mini-batch n's read-out o = [LN](Zbar + b) [+ q] is formed in the next one's row phase
  // (or after the loop), beside that one's loss gradient: the two LayerNorms' shuffle chains
  // run together. Zbar waits in zo, its q rows in the other buffer of qt.
  for (int n = 0; n < a.N; ++n) {
    const bool tail = n >= a.NF;
    const float coef = tail ? 1.0f : -tau_b;
    T* kt = kt2 + (n % 2) * BB * LDT;
    T* qt = qt2 + (n % 2) * BB * LDT;
    T* vt = vt2 + (n % 2) * BB * LDT;
    const float* bcur = bias + D * (n % 2);  // this mini-batch's start bias
    float* bprev = bias + D * ((n + 1) % 2);  // the previous one's, then the next one's

    // 0. the checkpoint of the weights entering this mini-batch (every seg-th full one)
    const bool ck = a.store_ck && !tail && n % a.seg == 0;
    if (ck) {
      const long long c = bh * NC + n / a.seg;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        wmma::store_matrix_sync(a.ckw + c * D * D + (16 * i) * D + 16 * w, W[i], D,
                                wmma::mem_row_major);
    }

    // 1. this mini-batch's rows into shared memory, the next one's loads issued
    st_in8(kt + r * LDT + 8 * j, in.k);
    st_in8(qt + r * LDT + 8 * j, in.q);
    st_in8(vt + r * LDT + 8 * j, in.v);
    const float eta_r = in.eta;  // the thread's row's eta
    if (j == 0) eta_s[r] = eta_r;
    float at[2];
    memcpy(at, &in.a, sizeof(at));
    load_inputs(in, a, bh, bb, h, n + 1, tid);
    __syncthreads();

    // 2. -(E * A) as the left operand of Zbar's product, column-major: element (i, jj) at
    //    mt[16 jj + i] = -(tau_i eta_jj A_i,jj) for jj <= i (A^T's element 2 tid + e is
    //    (jj, i)); Zk_w = K W_w, Zq_w = Q W_w, each as two chains of two products (Zk_w
    //    through shared memory to the rows); the row phase's operands from shared memory
    if (has_bias && ck && tid < D) a.ckb[(bh * NC + n / a.seg) * D + tid] = bcur[tid];
    {
      float mv[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int f = 2 * tid + e, jj = f / 16, i = f % 16;
        mv[e] = jj <= i ? -((tau_s[i] * eta_s[jj]) * at[e]) : 0.0f;
      }
      mt[2 * tid] = fw_cvt<T>(mv[0]);
      mt[2 * tid + 1] = fw_cvt<T>(mv[1]);
    }
    Acc zq;
    {
      Acc zk, zk1, zq1;
      wmma::fill_fragment(zk, 0.0f);
      wmma::fill_fragment(zq, 0.0f);
      wmma::fill_fragment(zk1, 0.0f);
      wmma::fill_fragment(zq1, 0.0f);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        FragA<T> fk, fq;
        FragB<T> fw;
        wmma::load_matrix_sync(fk, kt + 16 * c, LDT);
        wmma::load_matrix_sync(fq, qt + 16 * c, LDT);
        wmma::load_matrix_sync(fw, wo + (16 * c) * LDT + 16 * w, LDT);
        if (c < 2) {
          wmma::mma_sync(zk, fk, fw, zk);
          wmma::mma_sync(zq, fq, fw, zq);
        } else {
          wmma::mma_sync(zk1, fk, fw, zk1);
          wmma::mma_sync(zq1, fq, fw, zq1);
        }
      }
#pragma unroll
      for (int i = 0; i < zk.num_elements; ++i) {  // elementwise: the same on both layouts
        zk.x[i] += zk1.x[i];
        zq.x[i] += zq1.x[i];
      }
      wmma::store_matrix_sync(zs + 16 * w, zk, LDF, wmma::mem_row_major);
    }
    float tg[2][4], bk[2][4], bo[2][4], qo[2][4];  // target, both biases, the previous q
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = 32 * c + 4 * j;
      float v4[4], k4[4];
      ld4(vt + r * LDT + col, v4);
      ld4(kt + r * LDT + col, k4);
      ld4f(bcur + col, bk[c]);
      ld4f(bprev + col, bo[c]);
      ld4(qt2 + ((n + 1) % 2) * BB * LDT + r * LDT + col, qo[c]);
#pragma unroll
      for (int e = 0; e < 4; ++e) tg[c][e] = residual ? v4[e] - k4[e] : v4[e];
    }
    __syncthreads();

    // 3. G = dl/dZk for the thread's row and columns (docs/maths.md 2.2): G and coef eta G as
    //    operands, coef eta G in float32 for the bias; the previous mini-batch's output
    {
      float z[2][4], y[2][4];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = 32 * c + 4 * j;
        ld4f(zs + r * LDF + col, z[c]);
        ld4f(zo + r * LDF + col, y[c]);  // (not yet written before the first mini-batch)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          z[c][e] += bk[c][e];
          y[c][e] += bo[c][e];
        }
      }
      float G[2][4];
      if (has_ln) {
        float rs, ro;
        layer_norm2(z, y, rs, ro);  // z, y are x_hat now
        float g[2][4], gx[2][4];
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            g[c][e] = gam[c][e] * (gam[c][e] * z[c][e] + bet[c][e] - tg[c][e]);
            gx[c][e] = g[c][e] * z[c][e];
            y[c][e] = gam[c][e] * y[c][e] + bet[c][e];
          }
        float mg, mgx;
        row_sum2(g, gx, mg, mgx);
        mg *= 1.0f / D;
        mgx *= 1.0f / D;
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
          for (int e = 0; e < 4; ++e) G[c][e] = rs * (g[c][e] - mg - z[c][e] * mgx);
      } else {
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
          for (int e = 0; e < 4; ++e) G[c][e] = z[c][e] - tg[c][e];
      }
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = 32 * c + 4 * j;
        float hv[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) hv[e] = (G[c][e] * eta_r) * coef;
        st4(gt + r * LDT + col, G[c]);
        st4(hm + r * LDT + col, hv);
        if (has_bias) st4f(hf + r * LDF + col, hv);
      }
      if (n > 0) store_output<T>(a, y, qo, residual, bb, h, n - 1, r, j);
    }
    __syncthreads();

    // 4. Zbar_w = Zq_w - (E * A) G_w (without the bias) into zo; W_w += K^T (coef eta G)_w
    //    with W_w's tiles as the accumulators (a partial last mini-batch: the sums S stored);
    //    the bias's column sums (lanes < 16: column 16 w + lane) and the next bias; W_w's
    //    operand copy
    {
      FragAT<T> fm;
      FragB<T> fg, fh;
      wmma::load_matrix_sync(fm, mt, BB);
      wmma::load_matrix_sync(fg, gt + 16 * w, LDT);
      wmma::load_matrix_sync(fh, hm + 16 * w, LDT);
      FragAT<T> fk[4];  // K^T's rows 16 i..: element (d, t) at kt[t LDT + 16 i + d]
#pragma unroll
      for (int i = 0; i < 4; ++i) wmma::load_matrix_sync(fk[i], kt + 16 * i, LDT);
      wmma::mma_sync(zq, fm, fg, zq);
      if (!tail) {
#pragma unroll
        for (int i = 0; i < 4; ++i) wmma::mma_sync(W[i], fk[i], fh, W[i]);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          Acc s;
          wmma::fill_fragment(s, 0.0f);
          wmma::mma_sync(s, fk[i], fh, s);
          wmma::store_matrix_sync(a.sw + bh * D * D + (16 * i) * D + 16 * w, s, D,
                                  wmma::mem_row_major);
        }
      }
      wmma::store_matrix_sync(zo + 16 * w, zq, LDF, wmma::mem_row_major);
    }
    if (has_bias) {  // lane l: column 16 w + l % 16, rows 8 (l / 16) .. + 7, then both halves
      const int col = 16 * w + lane % 16, t0 = 8 * (lane / 16);
      float db = 0.0f;
#pragma unroll
      for (int t = 0; t < BB / 2; ++t) db += hf[(t0 + t) * LDF + col];
      db += __shfl_xor_sync(0xffffffffu, db, 16);
      if (lane < 16) {
        if (!tail)
          bprev[col] = bcur[col] + db;  // the previous bias was read above, before the barrier
        else
          a.sb[bh * D + col] = db;
      }
    }
    if (!tail) to_operand(W, stage, wo, w, lane);
  }

  // the last mini-batch's output; the weights and bias after the last full mini-batch
  __syncthreads();  // every warp's share of Zbar and of the bias written
  if (a.N > 0) {
    const int n = a.N - 1;
    float y[2][4], yd[2][4], qo[2][4];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = 32 * c + 4 * j;
      float b4[4];
      ld4f(zo + r * LDF + col, y[c]);
      ld4f(bias + D * (n % 2) + col, b4);
      ld4(qt2 + (n % 2) * BB * LDT + r * LDT + col, qo[c]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        y[c][e] += b4[e];
        yd[c][e] = y[c][e];
      }
    }
    if (has_ln) {
      float r1, r2;
      layer_norm2(y, yd, r1, r2);
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) y[c][e] = gam[c][e] * y[c][e] + bet[c][e];
    }
    store_output<T>(a, y, qo, residual, bb, h, n, r, j);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
    wmma::store_matrix_sync(wg + (16 * i) * D + 16 * w, W[i], D, wmma::mem_row_major);
  if (has_bias && tid < D) a.bias[bh * D + tid] = bias[D * (a.NF % 2) + tid];
}

}  // namespace fw_ttt_linear

#ifndef FW_EMULATE
// CUDA launcher (sm_90): one CTA of NW warps per (batch, head). dtype 1 bfloat16, 2 float16.
// Returns a cudaError_t (cudaErrorInvalidValue for another dtype).
namespace fw_ttt_linear {
template <class T>
static cudaError_t launch(const FwTTTLinearWarpArgs& a, cudaStream_t stream) {
  const int bytes = (int)Smem<T>::bytes;
  auto kernel = ttt_linear_warp_fwd<T>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  kernel<<<(unsigned)(a.B * a.H), NT, bytes, stream>>>(a);
  return cudaGetLastError();
}
}  // namespace fw_ttt_linear

extern "C" int fw_ttt_linear_warp_launch(const FwTTTLinearWarpArgs* a, int dtype, void* stream) {
  cudaStream_t s = (cudaStream_t)stream;
  if (dtype == 1) return (int)fw_ttt_linear::launch<fw_bf16>(*a, s);
  if (dtype == 2) return (int)fw_ttt_linear::launch<fw_half>(*a, s);
  return (int)cudaErrorInvalidValue;
}

extern "C" const char* fw_ttt_linear_warp_error(int code) {
  return cudaGetErrorString((cudaError_t)code);
}
#endif

#ifdef FW_EMULATE
// CPU emulation entry (tests/ops/cuda_emu, docs/cuda_emulation.md): dtype 0 float32 (exact
// float32 products, emulation only), 1 bfloat16, 2 float16. Returns nullptr or the error's
// message.
namespace fw_ttt_linear {
template <class T>
static void emulate(const FwTTTLinearWarpArgs& a, unsigned order) {
  fw_emu::Config cfg{dim3((unsigned)(a.B * a.H)), dim3(NT), 1, (size_t)Smem<T>::bytes, order};
  fw_emu::launch(ttt_linear_warp_fwd<T>, cfg, a);
}
}  // namespace fw_ttt_linear

extern "C" const char* fw_emu_ttt_linear_warp_fwd(const FwTTTLinearWarpArgs* a, int dtype,
                                                  unsigned order) {
  return fw_emu::catch_error([&] {
    if (dtype == 0)
      fw_ttt_linear::emulate<float>(*a, order);
    else if (dtype == 1)
      fw_ttt_linear::emulate<fw_bf16>(*a, order);
    else if (dtype == 2)
      fw_ttt_linear::emulate<fw_half>(*a, order);
    else
      throw std::invalid_argument("dtype must be 0 (float32), 1 (bfloat16) or 2 (float16)");
  });
}

// The dynamic shared memory a CTA takes (bytes), dtype as above.
extern "C" unsigned long fw_emu_ttt_linear_warp_smem(int dtype) {
  return dtype == 0 ? fw_ttt_linear::Smem<float>::bytes : fw_ttt_linear::Smem<fw_bf16>::bytes;
}
#endif
