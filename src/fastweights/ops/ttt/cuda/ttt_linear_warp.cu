// TTT-Linear's dual-form forward at head size 64 with one warp per (batch, head):
// docs/gpu_ttt_kernels.md, "One warp per head". Same contract as ops/ttt/triton.py's
// ``_linear_fwd_kernel`` and ops/ttt/triton_resident.py's ``_linear_fwd_res_kernel`` (outputs,
// final weights and bias, a partial last mini-batch's gradient sums, the backward's
// checkpoints), with that kernel's precision rule: every product's operands in the inputs'
// dtype (bfloat16 or float16; float32 only in the CPU emulation), every sum float32.
//
// The tokens of a mini-batch (b <= 16) are the 16 rows of WMMA tiles; the warp holds, in its
// own slice of shared memory, the float32 master W [64, 64] (the state), its operand copy in
// the inputs' dtype, and the mini-batch's tiles. Per mini-batch, with E_ij = tau_i eta_j
// (j <= i), A = Q K^T [+1] (``_qk_kernel``'s), coef = -tau_b (1 for a partial last one):
//   Zk = K W (+ b), Zq = Q W                                   (WMMA, 32 m16n16k16 products)
//   G = dl/dZk: lane l owns row l % 16, the columns 16 c + 8 (l / 16) + 0..7 (c = 0..3): every
//       LayerNorm statistic is a sum in the lane and one shuffle with lane l ^ 16
//   Zbar = Zq - (E * A) G (+ b), o = [LN](Zbar) [+ q]                     (4 products, lanes)
//   W += K^T (coef eta G), b += sum coef eta G         (16 products with W's tiles as the
//       accumulators, loaded from and stored to the master; a partial last mini-batch: the
//       sums S, s stored instead)
// Only __syncwarp between the phases: no CTA barrier anywhere (each warp is one head).
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
constexpr int NW = 1;        // warps (heads) per CTA
constexpr int LDF = D + 4;   // row stride of the float tiles (conflict-free lane rows)
constexpr int LDT = D + 8;   // row stride of the operand tiles (16-byte rows, conflict-free)
constexpr float LN_EPS = 1e-6f;  // ops/ttt/common.py LN_EPS

// Byte offsets of one warp's shared-memory buffers (128-aligned) for operand type T.
template <class T>
struct Smem {
  static constexpr unsigned long al(unsigned long x) { return (x + 127) / 128 * 128; }
  static constexpr unsigned long wm = 0;                              // float [D][LDF] master W
  static constexpr unsigned long wo = wm + al(4ul * D * LDF);         // T [D][LDT] its operand
  static constexpr unsigned long kt = wo + al(sizeof(T) * D * LDT);   // T [BB][LDT] K rows
  static constexpr unsigned long qt = kt + al(sizeof(T) * BB * LDT);  // T [BB][LDT] Q rows
  static constexpr unsigned long vt = qt + al(sizeof(T) * BB * LDT);  // T [BB][LDT] V rows
  static constexpr unsigned long gt = vt + al(sizeof(T) * BB * LDT);  // T [BB][LDT] G
  static constexpr unsigned long hm = gt + al(sizeof(T) * BB * LDT);  // T [BB][LDT] coef eta G
  static constexpr unsigned long mt = hm + al(sizeof(T) * BB * LDT);  // T [BB][BB] -(E*A), col-major
  static constexpr unsigned long zs = mt + al(sizeof(T) * BB * BB);   // float [BB][LDF] Zk, Zbar
  static constexpr unsigned long hf = zs + al(4ul * BB * LDF);        // float [BB][LDF] coef eta G
  static constexpr unsigned long bias = hf + al(4ul * BB * LDF);      // float [D]
  static constexpr unsigned long gam = bias + al(4ul * D);            // float [D]
  static constexpr unsigned long bet = gam + al(4ul * D);             // float [D]
  static constexpr unsigned long eta = bet + al(4ul * D);             // float [BB]
  static constexpr unsigned long tau = eta + al(4ul * BB);            // float [BB]
  static constexpr unsigned long warp = tau + al(4ul * BB);           // one warp's bytes
  static constexpr unsigned long bytes = NW * warp;                   // the CTA's
};

using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
template <class T>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <class T>
using FragAT = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major>;
template <class T>
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;

// 16 bytes: the unit of a lane's global and shared-memory accesses.
struct alignas(16) V16 {
  unsigned u[4];
};
// V16s per 8 elements of type T (1 for bfloat16/float16, 2 for float32).
template <class T>
struct Chunk {
  static constexpr int n = (int)sizeof(T) / 2;
  V16 v[n];
};

template <class T>
__device__ __forceinline__ Chunk<T> ld_chunk(const T* p) {
  Chunk<T> c;
#pragma unroll
  for (int i = 0; i < Chunk<T>::n; ++i) c.v[i] = reinterpret_cast<const V16*>(p)[i];
  return c;
}

template <class T>
__device__ __forceinline__ void st_chunk(T* p, const Chunk<T>& c) {
#pragma unroll
  for (int i = 0; i < Chunk<T>::n; ++i) reinterpret_cast<V16*>(p)[i] = c.v[i];
}

template <class T>
__device__ __forceinline__ Chunk<T> zero_chunk() {
  Chunk<T> c;
#pragma unroll
  for (int i = 0; i < Chunk<T>::n; ++i) c.v[i] = V16{{0u, 0u, 0u, 0u}};
  return c;
}

// 8 elements of type T at p (16-byte aligned) as float32; and 8 float32 stored as T.
template <class T>
__device__ __forceinline__ void ld8(const T* p, float (&x)[8]) {
  const Chunk<T> c = ld_chunk(p);
  T t[8];
  memcpy(t, &c, sizeof(t));
#pragma unroll
  for (int e = 0; e < 8; ++e) x[e] = fw_f32(t[e]);
}

template <class T>
__device__ __forceinline__ void st8(T* p, const float (&x)[8]) {
  T t[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) t[e] = fw_cvt<T>(x[e]);
  Chunk<T> c;
  memcpy(&c, t, sizeof(t));
  st_chunk(p, c);
}

__device__ __forceinline__ void ld8f(const float* p, float (&x)[8]) {
  const V16 a = reinterpret_cast<const V16*>(p)[0], b = reinterpret_cast<const V16*>(p)[1];
  memcpy(x, &a, 16);
  memcpy(x + 4, &b, 16);
}

__device__ __forceinline__ void st8f(float* p, const float (&x)[8]) {
  V16 a, b;
  memcpy(&a, x, 16);
  memcpy(&b, x + 4, 16);
  reinterpret_cast<V16*>(p)[0] = a;
  reinterpret_cast<V16*>(p)[1] = b;
}

// A row's sum: the lane's 32 values, then the other half of the row (lane ^ 16).
__device__ __forceinline__ float row_sum(const float (&x)[4][8]) {
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int e = 0; e < 8; ++e) s += x[c][e];
  return s + __shfl_xor_sync(0xffffffffu, s, 16);
}

// LayerNorm of a row held by two lanes (ops/ttt/triton_tiles.py ``_ln``): x_hat in place, and
// 1 / sqrt(var + eps) (biased variance).
__device__ __forceinline__ float layer_norm(float (&z)[4][8]) {
  const float mu = row_sum(z) * (1.0f / D);
  float zc[4][8];
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int e = 0; e < 8; ++e) zc[c][e] = (z[c][e] - mu) * (z[c][e] - mu);
  const float r = 1.0f / sqrtf(row_sum(zc) * (1.0f / D) + LN_EPS);
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int e = 0; e < 8; ++e) z[c][e] = (z[c][e] - mu) * r;
  return r;
}

template <class T>
struct Inputs {  // one mini-batch's global loads, held in registers until they are stored
  Chunk<T> k[4], q[4], v[4];
  float eta;
  V16 a[2];  // 8 of the 256 scores A^T, elements 8 lane .. 8 lane + 7
};

// Mini-batch n's loads (rows past m and mini-batches past N: zeros).
template <class T>
__device__ __forceinline__ void load_inputs(Inputs<T>& in, const FwTTTLinearWarpArgs& a,
                                            long long bh, long long bb, int h, int n, int r,
                                            int c0, int lane) {
  const int t0 = n * a.b;
  const int m = n < a.N ? (a.b < a.T - t0 ? a.b : a.T - t0) : 0;
  const bool ok = r < m;
  const long long row = ((bb * a.T + t0 + r) * a.H + h) * D + c0;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    in.k[c] = ok ? ld_chunk((const T*)a.k + row + 16 * c) : zero_chunk<T>();
    in.q[c] = ok ? ld_chunk((const T*)a.q + row + 16 * c) : zero_chunk<T>();
    in.v[c] = ok ? ld_chunk((const T*)a.v + row + 16 * c) : zero_chunk<T>();
  }
  in.eta = ok ? a.eta[(bb * a.T + t0 + r) * a.H + h] : 0.0f;
  const V16 z = {{0u, 0u, 0u, 0u}};
  const V16* at = reinterpret_cast<const V16*>(a.A + ((bh * a.N + n) * BB) * BB + 8 * lane);
  in.a[0] = n < a.N ? at[0] : z;
  in.a[1] = n < a.N ? at[1] : z;
}

// W += K^T H over W's 4 x 4 tiles of 16 x 16 (row-major at w, ldm), each tile the
// accumulator of one product (K^T's rows 16 i..: element (d, t) at kt[t LDT + 16 i + d]); or,
// SUMS, W = K^T H (the sums of a partial last mini-batch, w in global memory).
template <class T, bool SUMS>
__device__ __forceinline__ void update(float* w, int ldm, const T* kt, const T* hm) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    FragAT<T> fk;
    wmma::load_matrix_sync(fk, kt + 16 * i, LDT);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      FragB<T> fh;
      wmma::load_matrix_sync(fh, hm + 16 * j, LDT);
      Acc acc;
      if (SUMS)
        wmma::fill_fragment(acc, 0.0f);
      else
        wmma::load_matrix_sync(acc, w + (16 * i) * ldm + 16 * j, ldm, wmma::mem_row_major);
      wmma::mma_sync(acc, fk, fh, acc);
      wmma::store_matrix_sync(w + (16 * i) * ldm + 16 * j, acc, ldm, wmma::mem_row_major);
    }
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

template <class T>
__global__ void __launch_bounds__(32 * NW) ttt_linear_warp_fwd(FwTTTLinearWarpArgs a) {
  using L = Smem<T>;
  FW_DYNAMIC_SMEM(smem);
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long bh = (long long)blockIdx.x * NW + w;
  if (bh >= (long long)a.B * a.H) return;  // a whole warp: no CTA barrier follows
  const int H = a.H, h = (int)(bh % H);
  const long long bb = bh / H;
  unsigned char* base = smem + w * L::warp;
  float* wm = (float*)(base + L::wm);
  T* wo = (T*)(base + L::wo);
  T* kt = (T*)(base + L::kt);
  T* qt = (T*)(base + L::qt);
  T* vt = (T*)(base + L::vt);
  T* gt = (T*)(base + L::gt);
  T* hm = (T*)(base + L::hm);
  T* mt = (T*)(base + L::mt);
  float* zs = (float*)(base + L::zs);
  float* hf = (float*)(base + L::hf);
  float* bias = (float*)(base + L::bias);
  float* gam = (float*)(base + L::gam);
  float* bet = (float*)(base + L::bet);
  float* eta_s = (float*)(base + L::eta);
  float* tau_s = (float*)(base + L::tau);

  // the lane's row and columns in the elementwise phases: row r, columns c0 + 16 c + 0..7
  const int r = lane % 16, c0 = 8 * (lane / 16);
  const int NC = (a.NF + a.seg - 1) / a.seg;
  const float tau_b = a.tau[h * a.b + a.b - 1];
  float* wg = a.w + bh * D * D;
  const bool has_bias = FW_FLAG(a.has_bias), has_ln = FW_FLAG(a.has_ln);
  const bool has_lnb = FW_FLAG(a.has_lnb), residual = FW_FLAG(a.residual);

  Inputs<T> in;
  load_inputs(in, a, bh, bb, h, 0, r, c0, lane);
  for (int i = lane; i < D; i += 32) {
    bias[i] = has_bias ? a.b0[bh * D + i] : 0.0f;
    gam[i] = has_ln ? a.lnw[h * D + i] : 1.0f;
    bet[i] = has_lnb ? a.lnb[h * D + i] : 0.0f;
  }
  if (lane < BB) tau_s[lane] = lane < a.b ? a.tau[h * a.b + lane] : 0.0f;
  // the master and its operand copy (lane l: elements 8 (32 i + l) .. + 7, row-major)
#pragma unroll
  for (int i = 0; i < D * D / 8 / 32; ++i) {  // 16 chunks of 8 per lane
    const int e = (i * 32 + lane) * 8, row = e / D, col = e % D;
    float x[8];
    ld8f(wg + row * D + col, x);
    st8f(wm + row * LDF + col, x);
    st8(wo + row * LDT + col, x);
  }
  __syncwarp();

  for (int n = 0; n < a.N; ++n) {
    const bool tail = n >= a.NF;
    const int t0 = n * a.b;
    const int m = a.b < a.T - t0 ? a.b : a.T - t0;
    const float coef = tail ? 1.0f : -tau_b;

    // 0. the checkpoint of the weights entering this mini-batch (every seg-th full one)
    if (a.store_ck && !tail && n % a.seg == 0) {
      const long long c = bh * NC + n / a.seg;
#pragma unroll
      for (int i = 0; i < D * D / 8 / 32; ++i) {
        const int e = (i * 32 + lane) * 8, row = e / D, col = e % D;
        float x[8];
        ld8f(wm + row * LDF + col, x);
        st8f(a.ckw + c * D * D + row * D + col, x);
      }
      if (has_bias)
        for (int i = lane; i < D; i += 32) a.ckb[c * D + i] = bias[i];
    }

    // 1. this mini-batch's rows into shared memory, the next one's loads issued
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      st_chunk(kt + r * LDT + c0 + 16 * c, in.k[c]);
      st_chunk(qt + r * LDT + c0 + 16 * c, in.q[c]);
      st_chunk(vt + r * LDT + c0 + 16 * c, in.v[c]);
    }
    const float eta_r = in.eta;  // the lane's row's eta
    if (lane < 16) eta_s[r] = eta_r;
    float at[8];
    memcpy(at, in.a, sizeof(at));
    load_inputs(in, a, bh, bb, h, n + 1, r, c0, lane);
    __syncwarp();

    // 2. -(E * A) as the left operand of Zbar's product, column-major: element (i, j) at
    //    mt[16 j + i] = -(tau_i eta_j A_ij) for j <= i (A^T's element 8 lane + e is (j, i))
    {
      float mv[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int f = 8 * lane + e, j = f / 16, i = f % 16;
        mv[e] = j <= i ? -((tau_s[i] * eta_s[j]) * at[e]) : 0.0f;
      }
      st8(mt + 8 * lane, mv);
    }

    // 3. Zk = K W, Zq = Q W (Zk through shared memory to the lanes' rows; Zq stays)
    Acc zq[4];
    {
      Acc zk[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        wmma::fill_fragment(zk[j], 0.0f);
        wmma::fill_fragment(zq[j], 0.0f);
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        FragA<T> fk, fq;
        wmma::load_matrix_sync(fk, kt + 16 * c, LDT);
        wmma::load_matrix_sync(fq, qt + 16 * c, LDT);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          FragB<T> fw;
          wmma::load_matrix_sync(fw, wo + (16 * c) * LDT + 16 * j, LDT);
          wmma::mma_sync(zk[j], fk, fw, zk[j]);
          wmma::mma_sync(zq[j], fq, fw, zq[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j)
        wmma::store_matrix_sync(zs + 16 * j, zk[j], LDF, wmma::mem_row_major);
    }
    __syncwarp();

    // 4. G = dl/dZk for the lane's row (docs/maths.md 2.2): G, coef eta G as operands, coef
    //    eta G in float32 for the bias
    {
      float z[4][8], tg[4][8];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int col = c0 + 16 * c;
        float b8[8], v8[8];
        ld8f(zs + r * LDF + col, z[c]);
        ld8f(bias + col, b8);
        ld8(vt + r * LDT + col, v8);
        if (residual) {
          float k8[8];
          ld8(kt + r * LDT + col, k8);
#pragma unroll
          for (int e = 0; e < 8; ++e) tg[c][e] = v8[e] - k8[e];
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) tg[c][e] = v8[e];
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) z[c][e] += b8[e];
      }
      float G[4][8];
      if (has_ln) {
        const float rs = layer_norm(z);  // z is x_hat now
        float g[4][8], gx[4][8];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int col = c0 + 16 * c;
          float gm[8], bt[8];
          ld8f(gam + col, gm);
          ld8f(bet + col, bt);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            g[c][e] = gm[e] * (gm[e] * z[c][e] + bt[e] - tg[c][e]);
            gx[c][e] = g[c][e] * z[c][e];
          }
        }
        const float mg = row_sum(g) * (1.0f / D), mgx = row_sum(gx) * (1.0f / D);
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
          for (int e = 0; e < 8; ++e) G[c][e] = rs * (g[c][e] - mg - z[c][e] * mgx);
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
          for (int e = 0; e < 8; ++e) G[c][e] = z[c][e] - tg[c][e];
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int col = c0 + 16 * c;
        float hv[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) hv[e] = (G[c][e] * eta_r) * coef;
        st8(gt + r * LDT + col, G[c]);
        st8(hm + r * LDT + col, hv);
        if (has_bias) st8f(hf + r * LDF + col, hv);
      }
    }
    __syncwarp();

    // 5. Zbar = Zq - (E * A) G (without the bias); the update W += K^T (coef eta G) with the
    //    master's tiles as the accumulators (a partial last mini-batch: the sums S stored)
    {
      FragAT<T> fm;
      wmma::load_matrix_sync(fm, mt, BB);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        FragB<T> fg;
        wmma::load_matrix_sync(fg, gt + 16 * j, LDT);
        wmma::mma_sync(zq[j], fm, fg, zq[j]);
        wmma::store_matrix_sync(zs + 16 * j, zq[j], LDF, wmma::mem_row_major);
      }
      if (!tail)
        update<T, false>(wm, LDF, kt, hm);
      else
        update<T, true>(a.sw + bh * D * D, D, kt, hm);
    }
    float db[2] = {0.0f, 0.0f};  // columns 2 lane, 2 lane + 1: sum over the tokens
    if (has_bias)
      for (int t = 0; t < BB; ++t) {
        db[0] += hf[t * LDF + 2 * lane];
        db[1] += hf[t * LDF + 2 * lane + 1];
      }
    __syncwarp();

    // 6. o = [LN](Zbar + b) [+ q] for the lane's row; the bias update (or sum); the operand
    //    copy of the updated master
    {
      float z[4][8];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int col = c0 + 16 * c;
        float b8[8];
        ld8f(zs + r * LDF + col, z[c]);
        ld8f(bias + col, b8);
#pragma unroll
        for (int e = 0; e < 8; ++e) z[c][e] += b8[e];
      }
      if (has_ln) {
        layer_norm(z);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int col = c0 + 16 * c;
          float gm[8], bt[8];
          ld8f(gam + col, gm);
          ld8f(bet + col, bt);
#pragma unroll
          for (int e = 0; e < 8; ++e) z[c][e] = gm[e] * z[c][e] + bt[e];
        }
      }
      if (r < m) {
        T* og = (T*)a.o + ((bb * a.T + t0 + r) * H + h) * D;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int col = c0 + 16 * c;
          if (residual) {
            float q8[8];
            ld8(qt + r * LDT + col, q8);  // q's row as loaded
#pragma unroll
            for (int e = 0; e < 8; ++e) z[c][e] += q8[e];
          }
          st8(og + col, z[c]);
        }
      }
    }
    __syncwarp();  // every lane has read the bias before it changes
    if (has_bias) {
      if (!tail) {
        bias[2 * lane] += db[0];
        bias[2 * lane + 1] += db[1];
      } else {
        a.sb[bh * D + 2 * lane] = db[0];
        a.sb[bh * D + 2 * lane + 1] = db[1];
      }
    }
    if (!tail) {
#pragma unroll
      for (int i = 0; i < D * D / 8 / 32; ++i) {
        const int e = (i * 32 + lane) * 8, row = e / D, col = e % D;
        float x[8];
        ld8f(wm + row * LDF + col, x);
        st8(wo + row * LDT + col, x);
      }
    }
    __syncwarp();
  }

  // the weights and bias after the last full mini-batch
#pragma unroll
  for (int i = 0; i < D * D / 8 / 32; ++i) {
    const int e = (i * 32 + lane) * 8, row = e / D, col = e % D;
    float x[8];
    ld8f(wm + row * LDF + col, x);
    st8f(wg + row * D + col, x);
  }
  if (has_bias)
    for (int i = lane; i < D; i += 32) a.bias[bh * D + i] = bias[i];
}

template <class T>
struct FwdKernel {
  using Args = FwTTTLinearWarpArgs;
  static constexpr unsigned long bytes = Smem<T>::bytes;
  static auto get() { return ttt_linear_warp_fwd<T>; }
};

}  // namespace fw_ttt_linear

#ifndef FW_EMULATE
// CUDA launcher (sm_90): one warp per (batch, head), NW per CTA. dtype 1 bfloat16, 2 float16.
// Returns a cudaError_t (cudaErrorInvalidValue for another dtype).
namespace fw_ttt_linear {
template <class T>
static cudaError_t launch(const FwTTTLinearWarpArgs& a, cudaStream_t stream) {
  const int bytes = (int)Smem<T>::bytes;
  auto kernel = ttt_linear_warp_fwd<T>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  const unsigned grid = (unsigned)((a.B * a.H + NW - 1) / NW);
  kernel<<<grid, 32 * NW, bytes, stream>>>(a);
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
  fw_emu::Config cfg{dim3((unsigned)((a.B * a.H + NW - 1) / NW)), dim3(32 * NW), 1,
                     (size_t)Smem<T>::bytes, order};
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
