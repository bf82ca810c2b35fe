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
//   columns: Zbar_w = Zq_w - (E * A) G_w, W_w += K^T (coef eta G)_w   (5 products)
//   rows: o = [LN](Zbar + b) [+ q]; columns: the bias's update, W_w's operand copy
// Four CTA barriers a mini-batch, between the column and the row phases (each a hand-over of
// a [16, 64] tile through shared memory); the next mini-batch's global loads are issued at
// the top of this one. The one-warp-per-head layout (every phase in one warp, no CTA barrier)
// was built first and estimated at 2.9-3.6 us per mini-batch, issue-bound on one scheduler
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
  static constexpr unsigned long kt = wo + al(sizeof(T) * D * LDT);   // T [BB][LDT] K rows
  static constexpr unsigned long qt = kt + al(sizeof(T) * BB * LDT);  // T [BB][LDT] Q rows
  static constexpr unsigned long vt = qt + al(sizeof(T) * BB * LDT);  // T [BB][LDT] V rows
  static constexpr unsigned long gt = vt + al(sizeof(T) * BB * LDT);  // T [BB][LDT] G
  static constexpr unsigned long hm = gt + al(sizeof(T) * BB * LDT);  // T [BB][LDT] coef eta G
  static constexpr unsigned long mt = hm + al(sizeof(T) * BB * LDT);  // T [BB][BB] -(E*A), col-major
  static constexpr unsigned long zs = mt + al(sizeof(T) * BB * BB);   // float [BB][LDF] Zk, Zbar
  static constexpr unsigned long hf = zs + al(4ul * BB * LDF);        // float [BB][LDF] coef eta G
  static constexpr unsigned long bias = hf + al(4ul * BB * LDF);      // float [2][D] (ping-pong)
  static constexpr unsigned long gam = bias + al(4ul * 2 * D);        // float [D]
  static constexpr unsigned long bet = gam + al(4ul * D);             // float [D]
  static constexpr unsigned long eta = bet + al(4ul * D);             // float [BB]
  static constexpr unsigned long tau = eta + al(4ul * BB);            // float [BB]
  static constexpr unsigned long bytes = tau + al(4ul * BB);
};

using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
template <class T>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <class T>
using FragAT = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major>;
template <class T>
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;

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

// A row's sum over its 8 lanes (a lane's 8 values, then lanes ^ 1, ^ 2, ^ 4).
__device__ __forceinline__ float row_sum(const float (&x)[2][4]) {
  float s = (x[0][0] + x[0][1]) + (x[0][2] + x[0][3]) + ((x[1][0] + x[1][1]) + (x[1][2] + x[1][3]));
#pragma unroll
  for (int m = 1; m < 8; m <<= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
  return s;
}

// LayerNorm of a row held by 8 lanes (ops/ttt/triton_tiles.py ``_ln``): x_hat in place, and
// 1 / sqrt(var + eps) (biased variance).
__device__ __forceinline__ float layer_norm(float (&z)[2][4]) {
  const float mu = row_sum(z) * (1.0f / D);
  float zc[2][4];
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) zc[c][e] = (z[c][e] - mu) * (z[c][e] - mu);
  const float r = 1.0f / sqrtf(row_sum(zc) * (1.0f / D) + LN_EPS);
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) z[c][e] = (z[c][e] - mu) * r;
  return r;
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
#pragma unroll
  for (int u = 0; u < 8; ++u) {  // 4-float chunks 32 u + lane of the [64][16] staging area
    const int e = 4 * (32 * u + lane), row = e / 16, col = e % 16;
    float x[4];
    ld4f(stage + e, x);
    st4(wo + row * LDT + 16 * w + col, x);
  }
  __syncwarp();
}

// The flags are read at run time (uniform branches); FW_LINEAR_ALL_FLAGS (the SASS estimate's
// build, benchmarks/ttt_linear_warp_sass.py) makes them all true at compile time, the layers'
// case, so that the loop's common path is straight-line code.
#ifdef FW_LINEAR_ALL_FLAGS
#define FW_FLAG(x) true
#else
#define FW_FLAG(x) (x)
#endif

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
  T* kt = (T*)(smem + L::kt);
  T* qt = (T*)(smem + L::qt);
  T* vt = (T*)(smem + L::vt);
  T* gt = (T*)(smem + L::gt);
  T* hm = (T*)(smem + L::hm);
  T* mt = (T*)(smem + L::mt);
  float* zs = (float*)(smem + L::zs);
  float* hf = (float*)(smem + L::hf);
  float* bias = (float*)(smem + L::bias);
  float* gam = (float*)(smem + L::gam);
  float* bet = (float*)(smem + L::bet);
  float* eta_s = (float*)(smem + L::eta);
  float* tau_s = (float*)(smem + L::tau);

  const bool has_bias = FW_FLAG(a.has_bias), has_ln = FW_FLAG(a.has_ln);
  const bool has_lnb = FW_FLAG(a.has_lnb), residual = FW_FLAG(a.residual);
  // the thread's row and columns in the row phases: row r, columns 4 j + {0..3} and
  // 32 + 4 j + {0..3}
  const int r = tid / 8, j = tid % 8;
  const int NC = (a.NF + a.seg - 1) / a.seg;
  const float tau_b = a.tau[h * a.b + a.b - 1];
  float* wg = a.w + bh * D * D;

  Inputs<T> in;
  load_inputs(in, a, bh, bb, h, 0, tid);
  if (tid < D) {
    bias[tid] = has_bias ? a.b0[bh * D + tid] : 0.0f;
    gam[tid] = has_ln ? a.lnw[h * D + tid] : 1.0f;
    bet[tid] = has_lnb ? a.lnb[h * D + tid] : 0.0f;
  }
  if (tid < BB) tau_s[tid] = tid < a.b ? a.tau[h * a.b + tid] : 0.0f;
  // the warp's block of the master: W[i] = W's rows 16 i.., columns 16 w..
  Acc W[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    wmma::load_matrix_sync(W[i], wg + (16 * i) * D + 16 * w, D, wmma::mem_row_major);
  to_operand(W, stage, wo, w, lane);

  for (int n = 0; n < a.N; ++n) {
    const bool tail = n >= a.NF;
    const int t0 = n * a.b;
    const int m = a.b < a.T - t0 ? a.b : a.T - t0;
    const float coef = tail ? 1.0f : -tau_b;
    const float* bcur = bias + D * (n % 2);  // the mini-batch's start bias; the next one's
    float* bnxt = bias + D * ((n + 1) % 2);

    // 0. the checkpoint of the weights entering this mini-batch (every seg-th full one)
    if (a.store_ck && !tail && n % a.seg == 0) {
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
    if (has_bias && a.store_ck && !tail && n % a.seg == 0 && tid < D)  // the bias's, after the
      a.ckb[(bh * NC + n / a.seg) * D + tid] = bcur[tid];                // other warps wrote it

    // 2. -(E * A) as the left operand of Zbar's product, column-major: element (i, jj) at
    //    mt[16 jj + i] = -(tau_i eta_jj A_i,jj) for jj <= i (A^T's element 2 tid + e is
    //    (jj, i)); Zk_w = K W_w, Zq_w = Q W_w (Zk_w through shared memory to the rows)
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
      Acc zk;
      wmma::fill_fragment(zk, 0.0f);
      wmma::fill_fragment(zq, 0.0f);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        FragA<T> fk, fq;
        FragB<T> fw;
        wmma::load_matrix_sync(fk, kt + 16 * c, LDT);
        wmma::load_matrix_sync(fq, qt + 16 * c, LDT);
        wmma::load_matrix_sync(fw, wo + (16 * c) * LDT + 16 * w, LDT);
        wmma::mma_sync(zk, fk, fw, zk);
        wmma::mma_sync(zq, fq, fw, zq);
      }
      wmma::store_matrix_sync(zs + 16 * w, zk, LDF, wmma::mem_row_major);
    }
    __syncthreads();

    // 3. G = dl/dZk for the thread's row and columns (docs/maths.md 2.2): G and coef eta G as
    //    operands, coef eta G in float32 for the bias
    {
      float z[2][4], tg[2][4];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = 32 * c + 4 * j;
        float b4[4], v4[4];
        ld4f(zs + r * LDF + col, z[c]);
        ld4f(bcur + col, b4);
        ld4(vt + r * LDT + col, v4);
        if (residual) {
          float k4[4];
          ld4(kt + r * LDT + col, k4);
#pragma unroll
          for (int e = 0; e < 4; ++e) tg[c][e] = v4[e] - k4[e];
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) tg[c][e] = v4[e];
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) z[c][e] += b4[e];
      }
      float G[2][4];
      if (has_ln) {
        const float rs = layer_norm(z);  // z is x_hat now
        float g[2][4], gx[2][4];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = 32 * c + 4 * j;
          float gm[4], bt[4];
          ld4f(gam + col, gm);
          ld4f(bet + col, bt);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            g[c][e] = gm[e] * (gm[e] * z[c][e] + bt[e] - tg[c][e]);
            gx[c][e] = g[c][e] * z[c][e];
          }
        }
        const float mg = row_sum(g) * (1.0f / D), mgx = row_sum(gx) * (1.0f / D);
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
    }
    __syncthreads();

    // 4. Zbar_w = Zq_w - (E * A) G_w (without the bias); W_w += K^T (coef eta G)_w with W_w's
    //    tiles as the accumulators (a partial last mini-batch: the sums S stored); the
    //    bias's column sums (lanes < 16: column 16 w + lane)
    {
      FragAT<T> fm;
      FragB<T> fg, fh;
      wmma::load_matrix_sync(fm, mt, BB);
      wmma::load_matrix_sync(fg, gt + 16 * w, LDT);
      wmma::mma_sync(zq, fm, fg, zq);
      wmma::store_matrix_sync(zs + 16 * w, zq, LDF, wmma::mem_row_major);
      wmma::load_matrix_sync(fh, hm + 16 * w, LDT);
      FragAT<T> fk[4];  // K^T's rows 16 i..: element (d, t) at kt[t LDT + 16 i + d]
#pragma unroll
      for (int i = 0; i < 4; ++i) wmma::load_matrix_sync(fk[i], kt + 16 * i, LDT);
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
    }
    float db = 0.0f;  // lanes < 16: the sum over the tokens of column 16 w + lane
    if (has_bias && lane < 16) {
#pragma unroll
      for (int t = 0; t < BB; ++t) db += hf[t * LDF + 16 * w + lane];
    }
    __syncthreads();

    // 5. o = [LN](Zbar + b) [+ q] for the thread's row and columns; the next bias (or the
    //    sum); W_w's operand copy
    {
      float z[2][4];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = 32 * c + 4 * j;
        float b4[4];
        ld4f(zs + r * LDF + col, z[c]);
        ld4f(bcur + col, b4);
#pragma unroll
        for (int e = 0; e < 4; ++e) z[c][e] += b4[e];
      }
      if (has_ln) {
        layer_norm(z);
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = 32 * c + 4 * j;
          float gm[4], bt[4];
          ld4f(gam + col, gm);
          ld4f(bet + col, bt);
#pragma unroll
          for (int e = 0; e < 4; ++e) z[c][e] = gm[e] * z[c][e] + bt[e];
        }
      }
      if (r < m) {
        T* og = (T*)a.o + ((bb * a.T + t0 + r) * H + h) * D;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = 32 * c + 4 * j;
          if (residual) {
            float q4[4];
            ld4(qt + r * LDT + col, q4);  // q's row as loaded
#pragma unroll
            for (int e = 0; e < 4; ++e) z[c][e] += q4[e];
          }
          st4(og + col, z[c]);
        }
      }
    }
    if (has_bias && lane < 16) {
      const int col = 16 * w + lane;
      if (!tail)
        bnxt[col] = bcur[col] + db;
      else
        a.sb[bh * D + col] = db;
    } else if (!has_bias && tid < D) {
      bnxt[tid] = 0.0f;
    }
    if (!tail) to_operand(W, stage, wo, w, lane);
    __syncwarp();  // q's rows read above before the next mini-batch's are stored
  }

  // the weights and bias after the last full mini-batch
  __syncthreads();  // every warp's share of the bias written
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
