// TTT-MLP's dual-form forward with the inner weights on chip, the hidden units split over the
// CTAs of a thread-block cluster (sm_90): docs/gpu_ttt_kernels.md, "TTT-MLP on a
// thread-block cluster". Same contract as ops/ttt/triton.py's ``_mlp_fwd_kernel`` (outputs,
// final weights, a partial last mini-batch's gradient sums, the backward's checkpoints), the
// arithmetic of ops/ttt/cluster_model.py (the tile model, tested against the float64 token loop)
// step by step: the same slices, operand roundings and cluster sums in the same order.
//
// One cluster of C = Dh / 128 = D / 32 CTAs per (batch, head); CTA s of the cluster owns hidden
// units [128 s, 128 s + 128): the float32 master slices W1[:, s] [D, 128], W2[s, :] [128, D]
// live in WMMA accumulator fragments (registers) for the whole sequence, warp w holding the
// tiles of hidden units [16 w, 16 w + 16), and are copied to the operand dtype in shared memory
// once per mini-batch for the products. Per mini-batch of b <= 16 tokens (one 16-row tile):
//   Z1_s = K W1_s + b1_s, X2_s = gelu(Z1_s), P2_s = X2_s W2_s          (local)
//   Z2 = sum_s P2_s + b2                                   (cluster sum 1, every CTA, in order)
//   G2 = dl/dZ2 (LayerNorm gradient), M1 = -(E * (Q K^T [+1]))              (every CTA)
//   G1_s = (G2 W2_s^T) * gelu'(Z1_s), Zbar1_s = Q W1_s + M1 G1_s + b1_s,
//   Xbar2_s = gelu(Zbar1_s), Pbar2_s = Xbar2_s W2_s, A2_s = Xbar2_s X2_s^T  (local)
//   Zq2 = sum_s Pbar2_s + b2, A2 = sum_s A2_s [+1], M2 = -(E * A2)  (cluster sum 2, every CTA)
//   Zbar2 = Zq2 + M2 G2, o = [LN](Zbar2) [+ q]     (every CTA; rows r with r % C == s stored)
//   W1_s += K^T (e G1_s), b1_s += sum e G1_s, W2_s += X2_s^T (e G2), b2 += sum e G2
// with E_ij = tau_i eta_j (j <= i), e = coef eta, coef = -tau_b (a partial last mini-batch:
// coef = 1 and the four sums are stored instead). Products take operands in the inputs' dtype
// (bfloat16 or float16; float32 only in the CPU emulation) and accumulate in float32.
//
// Builds: nvcc for sm_90 into a shared library whose C launcher (at the end) ops/ttt/cluster.py
// calls through ctypes, or g++ with -DFW_EMULATE against tests/ops/cuda_emu (the emulation
// entry at the end).
#include "fw_cuda.h"
#include "ttt_mlp_cluster.h"

namespace fw_ttt_mlp {

constexpr int BB = 16;       // tokens per mini-batch tile: one WMMA tile of rows
constexpr int U = 128;       // hidden units per CTA
constexpr int NW = 8;        // warps per CTA, one per 16 hidden units
constexpr int NT = NW * 32;  // threads per CTA
constexpr float LN_EPS = 1e-6f;  // ops/ttt/common.py LN_EPS
constexpr float GELU_C = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float GELU_A = 0.044715f;

// Byte offsets of the shared-memory buffers (128-aligned) for operand type T and head size D.
template <class T, int D>
struct Smem {
  static constexpr unsigned long al(unsigned long x) { return (x + 127) / 128 * 128; }
  static constexpr unsigned long w1c = 0;                                // T [D][U]
  static constexpr unsigned long w2c = w1c + al(sizeof(T) * D * U);     // T [U][D]
  static constexpr unsigned long stage = w2c + al(sizeof(T) * U * D);   // float [NW][16][16]
  static constexpr unsigned long kt = stage + al(4ul * NW * 256);       // T [BB][D]
  static constexpr unsigned long qt = kt + al(sizeof(T) * BB * D);      // T [BB][D]
  static constexpr unsigned long tgt = qt + al(sizeof(T) * BB * D);     // float [BB][D]
  static constexpr unsigned long gp = tgt + al(4ul * BB * D);           // float [BB][U]
  static constexpr unsigned long x2 = gp + al(4ul * BB * U);            // T [BB][U]
  static constexpr unsigned long g1 = x2 + al(sizeof(T) * BB * U);      // T [BB][U]
  static constexpr unsigned long h1 = g1 + al(sizeof(T) * BB * U);      // T [BB][U]
  static constexpr unsigned long xb2 = h1 + al(sizeof(T) * BB * U);     // T [BB][U]
  static constexpr unsigned long ex1 = xb2 + al(sizeof(T) * BB * U);    // float [BB][D]
  static constexpr unsigned long ex2 = ex1 + al(4ul * BB * D);          // float [BB][D + 16]
  static constexpr unsigned long g2f = ex2 + al(4ul * BB * (D + 16));   // float [BB][D]
  static constexpr unsigned long g2 = g2f + al(4ul * BB * D);           // T [BB][D]
  static constexpr unsigned long h2 = g2 + al(sizeof(T) * BB * D);      // T [BB][D]
  static constexpr unsigned long zb2 = h2 + al(sizeof(T) * BB * D);     // float [BB][D]
  static constexpr unsigned long a = zb2 + al(4ul * BB * D);            // float [BB][BB]
  static constexpr unsigned long m1 = a + al(4ul * BB * BB);            // T [BB][BB]
  static constexpr unsigned long m2 = m1 + al(sizeof(T) * BB * BB);     // T [BB][BB]
  static constexpr unsigned long b1s = m2 + al(sizeof(T) * BB * BB);   // float [U]
  static constexpr unsigned long b2s = b1s + al(4ul * U);               // float [D]
  static constexpr unsigned long gam = b2s + al(4ul * D);               // float [D]
  static constexpr unsigned long bet = gam + al(4ul * D);               // float [D]
  static constexpr unsigned long eta = bet + al(4ul * D);               // float [BB]
  static constexpr unsigned long tau = eta + al(4ul * BB);              // float [BB]
  static constexpr unsigned long bytes = tau + al(4ul * BB);
};

using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
template <class T>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <class T>
using FragAT = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major>;
template <class T>
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
template <class T>
using FragBT = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;

// acc += A B over KT 16-deep steps: A's rows at a (row-major, ldm lda; step k at a + 16 k),
// B's step k at b + k * bstep (ldm ldb), row-major (B = FragB) or column-major (FragBT: B the
// transpose of a row-major block, step k at b + 16 k).
template <int KT, class FB, class T>
__device__ __forceinline__ void chain(Acc& acc, const T* a, int lda, const T* b, int bstep,
                                      int ldb) {
#pragma unroll
  for (int k = 0; k < KT; ++k) {
    FragA<T> fa;
    FB fb;
    wmma::load_matrix_sync(fa, a + 16 * k, lda);
    wmma::load_matrix_sync(fb, b + k * bstep, ldb);
    wmma::mma_sync(acc, fa, fb, acc);
  }
}

// gelu_tanh(x) and its derivative (ops/ttt/mlp_scan.py ``_gelu_parts``): s = sigmoid(2 u),
// u = c (x + a x^3), gelu = x s, gelu' = s + 2 c x (1 + 3 a x^2) s (1 - s).
__device__ __forceinline__ void gelu2(float x, float& g, float& d) {
  const float x2 = x * x;
  const float s = 1.0f / (1.0f + expf(-(x * (x2 * GELU_A + 1.0f) * (2.0f * GELU_C))));
  g = x * s;
  d = s + x * (x2 * (3.0f * GELU_A) + 1.0f) * s * (1.0f - s) * (2.0f * GELU_C);
}

__device__ __forceinline__ float gelu(float x) {
  float g, d;
  gelu2(x, g, d);
  return g;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// A lane's share of a warp's 16 x 16 staging tile in the elementwise steps: row lane / 2,
// columns (lane % 2) * 8 .. + 8, all eight loaded before any is used (independent latencies).
struct Share {
  int r, c0;
  __device__ __forceinline__ explicit Share(int lane) : r(lane / 2), c0((lane % 2) * 8) {}
};

// The lane's share of the warp's staging tile plus a bias per column (the tile's 16).
__device__ __forceinline__ void share_plus(const float* stage, const float* bias, const Share& s,
                                           float (&z)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) z[i] = stage[s.r * 16 + s.c0 + i] + bias[s.c0 + i];
}

// The warp's accumulator tile into dst (row-major, ldm) in the operand dtype, through the
// warp's float staging tile.
template <class T>
__device__ __forceinline__ void to_operand(const Acc& f, float* stage, T* dst, int ldm,
                                           int lane) {
  wmma::store_matrix_sync(stage, f, 16, wmma::mem_row_major);
  __syncwarp();
  const Share s(lane);
  float x[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = stage[s.r * 16 + s.c0 + i];
#pragma unroll
  for (int i = 0; i < 8; ++i) dst[s.r * ldm + s.c0 + i] = fw_cvt<T>(x[i]);
  __syncwarp();
}

// LayerNorm statistics of one row held by a warp, D / 32 values per lane: the mean and
// 1 / sqrt(var + eps) (biased variance), as ops/ttt/triton_tiles.py ``_ln``.
template <int D>
__device__ __forceinline__ void row_stats(const float (&z)[D / 32], float& mu, float& r) {
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < D / 32; ++i) s += z[i];
  mu = warp_sum(s) / D;
  float q = 0.0f;
#pragma unroll
  for (int i = 0; i < D / 32; ++i) q += (z[i] - mu) * (z[i] - mu);
  r = 1.0f / sqrtf(warp_sum(q) / D + LN_EPS);
}

template <class T, int D>
__global__ void __launch_bounds__(NT, 1) ttt_mlp_cluster_fwd(FwTTTMLPClusterArgs a) {
  constexpr int C = D / 32;  // CTAs per cluster: Dh / U
  constexpr int ND = D / 16;  // 16-column tiles of the head
  constexpr int Dh = 4 * D;
  constexpr int RL = D / 32;  // a row's values per lane
  using L = Smem<T, D>;
  FW_DYNAMIC_SMEM(smem);
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = (int)cluster.block_rank();
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32;
  const long long bh = blockIdx.x / C;
  const int H = a.H, T_ = a.T, h = (int)(bh % H);
  const long long bb = bh / H;

  T* w1c = (T*)(smem + L::w1c);
  T* w2c = (T*)(smem + L::w2c);
  float* stage = (float*)(smem + L::stage) + w * 256;
  T* kt = (T*)(smem + L::kt);
  T* qt = (T*)(smem + L::qt);
  float* tgt = (float*)(smem + L::tgt);
  float* gp = (float*)(smem + L::gp);
  T* x2 = (T*)(smem + L::x2);
  T* g1 = (T*)(smem + L::g1);
  T* h1 = (T*)(smem + L::h1);
  T* xb2 = (T*)(smem + L::xb2);
  float* ex1 = (float*)(smem + L::ex1);
  float* ex2 = (float*)(smem + L::ex2);
  float* g2f = (float*)(smem + L::g2f);
  T* g2 = (T*)(smem + L::g2);
  T* h2 = (T*)(smem + L::h2);
  float* zb2 = (float*)(smem + L::zb2);
  float* as = (float*)(smem + L::a);
  T* m1 = (T*)(smem + L::m1);
  T* m2 = (T*)(smem + L::m2);
  float* b1s = (float*)(smem + L::b1s);
  float* b2s = (float*)(smem + L::b2s);
  float* gam = (float*)(smem + L::gam);
  float* bet = (float*)(smem + L::bet);
  float* eta_s = (float*)(smem + L::eta);
  float* tau_s = (float*)(smem + L::tau);

  const T* qg = (const T*)a.q;
  const T* kg = (const T*)a.k;
  const T* vg = (const T*)a.v;
  T* og = (T*)a.o;
  float* w1g = a.w1 + bh * D * Dh;
  float* w2g = a.w2 + bh * Dh * D;
  const int NC = (a.NF + a.seg - 1) / a.seg;
  const int j0 = rank * U;  // the CTA's first hidden unit

  for (int c = tid; c < D; c += NT) {
    gam[c] = a.has_ln ? a.lnw[h * D + c] : 1.0f;
    bet[c] = a.has_lnb ? a.lnb[h * D + c] : 0.0f;
    b2s[c] = a.c2[bh * D + c];
  }
  for (int j = tid; j < U; j += NT) b1s[j] = a.c1[bh * Dh + j0 + j];
  if (tid < BB) tau_s[tid] = tid < a.b ? a.tau[h * a.b + tid] : 0.0f;
  const float tau_b = a.tau[h * a.b + a.b - 1];

  // the float32 master slices: W1f[i] = W1[16 i.., j0 + 16 w..], W2f[v] = W2[j0 + 16 w.., 16 v..]
  Acc W1f[ND], W2f[ND];
#pragma unroll
  for (int i = 0; i < ND; ++i)
    wmma::load_matrix_sync(W1f[i], w1g + (16 * i) * Dh + j0 + 16 * w, Dh, wmma::mem_row_major);
#pragma unroll
  for (int v = 0; v < ND; ++v)
    wmma::load_matrix_sync(W2f[v], w2g + (j0 + 16 * w) * D + 16 * v, D, wmma::mem_row_major);
  __syncthreads();

  for (int n = 0; n < a.N; ++n) {
    const bool tail = n >= a.NF;
    const int t0 = n * a.b;
    const int m = a.b < T_ - t0 ? a.b : T_ - t0;
    const float coef = tail ? 1.0f : -tau_b;

    // 0. checkpoint, operand copies of the weights, the mini-batch's inputs
    if (a.store_ck && !tail && n % a.seg == 0) {
      const long long c = bh * NC + n / a.seg;
#pragma unroll
      for (int i = 0; i < ND; ++i)
        wmma::store_matrix_sync(a.ck1 + c * D * Dh + (16 * i) * Dh + j0 + 16 * w, W1f[i], Dh,
                                wmma::mem_row_major);
#pragma unroll
      for (int v = 0; v < ND; ++v)
        wmma::store_matrix_sync(a.ck2 + c * Dh * D + (j0 + 16 * w) * D + 16 * v, W2f[v], D,
                                wmma::mem_row_major);
      for (int j = tid; j < U; j += NT) a.ckb1[c * Dh + j0 + j] = b1s[j];
      if (rank == 0)
        for (int col = tid; col < D; col += NT) a.ckb2[c * D + col] = b2s[col];
    }
    {
      // the inputs' loads are issued first and land while the weights are copied
      constexpr int PER = BB * D / NT;
      T kin[PER], vin[PER];  // (q's rows are loaded after: registers)
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int e = tid + i * NT, r = e / D;
        const long long off = ((bb * T_ + t0 + r) * H + h) * D + e % D;
        const bool ok = r < m;
        kin[i] = ok ? kg[off] : fw_cvt<T>(0.0f);
        vin[i] = ok ? vg[off] : fw_cvt<T>(0.0f);
      }
      const float eta_in = tid < m ? a.eta[(bb * T_ + t0 + tid) * H + h] : 0.0f;
#pragma unroll
      for (int i = 0; i < ND; ++i)
        to_operand(W1f[i], stage, w1c + (16 * i) * U + 16 * w, U, lane);
#pragma unroll
      for (int v = 0; v < ND; ++v)
        to_operand(W2f[v], stage, w2c + (16 * w) * D + 16 * v, D, lane);
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int e = tid + i * NT, r = e / D;
        kt[e] = kin[i];
        qt[e] = r < m ? qg[((bb * T_ + t0 + r) * H + h) * D + e % D] : fw_cvt<T>(0.0f);
        tgt[e] = a.residual ? fw_f32(vin[i]) - fw_f32(kin[i]) : fw_f32(vin[i]);
      }
      if (tid < BB) eta_s[tid] = eta_in;
    }
    __syncthreads();

    // 1. Z1 = K W1_s + b1_s -> X2 = gelu(Z1), gelu'(Z1) (warp w: hidden tile w); A1 = Q K^T
    {
      Acc acc;
      wmma::fill_fragment(acc, 0.0f);
      chain<ND, FragB<T>>(acc, kt, D, w1c + 16 * w, 16 * U, U);
      wmma::store_matrix_sync(stage, acc, 16, wmma::mem_row_major);
      __syncwarp();
      {
        const Share s(lane);
        float z[8];
        share_plus(stage, b1s + 16 * w, s, z);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int at = s.r * U + 16 * w + s.c0 + i;
          float g, d;
          gelu2(z[i], g, d);
          x2[at] = fw_cvt<T>(g);
          gp[at] = d;
        }
      }
      __syncwarp();
      if (w == NW - 1) {
        Acc sc;
        wmma::fill_fragment(sc, 0.0f);
        chain<ND, FragBT<T>>(sc, qt, D, kt, 16, D);  // K^T: element (d, j) at kt[j D + d]
        wmma::store_matrix_sync(as, sc, 16, wmma::mem_row_major);
      }
    }
    __syncthreads();

    // 2. P2_s = X2_s W2_s (warp v: value tile v) -> this CTA's share of cluster sum 1
    if (w < ND) {
      Acc acc;
      wmma::fill_fragment(acc, 0.0f);
      chain<U / 16, FragB<T>>(acc, x2, U, w2c + 16 * w, 16 * D, D);
      wmma::store_matrix_sync(ex1 + 16 * w, acc, D, wmma::mem_row_major);
    }
    cluster.sync();

    // 3. Z2 = sum_s P2_s + b2 (ranks in order) and its loss gradient G2 (warp w: rows 2w, 2w+1);
    //    M1 = -(E * (A1 [+1]))
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int r = 2 * w + rr;
      const float e = eta_s[r] * coef;
      float z[RL], G[RL];
#pragma unroll
      for (int i = 0; i < RL; ++i) {
        const int col = lane + 32 * i;
        float s = 0.0f;
        for (int p = 0; p < C; ++p) s += cluster.map_shared_rank(ex1, p)[r * D + col];
        z[i] = s + b2s[col];
      }
      if (a.has_ln) {
        float mu, rs;
        row_stats<D>(z, mu, rs);
        float xh[RL], g[RL], sg = 0.0f, sgx = 0.0f;
#pragma unroll
        for (int i = 0; i < RL; ++i) {
          const int col = lane + 32 * i;
          xh[i] = (z[i] - mu) * rs;
          g[i] = gam[col] * (gam[col] * xh[i] + bet[col] - tgt[r * D + col]);
          sg += g[i];
          sgx += g[i] * xh[i];
        }
        const float mg = warp_sum(sg) / D, mgx = warp_sum(sgx) / D;
#pragma unroll
        for (int i = 0; i < RL; ++i) G[i] = rs * (g[i] - mg - xh[i] * mgx);
      } else {
#pragma unroll
        for (int i = 0; i < RL; ++i) G[i] = z[i] - tgt[r * D + lane + 32 * i];
      }
#pragma unroll
      for (int i = 0; i < RL; ++i) {
        const int at = r * D + lane + 32 * i;
        g2f[at] = G[i];
        g2[at] = fw_cvt<T>(G[i]);
        h2[at] = fw_cvt<T>(G[i] * e);
      }
    }
    {
      const int i = tid / 16, j = tid % 16;
      const float E = j <= i ? tau_s[i] * eta_s[j] : 0.0f;
      m1[tid] = fw_cvt<T>(-(E * (as[tid] + (a.has_b1 ? 1.0f : 0.0f))));
    }
    __syncthreads();

    // 4. (warp w, hidden tile w) G1 = (G2 W2_s^T) * gelu'(Z1); Zbar1 = Q W1_s + M1 G1 + b1_s;
    //    Xbar2 = gelu(Zbar1); the slice's updates (or, last partial mini-batch, its sums)
    {
      Acc acc;
      wmma::fill_fragment(acc, 0.0f);
      // W2_s^T: element (d, j) at w2c[(16 w + j) D + d]
      chain<ND, FragBT<T>>(acc, g2, D, w2c + (16 * w) * D, 16, D);
      wmma::store_matrix_sync(stage, acc, 16, wmma::mem_row_major);
      __syncwarp();
      {
        const Share s(lane);
        const float e = eta_s[s.r] * coef;
        float G1[8];
#pragma unroll
        for (int i = 0; i < 8; ++i)
          G1[i] = stage[s.r * 16 + s.c0 + i] * gp[s.r * U + 16 * w + s.c0 + i];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int at = s.r * U + 16 * w + s.c0 + i;
          g1[at] = fw_cvt<T>(G1[i]);
          h1[at] = fw_cvt<T>(G1[i] * e);
        }
      }
      float db1 = 0.0f;  // lane < 16: sum over the tokens of e G1 for hidden unit 16 w + lane
      if (lane < 16)
        for (int r = 0; r < BB; ++r)
          db1 += stage[r * 16 + lane] * gp[r * U + 16 * w + lane] * (eta_s[r] * coef);
      __syncwarp();

      wmma::fill_fragment(acc, 0.0f);
      chain<ND, FragB<T>>(acc, qt, D, w1c + 16 * w, 16 * U, U);
      chain<1, FragB<T>>(acc, m1, 16, g1 + 16 * w, 0, U);
      wmma::store_matrix_sync(stage, acc, 16, wmma::mem_row_major);
      __syncwarp();
      {
        const Share s(lane);
        float z[8];
        share_plus(stage, b1s + 16 * w, s, z);
#pragma unroll
        for (int i = 0; i < 8; ++i) xb2[s.r * U + 16 * w + s.c0 + i] = fw_cvt<T>(gelu(z[i]));
      }
      __syncwarp();
      if (a.has_b1 && lane < 16) {
        if (!tail)
          b1s[16 * w + lane] += db1;
        else
          a.sb1[bh * Dh + j0 + 16 * w + lane] = db1;
      }
      // W1_s += K^T H1 (K^T: element (d, j) at kt[j D + d]); W2_s += X2_s^T H2
#pragma unroll
      for (int i = 0; i < ND; ++i) {
        FragAT<T> fa;
        FragB<T> fb;
        wmma::load_matrix_sync(fa, kt + 16 * i, D);
        wmma::load_matrix_sync(fb, h1 + 16 * w, U);
        if (!tail) {
          wmma::mma_sync(W1f[i], fa, fb, W1f[i]);
        } else {
          wmma::fill_fragment(acc, 0.0f);
          wmma::mma_sync(acc, fa, fb, acc);
          wmma::store_matrix_sync(a.s1 + bh * D * Dh + (16 * i) * Dh + j0 + 16 * w, acc, Dh,
                                  wmma::mem_row_major);
        }
      }
#pragma unroll
      for (int v = 0; v < ND; ++v) {
        FragAT<T> fa;  // X2_s^T: element (u, j) at x2[j U + 16 w + u]
        FragB<T> fb;
        wmma::load_matrix_sync(fa, x2 + 16 * w, U);
        wmma::load_matrix_sync(fb, h2 + 16 * v, D);
        if (!tail) {
          wmma::mma_sync(W2f[v], fa, fb, W2f[v]);
        } else {
          wmma::fill_fragment(acc, 0.0f);
          wmma::mma_sync(acc, fa, fb, acc);
          wmma::store_matrix_sync(a.s2 + bh * Dh * D + (j0 + 16 * w) * D + 16 * v, acc, D,
                                  wmma::mem_row_major);
        }
      }
    }
    __syncthreads();

    // 5. Pbar2_s = Xbar2_s W2_s (warp v) and A2_s = Xbar2_s X2_s^T -> cluster sum 2
    if (w < ND) {
      Acc acc;
      wmma::fill_fragment(acc, 0.0f);
      chain<U / 16, FragB<T>>(acc, xb2, U, w2c + 16 * w, 16 * D, D);
      wmma::store_matrix_sync(ex2 + 16 * w, acc, D + 16, wmma::mem_row_major);
    }
    if (w == NW - 1) {
      Acc acc;
      wmma::fill_fragment(acc, 0.0f);
      chain<U / 16, FragBT<T>>(acc, xb2, U, x2, 16, U);  // X2_s^T: (u', j) at x2[j U + u']
      wmma::store_matrix_sync(ex2 + D, acc, D + 16, wmma::mem_row_major);
    }
    cluster.sync();

    // 6. Zq2 = sum_s Pbar2_s + b2, A2 = sum_s A2_s [+1] (ranks in order), M2 = -(E * A2)
    for (int e = tid; e < BB * (D + 16); e += NT) {
      const int r = e / (D + 16), col = e % (D + 16);
      float s = 0.0f;
      for (int p = 0; p < C; ++p) s += cluster.map_shared_rank(ex2, p)[e];
      if (col < D) {
        zb2[r * D + col] = s + b2s[col];
      } else {
        const int j = col - D;
        const float E = j <= r ? tau_s[r] * eta_s[j] : 0.0f;
        m2[r * 16 + j] = fw_cvt<T>(-(E * (s + (a.has_b2 ? 1.0f : 0.0f))));
      }
    }
    __syncthreads();

    // 7. Zbar2 = Zq2 + M2 G2 (warp v); the b2 update (or sum)
    if (w < ND) {
      Acc acc;
      wmma::load_matrix_sync(acc, zb2 + 16 * w, D, wmma::mem_row_major);
      chain<1, FragB<T>>(acc, m2, 16, g2 + 16 * w, 0, D);
      wmma::store_matrix_sync(zb2 + 16 * w, acc, D, wmma::mem_row_major);
    }
    if (a.has_b2)
      for (int col = tid; col < D; col += NT) {
        float db2 = 0.0f;
        for (int r = 0; r < BB; ++r) db2 += g2f[r * D + col] * (eta_s[r] * coef);
        if (!tail)
          b2s[col] += db2;
        else if (rank == 0)
          a.sb2[bh * D + col] = db2;
      }
    __syncthreads();

    // 8. o = [LN](Zbar2) [+ q] for the valid rows r with r % C == rank (warp w: rows 2w, 2w+1)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int r = 2 * w + rr;
      float z[RL];
#pragma unroll
      for (int i = 0; i < RL; ++i) z[i] = zb2[r * D + lane + 32 * i];
      if (a.has_ln) {
        float mu, rs;
        row_stats<D>(z, mu, rs);
#pragma unroll
        for (int i = 0; i < RL; ++i) {
          const int col = lane + 32 * i;
          z[i] = gam[col] * ((z[i] - mu) * rs) + bet[col];
        }
      }
      if (r < m && r % C == rank) {
#pragma unroll
        for (int i = 0; i < RL; ++i) {
          const long long off = ((bb * T_ + t0 + r) * H + h) * D + lane + 32 * i;
          float out = z[i];
          if (a.residual) out += fw_f32(qt[r * D + lane + 32 * i]);  // q's row, as loaded
          og[off] = fw_cvt<T>(out);
        }
      }
    }
    __syncthreads();  // q's rows are read above before the next mini-batch overwrites them
  }

  // the weights after the last full mini-batch
#pragma unroll
  for (int i = 0; i < ND; ++i)
    wmma::store_matrix_sync(w1g + (16 * i) * Dh + j0 + 16 * w, W1f[i], Dh, wmma::mem_row_major);
#pragma unroll
  for (int v = 0; v < ND; ++v)
    wmma::store_matrix_sync(w2g + (j0 + 16 * w) * D + 16 * v, W2f[v], D, wmma::mem_row_major);
  for (int j = tid; j < U; j += NT) a.c1[bh * Dh + j0 + j] = b1s[j];
  if (rank == 0)
    for (int col = tid; col < D; col += NT) a.c2[bh * D + col] = b2s[col];
  cluster.sync();  // no CTA leaves while a peer may still read its shared memory
}

}  // namespace fw_ttt_mlp

#ifndef FW_EMULATE
// CUDA launcher (sm_90): one cluster of D / 32 CTAs per (batch, head). dtype 1 bfloat16,
// 2 float16; D 64 or 128. Returns a cudaError_t (cudaErrorInvalidValue for another dtype or
// head size).
namespace fw_ttt_mlp {
template <class T, int D>
static cudaError_t launch(const FwTTTMLPClusterArgs& a, cudaStream_t stream) {
  constexpr int C = D / 32;
  const int bytes = (int)Smem<T, D>::bytes;
  void (*kernel)(FwTTTMLPClusterArgs) = ttt_mlp_cluster_fwd<T, D>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)(a.B * a.H * C), 1, 1);
  cfg.blockDim = dim3(NT, 1, 1);
  cfg.dynamicSmemBytes = (size_t)bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = C;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, a);
}
}  // namespace fw_ttt_mlp

extern "C" int fw_ttt_mlp_cluster_launch(const FwTTTMLPClusterArgs* a, int dtype, int D,
                                         void* stream) {
  cudaStream_t s = (cudaStream_t)stream;
  if (dtype == 1 && D == 64) return (int)fw_ttt_mlp::launch<fw_bf16, 64>(*a, s);
  if (dtype == 1 && D == 128) return (int)fw_ttt_mlp::launch<fw_bf16, 128>(*a, s);
  if (dtype == 2 && D == 64) return (int)fw_ttt_mlp::launch<fw_half, 64>(*a, s);
  if (dtype == 2 && D == 128) return (int)fw_ttt_mlp::launch<fw_half, 128>(*a, s);
  return (int)cudaErrorInvalidValue;
}

extern "C" const char* fw_ttt_mlp_cluster_error(int code) {
  return cudaGetErrorString((cudaError_t)code);
}
#endif

#ifdef FW_EMULATE
// CPU emulation entries (tests/ops/cuda_emu, docs/cuda_emulation.md): dtype 0 float32 (exact
// float32 products, emulation only), 1 bfloat16, 2 float16; D 32 (one CTA), 64 or 128. Return
// nullptr or the error's message.
namespace fw_ttt_mlp {
template <class T, int D>
static void emulate(const FwTTTMLPClusterArgs& a, unsigned order) {
  fw_emu::Config cfg{dim3((unsigned)(a.B * a.H * (D / 32))), dim3(NT), D / 32,
                     (size_t)Smem<T, D>::bytes, order};
  fw_emu::launch(ttt_mlp_cluster_fwd<T, D>, cfg, a);
}

template <class T>
static void emulate_d(const FwTTTMLPClusterArgs& a, int D, unsigned order) {
  if (D == 32)
    emulate<T, 32>(a, order);
  else if (D == 64)
    emulate<T, 64>(a, order);
  else if (D == 128)
    emulate<T, 128>(a, order);
  else
    throw std::invalid_argument("D must be 32, 64 or 128");
}
}  // namespace fw_ttt_mlp

extern "C" const char* fw_emu_ttt_mlp_cluster_fwd(const FwTTTMLPClusterArgs* a, int dtype, int D,
                                                  unsigned order) {
  return fw_emu::catch_error([&] {
    if (dtype == 0)
      fw_ttt_mlp::emulate_d<float>(*a, D, order);
    else if (dtype == 1)
      fw_ttt_mlp::emulate_d<fw_bf16>(*a, D, order);
    else if (dtype == 2)
      fw_ttt_mlp::emulate_d<fw_half>(*a, D, order);
    else
      throw std::invalid_argument("dtype must be 0 (float32), 1 (bfloat16) or 2 (float16)");
  });
}

// The dynamic shared memory a CTA takes (bytes) for the operand type (dtype as above) and D.
extern "C" unsigned long fw_emu_ttt_mlp_cluster_smem(int dtype, int D) {
  using namespace fw_ttt_mlp;
  if (dtype == 0) return D == 32 ? Smem<float, 32>::bytes : D == 64 ? Smem<float, 64>::bytes : Smem<float, 128>::bytes;
  return D == 32 ? Smem<fw_bf16, 32>::bytes : D == 64 ? Smem<fw_bf16, 64>::bytes : Smem<fw_bf16, 128>::bytes;
}
#endif
