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

// The loss gradient G = dl/dZ of one row z held by a warp (D / 32 values per lane) of
// l = 1/2 ||[LN](z) - tgt||^2, tgt the row's target (ops/ttt/triton_tiles.py ``_loss_grad``);
// with the LayerNorm also its x_hat, g = gamma (gamma x_hat + beta - tgt) and 1 / s (unset
// without).
template <int D>
__device__ __forceinline__ void loss_grad_row(const float (&z)[D / 32], const float* tgt,
                                              const float* gam, const float* bet, bool has_ln,
                                              int lane, float (&G)[D / 32], float (&xh)[D / 32],
                                              float (&g)[D / 32], float& rs) {
  constexpr int RL = D / 32;
  if (has_ln) {
    float mu;
    row_stats<D>(z, mu, rs);
    float sg = 0.0f, sgx = 0.0f;
#pragma unroll
    for (int i = 0; i < RL; ++i) {
      const int col = lane + 32 * i;
      xh[i] = (z[i] - mu) * rs;
      g[i] = gam[col] * (gam[col] * xh[i] + bet[col] - tgt[col]);
      sg += g[i];
      sgx += g[i] * xh[i];
    }
    const float mg = warp_sum(sg) / D, mgx = warp_sum(sgx) / D;
#pragma unroll
    for (int i = 0; i < RL; ++i) G[i] = rs * (g[i] - mg - xh[i] * mgx);
  } else {
#pragma unroll
    for (int i = 0; i < RL; ++i) G[i] = z[i] - tgt[lane + 32 * i];
  }
}

// Step 3: row r of Z2 = sum_s P2_s + b2 (ranks in order; the shares at ex1, ldm ld) held by a
// warp, and its loss gradient G with x_hat, g, 1 / s as loss_grad_row (tgt: the row's target).
template <int D>
__device__ __forceinline__ void z2_grad_row(cg::cluster_group& cluster, float* ex1, int ld, int r,
                                            const float* b2s, const float* tgt, const float* gam,
                                            const float* bet, bool has_ln, int lane,
                                            float (&G)[D / 32], float (&xh)[D / 32],
                                            float (&g)[D / 32], float& rs) {
  float z[D / 32];
#pragma unroll
  for (int i = 0; i < D / 32; ++i) {
    const int col = lane + 32 * i;
    float s = 0.0f;
    for (int p = 0; p < D / 32; ++p) s += cluster.map_shared_rank(ex1, p)[r * ld + col];
    z[i] = s + b2s[col];
  }
  loss_grad_row<D>(z, tgt, gam, bet, has_ln, lane, G, xh, g, rs);
}

// Steps 1 and 4: the warp's hidden tile w of Z = X W1_s [+ M1 G1] + b1_s (X [BB][D]: K's or
// Q's rows; the M1 G1 term with MG), the lane's share of it in z, through acc (the caller's,
// overwritten: a fresh one costs the forward registers) and the staging tile.
template <class T, int D, bool MG>
__device__ __forceinline__ void hidden_pre(Acc& acc, float* stage, const T* x, const T* w1c,
                                           const T* m1, const T* g1, const float* b1s, int w,
                                           int lane, float (&z)[8]) {
  wmma::fill_fragment(acc, 0.0f);
  chain<D / 16, FragB<T>>(acc, x, D, w1c + 16 * w, 16 * U, U);
  if (MG) chain<1, FragB<T>>(acc, m1, 16, g1 + 16 * w, 0, U);
  wmma::store_matrix_sync(stage, acc, 16, wmma::mem_row_major);
  __syncwarp();
  share_plus(stage, b1s + 16 * w, Share(lane), z);
}

// Step 4: the warp's hidden tile w of G2 W2_s^T (G2 [BB][D], operand rows) into its staging
// tile, through acc (the caller's, overwritten).
template <class T, int D>
__device__ __forceinline__ void g2_w2t(Acc& acc, float* stage, const T* g2, const T* w2c, int w) {
  wmma::fill_fragment(acc, 0.0f);
  // W2_s^T: element (d, j) at w2c[(16 w + j) D + d]
  chain<D / 16, FragBT<T>>(acc, g2, D, w2c + (16 * w) * D, 16, D);
  wmma::store_matrix_sync(stage, acc, 16, wmma::mem_row_major);
  __syncwarp();
}

// Steps 1 and 4: X = gelu(Z) (operand dtype) and gelu'(Z) of the lane's share z of the warp's
// hidden tile w, into the rows' layout [BB][U]; with KEEP also z itself back into the staging tile.
template <bool KEEP, class T>
__device__ __forceinline__ void gelu_out(const float (&z)[8], const Share& s, int w, T* x,
                                         float* gp, float* stage) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int o = s.r * U + 16 * w + s.c0 + i;
    float g, d;
    gelu2(z[i], g, d);
    x[o] = fw_cvt<T>(g);
    gp[o] = d;
    if (KEEP) stage[s.r * 16 + s.c0 + i] = z[i];
  }
}

// Steps 2 and 5: this CTA's share X_s W2_s of a cluster sum (warp v < D / 16: value tile v),
// X [BB][U] the rows' hidden activations, into ex (ldm ld) at column tile v.
template <class T, int D>
__device__ __forceinline__ void value_share(const T* x, const T* w2c, float* ex, int ld, int w) {
  if (w < D / 16) {
    Acc acc;
    wmma::fill_fragment(acc, 0.0f);
    chain<U / 16, FragB<T>>(acc, x, U, w2c + 16 * w, 16 * D, D);
    wmma::store_matrix_sync(ex + 16 * w, acc, ld, wmma::mem_row_major);
  }
}

// Step 5: Pbar2_s = Xbar2_s W2_s (warp v) and A2_s = Xbar2_s X2_s^T (warp 7), this CTA's
// shares of cluster sum 2, into ex2 [BB][D + 16] (A2_s in the last 16 columns).
template <class T, int D>
__device__ __forceinline__ void sum2_shares(const T* xb2, const T* x2, const T* w2c, float* ex2,
                                            int w) {
  value_share<T, D>(xb2, w2c, ex2, D + 16, w);
  if (w == NW - 1) {
    Acc acc;
    wmma::fill_fragment(acc, 0.0f);
    chain<U / 16, FragBT<T>>(acc, xb2, U, x2, 16, U);  // X2_s^T: (u', j) at x2[j U + u']
    wmma::store_matrix_sync(ex2 + D, acc, D + 16, wmma::mem_row_major);
  }
}

// Step 6: cluster sum 2 of the shares at ex2 [BB][D + 16] (ranks in order): Zq2 = sum_s
// Pbar2_s + b2 into zb2 [BB][D]; A2 = sum_s A2_s [+1] (row r, column j) to m2of(r, j, A2).
template <int D, class F>
__device__ __forceinline__ void sum2(cg::cluster_group& cluster, const float* ex2,
                                     const float* b2s, bool has_b2, float* zb2, int tid, F m2of) {
  for (int x = tid; x < BB * (D + 16); x += NT) {
    const int r = x / (D + 16), col = x % (D + 16);
    float s = 0.0f;
    for (int p = 0; p < D / 32; ++p) s += cluster.map_shared_rank(ex2, p)[x];
    if (col < D)
      zb2[r * D + col] = s + b2s[col];
    else
      m2of(r, col - D, s + (has_b2 ? 1.0f : 0.0f));
  }
}

// Step 7: Zbar2 = Zq2 + M2 G2 in place at zb2 [BB][D] (warp v < D / 16: value tile v; M2 the
// operand tile m2 holds, with its sign).
template <class T, int D>
__device__ __forceinline__ void zbar2_tile(float* zb2, const T* m2, const T* g2, int w) {
  if (w < D / 16) {
    Acc acc;
    wmma::load_matrix_sync(acc, zb2 + 16 * w, D, wmma::mem_row_major);
    chain<1, FragB<T>>(acc, m2, 16, g2 + 16 * w, 0, D);
    wmma::store_matrix_sync(zb2 + 16 * w, acc, D, wmma::mem_row_major);
  }
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
      {
        float z[8];
        hidden_pre<T, D, false>(acc, stage, kt, w1c, m1, g1, b1s, w, lane, z);
        gelu_out<false>(z, Share(lane), w, x2, gp, stage);
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
    value_share<T, D>(x2, w2c, ex1, D, w);
    cluster.sync();

    // 3. Z2 = sum_s P2_s + b2 (ranks in order) and its loss gradient G2 (warp w: rows 2w, 2w+1);
    //    M1 = -(E * (A1 [+1]))
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int r = 2 * w + rr;
      const float e = eta_s[r] * coef;
      float G[RL];
      {
        float xh[RL], g[RL], rs;
        z2_grad_row<D>(cluster, ex1, D, r, b2s, tgt + r * D, gam, bet, a.has_ln, lane, G, xh, g,
                       rs);
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
      g2_w2t<T, D>(acc, stage, g2, w2c, w);
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

      {
        float z[8];
        hidden_pre<T, D, true>(acc, stage, qt, w1c, m1, g1, b1s, w, lane, z);
        const Share s(lane);
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
    sum2_shares<T, D>(xb2, x2, w2c, ex2, w);
    cluster.sync();

    // 6. Zq2 = sum_s Pbar2_s + b2, A2 = sum_s A2_s [+1] (ranks in order), M2 = -(E * A2)
    sum2<D>(cluster, ex2, b2s, a.has_b2, zb2, tid, [&](int r, int j, float A2) {
      const float E = j <= r ? tau_s[r] * eta_s[j] : 0.0f;
      m2[r * 16 + j] = fw_cvt<T>(-(E * A2));
    });
    __syncthreads();

    // 7. Zbar2 = Zq2 + M2 G2 (warp v); the b2 update (or sum)
    zbar2_tile<T, D>(zb2, m2, g2, w);
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

// ---------------------------------------------------------------------------------------------
// The backward's sequential pass on the same cluster (docs/gpu_ttt_kernels.md, "The sequential
// pass on clusters"; the arithmetic of ops/ttt/cluster_bwd_model.py): one launch of
// ops/ttt/triton.py's ``_mlp_bwd_b_kernel`` over a full segment, mini-batches n1-1 down to n0.
// CTA s holds its slice of the carried gradients D1_s [D, 128] and D2_s [128, D] in WMMA
// accumulators (warp w: hidden block w; D2_s's last column tile in shared memory, float32) and
// d1_s, d2 in shared memory. Per mini-batch, with the
// rows ``_mlp_bwd_a_kernel`` wrote and the mini-batch's slot weights W1_s, W2_s:
//   1. kD1 = K D1_s + d1_s, dG1 = ce kD1 - M1^T dZbar1, dA = dG1 gelu'(Z1)        (local)
//   2. cluster sum 1: dG2 = sum_s dA W2_s + dG2_readout, xD2 = sum_s X2 D2_s + d2, the tokens'
//      sum_h G1 kD1
//   3. dG2 += ce xD2; deta, dtau; the keys' LayerNorm gradient backward: dZ2, dV, dgamma,
//      dbeta, d2                                                            (every CTA)
//   4. dX2 = ce G2 D2_s^T + dA2 Xbar2 + dZ2 W2_s^T, dZ1 = dG1 A gelu''(Z1) + dX2 gelu'(Z1)
//   5. cluster sum 2: dK's share sum_s (ce G1) D1_s^T + dZ1 W1_s^T; D1_s, d1_s, D2_s updated
// W1_s's operand copy is written where D2_s's was, once step 4 is done with it (shared memory:
// docs/gpu_ttt_kernels.md says why).
namespace fw_ttt_mlp {

// gelu_tanh(x), gelu'(x) and gelu''(x) (ops/ttt/triton.py ``_gelu2``).
__device__ __forceinline__ void gelu3(float x, float& y, float& d1, float& d2) {
  gelu2(x, y, d1);
  const float x2 = x * x;
  const float s = 1.0f / (1.0f + expf(-(x * (x2 * GELU_A + 1.0f) * (2.0f * GELU_C))));
  const float up = (x2 * (3.0f * GELU_A) + 1.0f) * GELU_C;
  d2 = s * (1.0f - s) * 4.0f * (up + x2 * (3.0f * GELU_A) * GELU_C + x * up * up * (1.0f - 2.0f * s));
}

// threadIdx.x read where it is called: an asm volatile the compiler neither hoists out of the
// mini-batch loop nor merges with another read, so what a step derives from it (warp, lane,
// row and column indices, addresses) lives only as long as that step.
__device__ __forceinline__ int fresh_tid() {
#ifdef FW_EMULATE
  return (int)threadIdx.x;
#else
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
#endif
}

template <class T, int D>
struct SmemB {
  static constexpr unsigned long al(unsigned long x) { return (x + 127) / 128 * 128; }
  static constexpr unsigned long d1c = 0;                                 // T [D][U]
  static constexpr unsigned long d2c = d1c + al(sizeof(T) * D * U);      // T [U][D], then W1_s [D][U]
  static constexpr unsigned long w2c = d2c + al(sizeof(T) * D * U);      // T [U][D]
  static constexpr unsigned long stage = w2c + al(sizeof(T) * U * D);    // float [NW][16][16]
  static constexpr unsigned long kt = stage + al(4ul * NW * 256);        // T [BB][D]
  static constexpr unsigned long qt = kt + al(sizeof(T) * BB * D);       // T [BB][D]
  static constexpr unsigned long gp = qt + al(sizeof(T) * BB * D);       // float [BB][U] gelu'(Z1)
  static constexpr unsigned long agpp = gp + al(4ul * BB * U);           // A gelu''(Z1), then dG1 A gelu''
  static constexpr unsigned long g1f = agpp + al(4ul * BB * U);          // float G1
  static constexpr unsigned long x2 = g1f + al(4ul * BB * U);            // T X2
  static constexpr unsigned long xb2 = x2 + al(sizeof(T) * BB * U);      // T Xbar2
  static constexpr unsigned long dzb1 = xb2 + al(sizeof(T) * BB * U);    // T dZbar1
  static constexpr unsigned long da = dzb1 + al(sizeof(T) * BB * U);     // T dA
  static constexpr unsigned long ceg1 = da + al(sizeof(T) * BB * U);     // T ce G1
  static constexpr unsigned long dz1 = ceg1 + al(sizeof(T) * BB * U);    // T dZ1
  static constexpr unsigned long g2 = dz1 + al(sizeof(T) * BB * U);      // T [BB][D] G2
  static constexpr unsigned long dzb2 = g2 + al(sizeof(T) * BB * D);     // T dZbar2
  static constexpr unsigned long dz2 = dzb2 + al(sizeof(T) * BB * D);    // T dZ2
  static constexpr unsigned long part = dz2 + al(sizeof(T) * BB * D);    // float [NW][3][D]
  static constexpr unsigned long ex1 = part + al(4ul * NW * 3 * D);      // float [BB][2D] + [BB]
  static constexpr unsigned long ex2 = ex1 + al(4ul * (BB * 2 * D + BB));  // float [BB][D]
  static constexpr unsigned long at = ex2 + al(4ul * BB * D);            // T [BB][BB] dA2^T
  static constexpr unsigned long m1t = at + al(sizeof(T) * BB * BB);     // T [BB][BB] M1^T
  static constexpr unsigned long d1s = m1t + al(sizeof(T) * BB * BB);    // float [U]
  static constexpr unsigned long dzb1s = d1s + al(4ul * U);              // float [U]: sum_t dZbar1
  static constexpr unsigned long d2s = dzb1s + al(4ul * U);              // float [D]
  static constexpr unsigned long dzb2s = d2s + al(4ul * D);              // float [D]: sum_t dZbar2
  static constexpr unsigned long gam = dzb2s + al(4ul * D);              // float [D]
  static constexpr unsigned long bet = gam + al(4ul * D);                // float [D]
  static constexpr unsigned long eta = bet + al(4ul * D);                // float [BB]
  static constexpr unsigned long tau = eta + al(4ul * BB);               // float [BB]
  static constexpr unsigned long se1w = tau + al(4ul * BB);              // float [NW][BB]
  static constexpr unsigned long seta = se1w + al(4ul * NW * BB);        // float [BB]
  static constexpr unsigned long d2t = seta + al(4ul * BB);              // float [NW][16][16]
  static constexpr unsigned long bytes = d2t + al(4ul * NW * 256);
};

// acc += X^T Y over one 16-token step: X [16 tokens][...] at x (row-major, ldm ldx, read
// transposed as a column-major operand), Y [16 tokens][...] at y (row-major, ldm ldy).
template <class T>
__device__ __forceinline__ void outer(Acc& acc, const T* x, int ldx, const T* y, int ldy) {
  FragAT<T> fa;
  FragB<T> fb;
  wmma::load_matrix_sync(fa, x, ldx);
  wmma::load_matrix_sync(fb, y, ldy);
  wmma::mma_sync(acc, fa, fb, acc);
}

// The sum over a half-warp's 16 lanes (one hidden or value unit's 16 tokens in step 0).
__device__ __forceinline__ float warp_sum16(float x) {
#pragma unroll
  for (int m = 8; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// The sum over the 16 rows of a Share layout (lanes l ^ 2, ^ 4, ^ 8, ^ 16 hold the same
// columns of the other rows).
__device__ __forceinline__ float rows_sum(float x) {
#pragma unroll
  for (int m = 2; m < 32; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

template <class T, int D>
__global__ void __launch_bounds__(NT, 1) ttt_mlp_cluster_bwd_b(FwTTTMLPClusterBwdArgs a) {
  constexpr int C = D / 32, ND = D / 16, Dh = 4 * D, RL = D / 32;
  constexpr int VL = ND - 1;  // D2_s's last column tile, held in shared memory (d2t)
  using L = SmemB<T, D>;
  FW_DYNAMIC_SMEM(smem);
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = (int)cluster.block_rank();
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32;
  const long long bh = blockIdx.x / C;
  const int H = a.H, T_ = a.T, h = (int)(bh % H);
  const long long bb = bh / H;
  const int j0 = rank * U;

  T* d1c = (T*)(smem + L::d1c);
  T* d2c = (T*)(smem + L::d2c);
  T* w1c = d2c;  // after step 4
  T* w2c = (T*)(smem + L::w2c);
  T* kt = (T*)(smem + L::kt);
  T* qt = (T*)(smem + L::qt);
  float* gp = (float*)(smem + L::gp);
  float* agpp = (float*)(smem + L::agpp);
  float* g1f = (float*)(smem + L::g1f);
  T* x2 = (T*)(smem + L::x2);
  T* xb2 = (T*)(smem + L::xb2);
  T* dzb1 = (T*)(smem + L::dzb1);
  T* da = (T*)(smem + L::da);
  T* ceg1 = (T*)(smem + L::ceg1);
  T* dz1 = (T*)(smem + L::dz1);
  T* g2 = (T*)(smem + L::g2);
  T* dzb2 = (T*)(smem + L::dzb2);
  T* dz2 = (T*)(smem + L::dz2);
  float* part = (float*)(smem + L::part);
  float* ex1 = (float*)(smem + L::ex1);
  float* ex2 = (float*)(smem + L::ex2);
  T* ats = (T*)(smem + L::at);
  T* m1t = (T*)(smem + L::m1t);
  float* d1s = (float*)(smem + L::d1s);
  float* dzb1s = (float*)(smem + L::dzb1s);
  float* d2s = (float*)(smem + L::d2s);
  float* dzb2s = (float*)(smem + L::dzb2s);
  float* gam = (float*)(smem + L::gam);
  float* bet = (float*)(smem + L::bet);
  float* eta_s = (float*)(smem + L::eta);
  float* tau_s = (float*)(smem + L::tau);
  float* se1w = (float*)(smem + L::se1w);
  float* seta = (float*)(smem + L::seta);

  const T* qg = (const T*)a.q;
  const T* kg = (const T*)a.k;
  const T* vg = (const T*)a.v;
  float* dw1g = a.dw1 + bh * D * Dh;
  float* dw2g = a.dw2 + bh * Dh * D;
  const int b = a.b;

  for (int c = tid; c < D; c += NT) {
    gam[c] = a.has_ln ? a.lnw[h * D + c] : 0.0f;
    bet[c] = a.has_lnb ? a.lnb[h * D + c] : 0.0f;
    d2s[c] = a.db2[bh * D + c];
  }
  for (int j = tid; j < U; j += NT) d1s[j] = a.db1[bh * Dh + j0 + j];
  if (tid < BB) tau_s[tid] = tid < b ? a.tau[h * b + tid] : 0.0f;

  // the carried gradients: D1f[i] = D1[16 i.., j0 + 16 w..], D2f[v] = D2[j0 + 16 w.., 16 v..]
  // for v < VL; D2[j0 + 16 w.., 16 VL..] in float32 at d2t + 256 w (row-major [16][16]): 8
  // registers fewer (docs/gpu_ttt_kernels.md, "The backward's sequential pass on the cluster")
  Acc D1f[ND], D2f[VL];
#pragma unroll
  for (int i = 0; i < ND; ++i)
    wmma::load_matrix_sync(D1f[i], dw1g + (16 * i) * Dh + j0 + 16 * w, Dh, wmma::mem_row_major);
#pragma unroll
  for (int v = 0; v < VL; ++v)
    wmma::load_matrix_sync(D2f[v], dw2g + (j0 + 16 * w) * D + 16 * v, D, wmma::mem_row_major);
  {
    const Share sh(lane);
    float* d2t = (float*)(smem + L::d2t) + w * 256;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      d2t[sh.r * 16 + sh.c0 + i] = dw2g[(j0 + 16 * w + sh.r) * D + 16 * VL + sh.c0 + i];
  }
  __syncthreads();

  for (int n = a.n1 - 1; n >= a.n0; --n) {
    const int jn = n - a.n0, t0 = n * b;
    const long long row = bh * a.seg + jn;
    const long long slot = bh * a.w_bh + (long long)jn * a.w_j;
    const float* hs = a.hs + row * 4 * Dh * BB;
    const float* vs = a.vs + row * 5 * D * BB;
    // Every step takes the thread's indices and coef afresh (coef = -tau_b from tau_s) instead
    // of holding them, and the indices and addresses derived from them, across the
    // mini-batch: at D 128 the 128 registers of D1_s, D2_s leave no room for them
    // (docs/gpu_ttt_kernels.md, "The backward's sequential pass on the cluster").
    int tid, w, lane;
    float *stage, *d2t;
    float coef;
    auto fresh = [&] {
      tid = fresh_tid();
      w = tid / 32;
      lane = tid % 32;
      stage = (float*)(smem + L::stage) + w * 256;
      d2t = (float*)(smem + L::d2t) + w * 256;
      coef = -tau_s[b - 1];
    };
    fresh();
    // 0. operand copies of the carried gradients and of W2_s; the mini-batch's rows
#pragma unroll
    for (int i = 0; i < ND; ++i) to_operand(D1f[i], stage, d1c + (16 * i) * U + 16 * w, U, lane);
#pragma unroll
    for (int v = 0; v < VL; ++v) to_operand(D2f[v], stage, d2c + (16 * w) * D + 16 * v, D, lane);
    {  // to_operand's copy of tile VL, from d2t in place of the staging tile
      const Share sh(lane);
      float x[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = d2t[sh.r * 16 + sh.c0 + i];
#pragma unroll
      for (int i = 0; i < 8; ++i) d2c[(16 * w + sh.r) * D + 16 * VL + sh.c0 + i] = fw_cvt<T>(x[i]);
    }
    {
      const float* w2s = a.w2 + slot * Dh * D + (long long)j0 * D;
      for (int e = tid; e < U * D; e += NT) w2c[e] = fw_cvt<T>(w2s[e]);
    }
    if (tid < BB) eta_s[tid] = tid < b ? a.eta[(bb * T_ + t0 + tid) * H + h] : 0.0f;
    for (int e = tid; e < BB * D; e += NT) {
      const int t = e / D;
      const long long off = ((bb * T_ + t0 + t) * H + h) * D + e % D;
      kt[e] = t < b ? kg[off] : fw_cvt<T>(0.0f);
      qt[e] = t < b ? qg[off] : fw_cvt<T>(0.0f);
    }
    for (int e = tid; e < U * BB; e += NT) {  // hidden rows [h][t]: a warp reads 2 units
      const int j = e / BB, t = e % BB;
      const long long at_h = (long long)(j0 + j) * BB + t;
      const float z1 = hs[at_h], A_ = hs[Dh * BB + at_h];
      const float zb1 = hs[2 * Dh * BB + at_h], dz = hs[3 * Dh * BB + at_h];
      float y, d1, d2;
      gelu3(z1, y, d1, d2);
      const int o = t * U + j;
      x2[o] = fw_cvt<T>(y);
      gp[o] = d1;
      agpp[o] = A_ * d2;
      g1f[o] = A_ * d1;
      xb2[o] = fw_cvt<T>(gelu(zb1));
      dzb1[o] = fw_cvt<T>(dz);
      const float s = warp_sum16(dz);  // over the 16 tokens of unit j (lanes of one half-warp)
      if (t == 0) dzb1s[j] = s;
    }
    for (int e = tid; e < D * BB; e += NT) {  // value rows [d][t]
      const int d = e / BB, t = e % BB;
      const float G2 = vs[e], dzb = vs[D * BB + e];
      g2[t * D + d] = fw_cvt<T>(G2);
      dzb2[t * D + d] = fw_cvt<T>(dzb);
      const float s = warp_sum16(dzb);
      if (t == 0) dzb2s[d] = s;
    }
    {
      const int t = tid / 16, u = tid % 16;  // 256 threads: the 16 x 16 tiles
      ats[tid] = fw_cvt<T>(a.at[row * BB * BB + tid]);
      const float eta_t = t < b ? a.eta[(bb * T_ + t0 + t) * H + h] : 0.0f;
      const float tau_u = u < b ? a.tau[h * b + u] : 0.0f;
      const float Et = t <= u ? eta_t * tau_u : 0.0f;  // M1^T = E^T * (the scores tile)
      m1t[tid] = fw_cvt<T>(Et * a.A[((bh * a.N + n) * BB + t) * BB + u]);
    }
    __syncthreads();

    fresh();
    // 1. (warp w, hidden block w) kD1 = K D1_s + d1_s; the tokens' G1 . kD1; dG1 = ce kD1 -
    //    M1^T dZbar1; dA = dG1 gelu'(Z1), dG1 A gelu''(Z1)
    {
      const Share sh(lane);
      Acc acc;
      wmma::fill_fragment(acc, 0.0f);
      chain<ND, FragB<T>>(acc, kt, D, d1c + 16 * w, 16 * U, U);
      wmma::store_matrix_sync(stage, acc, 16, wmma::mem_row_major);
      __syncwarp();
      float kd[8];
      share_plus(stage, d1s + 16 * w, sh, kd);  // d1_s is zero without b1
      float se = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) se += g1f[sh.r * U + 16 * w + sh.c0 + i] * kd[i];
      se += __shfl_xor_sync(0xffffffffu, se, 1);  // the row's other 8 units
      if (sh.c0 == 0) se1w[w * BB + sh.r] = se;
      __syncwarp();
      wmma::fill_fragment(acc, 0.0f);
      chain<1, FragB<T>>(acc, m1t, 16, dzb1 + 16 * w, 0, U);
      wmma::store_matrix_sync(stage, acc, 16, wmma::mem_row_major);
      __syncwarp();
      const float ce = coef * eta_s[sh.r];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int o = sh.r * U + 16 * w + sh.c0 + i;
        const float dG1 = ce * kd[i] - stage[sh.r * 16 + sh.c0 + i];
        da[o] = fw_cvt<T>(dG1 * gp[o]);
        agpp[o] = dG1 * agpp[o];
        ceg1[o] = fw_cvt<T>(ce * g1f[o]);
      }
    }
    __syncthreads();

    fresh();
    // 2. this CTA's shares of cluster sum 1: dA W2_s, X2 D2_s [BB][D] each, the tokens' G1 . kD1
    for (int qn = w; qn < 2 * ND; qn += NW) {
      Acc acc;
      wmma::fill_fragment(acc, 0.0f);
      if (qn < ND)
        chain<U / 16, FragB<T>>(acc, da, U, w2c + 16 * qn, 16 * D, D);
      else
        chain<U / 16, FragB<T>>(acc, x2, U, d2c + 16 * (qn - ND), 16 * D, D);
      wmma::store_matrix_sync(ex1 + 16 * qn, acc, 2 * D, wmma::mem_row_major);
    }
    if (tid < BB) {
      float s = 0.0f;
      for (int ww = 0; ww < NW; ++ww) s += se1w[ww * BB + tid];
      ex1[BB * 2 * D + tid] = s;
    }
    cluster.sync();

    fresh();
    // 3. (warp w: rows 2w, 2w+1) dG2, xD2, deta, dtau's terms, the keys' LayerNorm gradient
    //    backward; column sums of dgamma, dbeta, d2 per warp
    {
      float pa0[RL], pa1[RL], pd2[RL];
#pragma unroll
      for (int i = 0; i < RL; ++i) pa0[i] = pa1[i] = pd2[i] = 0.0f;
#pragma unroll
      for (int rr_ = 0; rr_ < 2; ++rr_) {
        const int t = 2 * w + rr_;
        const float ce = coef * eta_s[t];
        float dG[RL], G[RL], xh[RL], gg[RL];
        float se1 = 0.0f;
        for (int p = 0; p < C; ++p) se1 += cluster.map_shared_rank(ex1, p)[BB * 2 * D + t];
        float sx = 0.0f;
#pragma unroll
        for (int i = 0; i < RL; ++i) {
          const int d = lane + 32 * i;
          float s1 = 0.0f, s2 = 0.0f;
          for (int p = 0; p < C; ++p) {
            const float* peer = cluster.map_shared_rank(ex1, p);
            s1 += peer[t * 2 * D + d];
            s2 += peer[t * 2 * D + D + d];
          }
          const float xd = a.has_b2 ? s2 + d2s[d] : s2;
          dG[i] = (s1 + vs[(2 * D + d) * BB + t]) + ce * xd;
          G[i] = vs[d * BB + t];
          xh[i] = vs[(3 * D + d) * BB + t];
          gg[i] = vs[(4 * D + d) * BB + t];
          sx += G[i] * xd;
        }
        const float se = se1 + warp_sum(sx);
        if (lane == 0) {
          seta[t] = se * eta_s[t];
          if (rank == 0 && t < b) a.deta[(bb * T_ + t0 + t) * H + h] += coef * se;
        }
        float dZ[RL], dtgt[RL];
        if (a.has_ln) {
          const float r = a.rr[row * BB + t];
          float s_dg = 0.0f, s_dgx = 0.0f, s_gx = 0.0f, s_dgG = 0.0f;
#pragma unroll
          for (int i = 0; i < RL; ++i) {
            s_dg += dG[i];
            s_dgx += dG[i] * xh[i];
            s_gx += gg[i] * xh[i];
            s_dgG += dG[i] * G[i];
          }
          const float m_dg = warp_sum(s_dg) / D, m_dgx = warp_sum(s_dgx) / D;
          const float cc = r * (warp_sum(s_gx) / D), mm = m_dgx * r, mdg = warp_sum(s_dgG) / D;
          float dxh[RL], s_y = 0.0f, s_yx = 0.0f;
#pragma unroll
          for (int i = 0; i < RL; ++i) {
            const int d = lane + 32 * i;
            const float dg = r * (dG[i] - m_dg - xh[i] * m_dgx);
            dtgt[i] = -gam[d] * dg;
            dxh[i] = gam[d] * gam[d] * dg - cc * dG[i] - gg[i] * mm;
            s_y += dxh[i];
            s_yx += dxh[i] * xh[i];
            const long long off = ((bb * T_ + t0 + t) * H + h) * D + d;
            float tg = t < b ? fw_f32(vg[off]) : 0.0f;
            if (a.residual && t < b) tg -= fw_f32(kg[off]);
            const float e = gam[d] * xh[i] + bet[d] - tg;
            pa0[i] += dg * (e + gam[d] * xh[i]);
            pa1[i] -= dtgt[i];
          }
          const float m_y = warp_sum(s_y) / D, m_yx = warp_sum(s_yx) / D;
#pragma unroll
          for (int i = 0; i < RL; ++i)
            dZ[i] = r * (dxh[i] - m_y - xh[i] * m_yx) - r * xh[i] * mdg;
        } else {
#pragma unroll
          for (int i = 0; i < RL; ++i) {
            dZ[i] = dG[i];
            dtgt[i] = -dG[i];
          }
        }
#pragma unroll
        for (int i = 0; i < RL; ++i) {
          const int d = lane + 32 * i;
          dz2[t * D + d] = fw_cvt<T>(dZ[i]);
          pd2[i] += dZ[i];
          if (rank == 0 && t < b) {
            const long long off = ((bb * T_ + t0 + t) * H + h) * D + d;
            a.dv[off] = dtgt[i];
            if (a.residual) a.dk[off] -= dtgt[i];
          }
        }
      }
#pragma unroll
      for (int i = 0; i < RL; ++i) {
        const int d = lane + 32 * i;
        part[(w * 3 + 0) * D + d] = pa0[i];
        part[(w * 3 + 1) * D + d] = pa1[i];
        part[(w * 3 + 2) * D + d] = pd2[i];
      }
    }
    __syncthreads();

    fresh();
    // 3b. dgamma, dbeta (rank 0), d2 (every CTA), tau_b's share (rank 0)
    for (int d = tid; d < D; d += NT) {
      float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f;
      for (int ww = 0; ww < NW; ++ww) {
        s0 += part[(ww * 3 + 0) * D + d];
        s1 += part[(ww * 3 + 1) * D + d];
        s2 += part[(ww * 3 + 2) * D + d];
      }
      if (a.has_ln && rank == 0) {
        a.acc[(bh * 2 + 0) * D + d] += s0;
        a.acc[(bh * 2 + 1) * D + d] += s1;
      }
      if (a.has_b2) d2s[d] += dzb2s[d] + s2;
    }
    if (tid == 0 && rank == 0) {
      float s = 0.0f;
      for (int t = 0; t < BB; ++t) s += seta[t];
      a.dtau[bh * BB + b - 1] -= s;
    }

    fresh();
    // 4. (warp w, hidden block w) dX2 = ce G2 D2_s^T + dA2 Xbar2 + dZ2 W2_s^T; dZ1; d1_s
    {
      const Share sh(lane);
      const float ce = coef * eta_s[sh.r];
      Acc acc;
      wmma::fill_fragment(acc, 0.0f);
      chain<ND, FragBT<T>>(acc, g2, D, d2c + (16 * w) * D, 16, D);
      wmma::store_matrix_sync(stage, acc, 16, wmma::mem_row_major);
      __syncwarp();
      float dx[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) dx[i] = ce * stage[sh.r * 16 + sh.c0 + i];
      __syncwarp();
      wmma::fill_fragment(acc, 0.0f);
      chain<1, FragB<T>>(acc, ats, 16, xb2 + 16 * w, 0, U);
      chain<ND, FragBT<T>>(acc, dz2, D, w2c + (16 * w) * D, 16, D);
      wmma::store_matrix_sync(stage, acc, 16, wmma::mem_row_major);
      __syncwarp();
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int o = sh.r * U + 16 * w + sh.c0 + i;
        const float dZ1 = agpp[o] + (dx[i] + stage[sh.r * 16 + sh.c0 + i]) * gp[o];
        dz1[o] = fw_cvt<T>(dZ1);
        const float col = rows_sum(dZ1);  // every lane of the column's 16 rows holds it
        if (a.has_b1 && sh.r == 0) d1s[16 * w + sh.c0 + i] += dzb1s[16 * w + sh.c0 + i] + col;
      }
    }
    __syncthreads();

    fresh();
    // 4b. W1_s's operand copy where D2_s's was
    {
      const float* w1s = a.w1 + slot * D * Dh + j0;
      for (int e = tid; e < D * U; e += NT) w1c[e] = fw_cvt<T>(w1s[(e / U) * Dh + e % U]);
    }
    __syncthreads();

    fresh();
    // 5. cluster sum 2's share: (ce G1) D1_s^T + dZ1 W1_s^T (warp v: value block v); then the
    //    carried gradients: D1_s += Q^T dZbar1 + K^T dZ1, D2_s += Xbar2^T dZbar2 + X2^T dZ2 +
    //    dA^T G2 (warp w: hidden block w)
    if (w < ND) {
      Acc acc;
      wmma::fill_fragment(acc, 0.0f);
      chain<U / 16, FragBT<T>>(acc, ceg1, U, d1c + (16 * w) * U, 16, U);
      chain<U / 16, FragBT<T>>(acc, dz1, U, w1c + (16 * w) * U, 16, U);
      wmma::store_matrix_sync(ex2 + 16 * w, acc, D, wmma::mem_row_major);
    }
#pragma unroll
    for (int i = 0; i < ND; ++i) {
      outer(D1f[i], qt + 16 * i, D, dzb1 + 16 * w, U);
      outer(D1f[i], kt + 16 * i, D, dz1 + 16 * w, U);
    }
#pragma unroll
    for (int v = 0; v < VL; ++v) {
      outer(D2f[v], xb2 + 16 * w, U, dzb2 + 16 * v, D);
      outer(D2f[v], x2 + 16 * w, U, dz2 + 16 * v, D);
      outer(D2f[v], da + 16 * w, U, g2 + 16 * v, D);
    }
    {  // the same three products into tile VL, through an accumulator loaded from d2t
      Acc acc;
      wmma::load_matrix_sync(acc, d2t, 16, wmma::mem_row_major);
      outer(acc, xb2 + 16 * w, U, dzb2 + 16 * VL, D);
      outer(acc, x2 + 16 * w, U, dz2 + 16 * VL, D);
      outer(acc, da + 16 * w, U, g2 + 16 * VL, D);
      wmma::store_matrix_sync(d2t, acc, 16, wmma::mem_row_major);
    }
    cluster.sync();

    fresh();
    // 6. dK += sum_s (ranks in order), stored by rank 0
    for (int e = tid; e < BB * D; e += NT) {
      const int t = e / D;
      float s = 0.0f;
      for (int p = 0; p < C; ++p) s += cluster.map_shared_rank(ex2, p)[e];
      if (rank == 0 && t < b) a.dk[((bb * T_ + t0 + t) * H + h) * D + e % D] += s;
    }
    __syncthreads();
  }

  // the carried gradients of the weights entering mini-batch n0
#pragma unroll
  for (int i = 0; i < ND; ++i)
    wmma::store_matrix_sync(dw1g + (16 * i) * Dh + j0 + 16 * w, D1f[i], Dh, wmma::mem_row_major);
#pragma unroll
  for (int v = 0; v < VL; ++v)
    wmma::store_matrix_sync(dw2g + (j0 + 16 * w) * D + 16 * v, D2f[v], D, wmma::mem_row_major);
  {
    const Share sh(lane);
    const float* d2t = (const float*)(smem + L::d2t) + w * 256;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      dw2g[(j0 + 16 * w + sh.r) * D + 16 * VL + sh.c0 + i] = d2t[sh.r * 16 + sh.c0 + i];
  }
  if (a.has_b1)
    for (int j = tid; j < U; j += NT) a.db1[bh * Dh + j0 + j] = d1s[j];
  if (a.has_b2 && rank == 0)
    for (int c = tid; c < D; c += NT) a.db2[bh * D + c] = d2s[c];
  cluster.sync();
}

}  // namespace fw_ttt_mlp

// ---------------------------------------------------------------------------------------------
// The read-out's backward on the same cluster (docs/gpu_ttt_kernels.md, "The read-out's backward
// on clusters"): one launch of ops/ttt/triton.py's ``_mlp_bwd_a_kernel`` over a full segment,
// one cluster per (mini-batch n0 + j, batch * head), all of them in parallel. CTA s reads its
// slices W1_s [D, 128], b1_s, W2_s [128, D] of the mini-batch's float32 slot (start weights),
// copies them to operand tiles, and with M = E * A (A1 = Q K^T [+1] as ``_qk_kernel`` stored it,
// A2 = Xbar2 X2^T [+1]) computes:
//   1. Z1_s = K W1_s + b1_s, X2_s = gelu(Z1_s); P2_s = X2_s W2_s           (local)
//   2. cluster sum 1: Z2 = sum_s P2_s + b2, the keys' loss gradient G2, x_hat, g, 1/s
//   3. A_s = G2 W2_s^T, G1_s = A_s gelu'(Z1_s), Zbar1_s = Q W1_s + b1_s - M1 G1_s,
//      Xbar2_s = gelu(Zbar1_s); Pbar2_s = Xbar2_s W2_s, A2_s = Xbar2_s X2_s^T (local)
//   4. cluster sum 2: Zbar2 = sum_s Pbar2_s + b2 - M2 G2; the read-out o = [LN](Zbar2) [+ q]
//      differentiated with dO: dgamma, dbeta, dZbar2, dG2's read-out share -M2^T dZbar2,
//      dM2 = -dZbar2 G2^T, dA2, dE (every CTA)
//   5. dZbar1_s = (dZbar2 W2_s^T + dA2 X2_s) gelu'(Zbar1_s) (local)
//   6. cluster sum 3: dM1 = -sum_s dZbar1_s G1_s^T and dQ's share sum_s dZbar1_s W1_s^T; then
//      dA1, dE, dQ = that + dA1 K [+ dO], dK's read-out share dA1^T Q, deta, dtau (every CTA)
// The rows ``_mlp_bwd_b_kernel`` (or ``ttt_mlp_cluster_bwd_b``) reads are stored as that kernel
// expects: hidden rows by their CTA, value rows, dQ, dK and deta of token t by CTA t % C, the
// scores and the per-mini-batch accumulators by CTA 0.
namespace fw_ttt_mlp {

template <class T, int D>
struct SmemA {
  static constexpr unsigned long al(unsigned long x) { return (x + 127) / 128 * 128; }
  static constexpr unsigned long w1c = 0;                                // T [D][U]
  static constexpr unsigned long w2c = w1c + al(sizeof(T) * D * U);     // T [U][D]
  static constexpr unsigned long stage = w2c + al(sizeof(T) * U * D);   // float [NW][16][16]
  static constexpr unsigned long kt = stage + al(4ul * NW * 256);       // T [BB][D]
  static constexpr unsigned long qt = kt + al(sizeof(T) * BB * D);      // T [BB][D]
  static constexpr unsigned long tgt = qt + al(sizeof(T) * BB * D);     // float [BB][D], then [NW][2][D]
  static constexpr unsigned long gp = tgt + al(4ul * BB * D);           // float [BB][U] gelu'(Z1), gelu'(Zbar1)
  static constexpr unsigned long x2 = gp + al(4ul * BB * U);            // T [BB][U] X2
  static constexpr unsigned long g1 = x2 + al(sizeof(T) * BB * U);      // T G1
  static constexpr unsigned long xb2 = g1 + al(sizeof(T) * BB * U);     // T Xbar2
  static constexpr unsigned long dzb1 = xb2 + al(sizeof(T) * BB * U);   // T dZbar1
  static constexpr unsigned long g2 = dzb1 + al(sizeof(T) * BB * U);    // T [BB][D] G2
  static constexpr unsigned long dzb2 = g2 + al(sizeof(T) * BB * D);    // T dZbar2
  static constexpr unsigned long ex1 = dzb2 + al(sizeof(T) * BB * D);   // float [BB][D + 16]: sums 1, 3
  static constexpr unsigned long ex2 = ex1 + al(4ul * BB * (D + 16));   // float [BB][D + 16]: sum 2
  static constexpr unsigned long zb2 = ex2 + al(4ul * BB * (D + 16));   // float [BB][D]: Zbar2, then dQ
  static constexpr unsigned long e = zb2 + al(4ul * BB * D);            // float [BB][BB] E
  static constexpr unsigned long a1 = e + al(4ul * BB * BB);            // float A1 [+1]
  static constexpr unsigned long a2 = a1 + al(4ul * BB * BB);           // float A2 [+1]
  static constexpr unsigned long dm = a2 + al(4ul * BB * BB);           // float dZbar2 G2^T
  static constexpr unsigned long de = dm + al(4ul * BB * BB);           // float dE
  static constexpr unsigned long m1 = de + al(4ul * BB * BB);           // T [BB][BB] -M1
  static constexpr unsigned long m2 = m1 + al(sizeof(T) * BB * BB);     // T -M2
  static constexpr unsigned long da1 = m2 + al(sizeof(T) * BB * BB);    // T dA1
  static constexpr unsigned long da2 = da1 + al(sizeof(T) * BB * BB);   // T dA2
  static constexpr unsigned long b1s = da2 + al(sizeof(T) * BB * BB);   // float [U]
  static constexpr unsigned long b2s = b1s + al(4ul * U);               // float [D]
  static constexpr unsigned long gam = b2s + al(4ul * D);               // float [D]
  static constexpr unsigned long bet = gam + al(4ul * D);               // float [D]
  static constexpr unsigned long eta = bet + al(4ul * D);               // float [BB]
  static constexpr unsigned long tau = eta + al(4ul * BB);              // float [BB]
  static constexpr unsigned long bytes = tau + al(4ul * BB);
};

// The warp's 16 x 16 staging tile (rows: tokens) written transposed into the contiguous
// [16 features][16 tokens] block at dst: one hidden or value block of the rows' layout.
__device__ __forceinline__ void stage_out_t(const float* stage, float* dst, int lane) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const int x = lane + 32 * k;
    dst[x] = stage[(x % 16) * 16 + x / 16];
  }
}

template <class T, int D>
__global__ void __launch_bounds__(NT, 1) ttt_mlp_cluster_bwd_a(FwTTTMLPClusterBwdAArgs a) {
  constexpr int C = D / 32, ND = D / 16, Dh = 4 * D, RL = D / 32, LX = D + 16;
  using L = SmemA<T, D>;
  FW_DYNAMIC_SMEM(smem);
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = (int)cluster.block_rank();
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32;
  const int nj = a.n1 - a.n0;
  const long long cid = blockIdx.x / C;  // the cluster: (bh, j)
  const long long bh = cid / nj;
  const int jn = (int)(cid % nj), n = a.n0 + jn;
  const int H = a.H, T_ = a.T, h = (int)(bh % H), b = a.b, t0 = n * b;
  const long long bb = bh / H;
  const int j0 = rank * U;
  const long long row = bh * a.seg + jn;
  const long long slot = bh * a.w_bh + (long long)jn * a.w_j;

  T* w1c = (T*)(smem + L::w1c);
  T* w2c = (T*)(smem + L::w2c);
  float* stage = (float*)(smem + L::stage) + w * 256;
  T* kt = (T*)(smem + L::kt);
  T* qt = (T*)(smem + L::qt);
  float* tgt = (float*)(smem + L::tgt);
  float* part = tgt;  // after step 3
  float* gp = (float*)(smem + L::gp);
  T* x2 = (T*)(smem + L::x2);
  T* g1 = (T*)(smem + L::g1);
  T* xb2 = (T*)(smem + L::xb2);
  T* dzb1 = (T*)(smem + L::dzb1);
  T* g2 = (T*)(smem + L::g2);
  T* dzb2 = (T*)(smem + L::dzb2);
  float* ex1 = (float*)(smem + L::ex1);
  float* ex2 = (float*)(smem + L::ex2);
  float* zb2 = (float*)(smem + L::zb2);
  float* dqs = zb2;  // after step 8
  float* es = (float*)(smem + L::e);
  float* a1s = (float*)(smem + L::a1);
  float* a2s = (float*)(smem + L::a2);
  float* dms = (float*)(smem + L::dm);
  float* des = (float*)(smem + L::de);
  T* m1 = (T*)(smem + L::m1);
  T* m2 = (T*)(smem + L::m2);
  T* da1 = (T*)(smem + L::da1);
  T* da2 = (T*)(smem + L::da2);
  float* b1s = (float*)(smem + L::b1s);
  float* b2s = (float*)(smem + L::b2s);
  float* gam = (float*)(smem + L::gam);
  float* bet = (float*)(smem + L::bet);
  float* eta_s = (float*)(smem + L::eta);
  float* tau_s = (float*)(smem + L::tau);

  const T* qg = (const T*)a.q;
  const T* kg = (const T*)a.k;
  const T* vg = (const T*)a.v;
  float* hs = a.hs + row * 4 * Dh * BB;
  float* vs = a.vs + row * 5 * D * BB;
  const long long tok0 = (bb * T_ + t0) * H + h;  // token t0's [B, T, H] index

  // 0. the slot's slices as operand copies, the mini-batch's inputs, E, A1 and -M1
  for (int c = tid; c < D; c += NT) {
    gam[c] = a.has_ln ? a.lnw[h * D + c] : 1.0f;
    bet[c] = a.has_lnb ? a.lnb[h * D + c] : 0.0f;
    b2s[c] = a.has_b2 ? a.b2[slot * D + c] : 0.0f;
  }
  for (int j = tid; j < U; j += NT) b1s[j] = a.has_b1 ? a.b1[slot * Dh + j0 + j] : 0.0f;
  if (tid < BB) {
    eta_s[tid] = tid < b ? a.eta[tok0 + (long long)tid * H] : 0.0f;
    tau_s[tid] = tid < b ? a.tau[h * b + tid] : 0.0f;
  }
  {
    // PER loads in flight per thread before any is converted: the slices' 128 KiB (D 128) come
    // from HBM in a few round trips rather than one per element
    constexpr int PER = D * U / NT < 32 ? D * U / NT : 32;
    const float* w1s = a.w1 + slot * D * Dh + j0;
    const float* w2s = a.w2 + slot * Dh * D + (long long)j0 * D;
    for (int x0 = tid; x0 < 2 * D * U; x0 += PER * NT) {  // W1_s's elements, then W2_s's
      float val[PER];
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int x = x0 + i * NT;
        val[i] = x < D * U ? w1s[(x / U) * Dh + x % U] : w2s[x - D * U];
      }
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int x = x0 + i * NT;
        if (x < D * U)
          w1c[x] = fw_cvt<T>(val[i]);
        else
          w2c[x - D * U] = fw_cvt<T>(val[i]);
      }
    }
  }
  for (int x = tid; x < BB * D; x += NT) {
    const int t = x / D;
    const long long off = (tok0 + (long long)t * H) * D + x % D;
    const T kk = t < b ? kg[off] : fw_cvt<T>(0.0f);
    kt[x] = kk;
    qt[x] = t < b ? qg[off] : fw_cvt<T>(0.0f);
    float tg = t < b ? fw_f32(vg[off]) : 0.0f;
    if (a.residual) tg -= fw_f32(kk);
    tgt[x] = tg;
  }
  {
    const int i = tid / 16, j = tid % 16;  // 256 threads: the 16 x 16 tiles, row i, column j
    const float eta_j = j < b ? a.eta[tok0 + (long long)j * H] : 0.0f;
    const float tau_i = i < b ? a.tau[h * b + i] : 0.0f;
    const float E = j <= i ? tau_i * eta_j : 0.0f;
    const float A1 = a.A[((bh * a.N + n) * BB + j) * BB + i];  // the tile is A1^T
    es[tid] = E;
    a1s[tid] = A1;
    m1[tid] = fw_cvt<T>(-(E * A1));
  }
  __syncthreads();

  // 1. (warp w, hidden block w) Z1 = K W1_s + b1_s (stored), X2 = gelu(Z1), gelu'(Z1)
  {
    Acc acc;
    float z[8];
    hidden_pre<T, D, false>(acc, stage, kt, w1c, m1, g1, b1s, w, lane, z);
    gelu_out<true>(z, Share(lane), w, x2, gp, stage);
    __syncwarp();
    stage_out_t(stage, hs + (j0 + 16 * w) * BB, lane);
  }
  __syncthreads();

  // 2. P2_s = X2_s W2_s (warp v: value block v) -> this CTA's share of cluster sum 1
  value_share<T, D>(x2, w2c, ex1, LX, w);
  cluster.sync();

  // 3. Z2 = sum_s P2_s + b2 (ranks in order) and its loss gradient G2 (warp w: rows 2w, 2w+1);
  //    G2, x_hat, g and 1/s of token t stored by CTA t % C
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int t = 2 * w + rr;
    const bool mine = t % C == rank;
    float G[RL], xh[RL], g[RL], rs;
    z2_grad_row<D>(cluster, ex1, LX, t, b2s, tgt + t * D, gam, bet, a.has_ln, lane, G, xh, g, rs);
    if (a.has_ln && mine) {
#pragma unroll
      for (int i = 0; i < RL; ++i) {
        const int col = lane + 32 * i;
        vs[(3 * D + col) * BB + t] = xh[i];
        vs[(4 * D + col) * BB + t] = g[i];
      }
      if (lane == 0) a.rr[row * BB + t] = rs;
    }
#pragma unroll
    for (int i = 0; i < RL; ++i) {
      const int col = lane + 32 * i;
      g2[t * D + col] = fw_cvt<T>(G[i]);
      if (mine) vs[col * BB + t] = G[i];
    }
  }
  __syncthreads();

  // 4. (warp w, hidden block w) A = G2 W2_s^T (stored), G1 = A gelu'(Z1); Zbar1 = Q W1_s +
  //    b1_s - M1 G1 (stored), Xbar2 = gelu(Zbar1), gelu'(Zbar1) where gelu'(Z1) was
  {
    const Share s(lane);
    Acc acc;
    g2_w2t<T, D>(acc, stage, g2, w2c, w);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int o = s.r * U + 16 * w + s.c0 + i;
      g1[o] = fw_cvt<T>(stage[s.r * 16 + s.c0 + i] * gp[o]);
    }
    stage_out_t(stage, hs + (Dh + j0 + 16 * w) * BB, lane);
    __syncwarp();
    float z[8];
    hidden_pre<T, D, true>(acc, stage, qt, w1c, m1, g1, b1s, w, lane, z);
    gelu_out<true>(z, s, w, xb2, gp, stage);
    __syncwarp();
    stage_out_t(stage, hs + (2 * Dh + j0 + 16 * w) * BB, lane);
  }
  __syncthreads();

  // 5. Pbar2_s = Xbar2_s W2_s (warp v) and A2_s = Xbar2_s X2_s^T (warp 7) -> cluster sum 2
  sum2_shares<T, D>(xb2, x2, w2c, ex2, w);
  cluster.sync();

  // 6. Zq2 = sum_s Pbar2_s + b2, A2 = sum_s A2_s [+1] (ranks in order), -M2 = -(E * A2)
  sum2<D>(cluster, ex2, b2s, a.has_b2, zb2, tid, [&](int r, int j, float A2) {
    const int o = r * BB + j;
    a2s[o] = A2;
    m2[o] = fw_cvt<T>(-(es[o] * A2));
  });
  __syncthreads();

  // 7. Zbar2 = Zq2 - M2 G2 (warp v)
  zbar2_tile<T, D>(zb2, m2, g2, w);
  __syncthreads();

  // 8. the read-out o = [LN](Zbar2) [+ q] differentiated (warp w: rows 2w, 2w+1): dZbar2
  //    (operand tile; stored by CTA t % C), the warp's column sums of dgamma, dbeta
  {
    float pa0[RL], pa1[RL];
#pragma unroll
    for (int i = 0; i < RL; ++i) pa0[i] = pa1[i] = 0.0f;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int t = 2 * w + rr;
      float z[RL], dO[RL], dz[RL];
#pragma unroll
      for (int i = 0; i < RL; ++i) {
        const int col = lane + 32 * i;
        z[i] = zb2[t * D + col];
        dO[i] = t < b ? a.dout[(tok0 + (long long)t * H) * D + col] : 0.0f;
      }
      if (a.has_ln) {
        float mu, rs;
        row_stats<D>(z, mu, rs);
        float xo[RL], sy = 0.0f, syx = 0.0f;
#pragma unroll
        for (int i = 0; i < RL; ++i) {
          const int col = lane + 32 * i;
          xo[i] = (z[i] - mu) * rs;
          pa0[i] += dO[i] * xo[i];
          pa1[i] += dO[i];
          const float dy = gam[col] * dO[i];
          sy += dy;
          syx += dy * xo[i];
        }
        const float my = warp_sum(sy) / D, myx = warp_sum(syx) / D;
#pragma unroll
        for (int i = 0; i < RL; ++i) dz[i] = rs * (gam[lane + 32 * i] * dO[i] - my - xo[i] * myx);
      } else {
#pragma unroll
        for (int i = 0; i < RL; ++i) dz[i] = dO[i];
      }
#pragma unroll
      for (int i = 0; i < RL; ++i) {
        const int col = lane + 32 * i;
        dzb2[t * D + col] = fw_cvt<T>(dz[i]);
        if (t % C == rank) vs[(D + col) * BB + t] = dz[i];
      }
    }
#pragma unroll
    for (int i = 0; i < RL; ++i) {
      part[(w * 2 + 0) * D + lane + 32 * i] = pa0[i];
      part[(w * 2 + 1) * D + lane + 32 * i] = pa1[i];
    }
  }
  __syncthreads();

  // 9. dG2's read-out share -M2^T dZbar2 (value block rank + C k on warp k < 2, stored);
  //    dZbar2 G2^T (warp 7); dgamma, dbeta of the mini-batch (CTA 0)
  if (w < 2) {
    const int v = rank + C * w;
    Acc acc;
    wmma::fill_fragment(acc, 0.0f);
    outer(acc, m2, 16, dzb2 + 16 * v, D);
    wmma::store_matrix_sync(stage, acc, 16, wmma::mem_row_major);
    __syncwarp();
    stage_out_t(stage, vs + (2 * D + 16 * v) * BB, lane);
  }
  if (w == NW - 1) {
    Acc acc;
    wmma::fill_fragment(acc, 0.0f);
    chain<ND, FragBT<T>>(acc, dzb2, D, g2, 16, D);  // G2^T: (d, j) at g2[j D + d]
    wmma::store_matrix_sync(dms, acc, 16, wmma::mem_row_major);
  }
  if (a.has_ln && rank == 0)
    for (int c = tid; c < D; c += NT) {
      float s0 = 0.0f, s1 = 0.0f;
      for (int ww = 0; ww < NW; ++ww) {
        s0 += part[(ww * 2 + 0) * D + c];
        s1 += part[(ww * 2 + 1) * D + c];
      }
      a.acc[((bh * a.N + n) * 2 + 0) * D + c] = s0;
      a.acc[((bh * a.N + n) * 2 + 1) * D + c] = s1;
    }
  __syncthreads();

  // 10. dM2 = -dZbar2 G2^T, dA2 = E * dM2 (dA2^T stored by CTA 0), dE = A2 * dM2 (causal)
  {
    const int i = tid / 16, j = tid % 16;
    const float dM = -dms[tid];
    const float dA = j <= i ? es[tid] * dM : 0.0f;
    da2[tid] = fw_cvt<T>(dA);
    des[tid] = j <= i ? dM * a2s[tid] : 0.0f;
    if (rank == 0) a.at[row * BB * BB + j * BB + i] = dA;
  }
  __syncthreads();

  // 11. (warp w, hidden block w) dZbar1 = (dZbar2 W2_s^T + dA2 X2_s) gelu'(Zbar1) (stored)
  {
    const Share s(lane);
    Acc acc;
    wmma::fill_fragment(acc, 0.0f);
    chain<ND, FragBT<T>>(acc, dzb2, D, w2c + (16 * w) * D, 16, D);
    chain<1, FragB<T>>(acc, da2, 16, x2 + 16 * w, 0, U);
    wmma::store_matrix_sync(stage, acc, 16, wmma::mem_row_major);
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int o = s.r * U + 16 * w + s.c0 + i;
      const float dz = stage[s.r * 16 + s.c0 + i] * gp[o];
      dzb1[o] = fw_cvt<T>(dz);
      stage[s.r * 16 + s.c0 + i] = dz;
    }
    __syncwarp();
    stage_out_t(stage, hs + (3 * Dh + j0 + 16 * w) * BB, lane);
  }
  __syncthreads();

  // 12. this CTA's shares of cluster sum 3: dZbar1_s W1_s^T (warp v) and dZbar1_s G1_s^T
  //     (warp 7), where sum 1's were (every peer has passed its step 3)
  if (w < ND) {
    Acc acc;
    wmma::fill_fragment(acc, 0.0f);
    chain<U / 16, FragBT<T>>(acc, dzb1, U, w1c + (16 * w) * U, 16, U);  // W1_s^T: (u, d) at w1c[d U + u]
    wmma::store_matrix_sync(ex1 + 16 * w, acc, LX, wmma::mem_row_major);
  }
  if (w == NW - 1) {
    Acc acc;
    wmma::fill_fragment(acc, 0.0f);
    chain<U / 16, FragBT<T>>(acc, dzb1, U, g1, 16, U);  // G1_s^T: (u, j) at g1[j U + u]
    wmma::store_matrix_sync(ex1 + D, acc, LX, wmma::mem_row_major);
  }
  cluster.sync();

  // 13. dQ's share (ranks in order); dM1 = -sum_s dZbar1_s G1_s^T, dA1 = E * dM1,
  //     dE += A1 * dM1 (causal)
  for (int x = tid; x < BB * LX; x += NT) {
    const int r = x / LX, col = x % LX;
    float s = 0.0f;
    for (int p = 0; p < C; ++p) s += cluster.map_shared_rank(ex1, p)[x];
    if (col < D) {
      dqs[r * D + col] = s;
    } else {
      const int j = col - D, o = r * BB + j;
      const float dM = -s;
      da1[o] = fw_cvt<T>(j <= r ? es[o] * dM : 0.0f);
      if (j <= r) des[o] += dM * a1s[o];
    }
  }
  __syncthreads();

  // 14. dQ = (the share) + dA1 K [+ dO], dK's read-out share dA1^T Q (warps, value blocks;
  //     token t written by CTA t % C); deta = dE tau, dtau = dE^T eta
  for (int qn = w; qn < 2 * ND; qn += NW) {
    const int v = qn % ND;
    Acc acc;
    if (qn < ND) {
      wmma::load_matrix_sync(acc, dqs + 16 * v, D, wmma::mem_row_major);
      chain<1, FragB<T>>(acc, da1, 16, kt + 16 * v, 0, D);
    } else {
      wmma::fill_fragment(acc, 0.0f);
      outer(acc, da1, 16, qt + 16 * v, D);
    }
    wmma::store_matrix_sync(stage, acc, 16, wmma::mem_row_major);
    __syncwarp();
    const Share s(lane);
    if (s.r < b && s.r % C == rank) {
      const long long off = (tok0 + (long long)s.r * H) * D + 16 * v + s.c0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        float x = stage[s.r * 16 + s.c0 + i];
        if (qn < ND) {
          if (a.residual) x += a.dout[off + i];
          a.dq[off + i] = x;
        } else {
          a.dk[off + i] = x;
        }
      }
    }
    __syncwarp();
  }
  if (tid < BB) {  // deta_j = sum_i dE_ij tau_i
    float s = 0.0f;
    for (int i = 0; i < BB; ++i) s += des[i * BB + tid] * tau_s[i];
    if (tid < b && tid % C == rank) a.deta[tok0 + (long long)tid * H] = s;
  } else if (tid < 2 * BB && rank == 0) {  // dtau_i = sum_j dE_ij eta_j
    const int i = tid - BB;
    float s = 0.0f;
    for (int j = 0; j < BB; ++j) s += des[i * BB + j] * eta_s[j];
    a.dtau[(bh * a.N + n) * BB + i] = s;
  }
  cluster.sync();  // no CTA leaves while a peer may still read its shared memory
}

}  // namespace fw_ttt_mlp

namespace fw_ttt_mlp {
// The kernels as the launchers take them: argument struct, kernel, shared memory, clusters.
template <class T, int D>
struct FwdKernel {
  using Args = FwTTTMLPClusterArgs;
  static constexpr unsigned long bytes = Smem<T, D>::bytes;
  static void (*get())(Args) { return ttt_mlp_cluster_fwd<T, D>; }
  static unsigned clusters(const Args& a) { return (unsigned)(a.B * a.H); }
};

template <class T, int D>
struct BwdKernel {
  using Args = FwTTTMLPClusterBwdArgs;
  static constexpr unsigned long bytes = SmemB<T, D>::bytes;
  static void (*get())(Args) { return ttt_mlp_cluster_bwd_b<T, D>; }
  static unsigned clusters(const Args& a) { return (unsigned)(a.B * a.H); }
};

template <class T, int D>
struct BwdAKernel {  // one cluster per (batch * head, mini-batch of the segment)
  using Args = FwTTTMLPClusterBwdAArgs;
  static constexpr unsigned long bytes = SmemA<T, D>::bytes;
  static void (*get())(Args) { return ttt_mlp_cluster_bwd_a<T, D>; }
  static unsigned clusters(const Args& a) { return (unsigned)(a.B * a.H * (a.n1 - a.n0)); }
};

// A kernel's dynamic shared memory per CTA (bytes) for dtype 0 float32 (emulation only),
// 1 bfloat16, 2 float16 (the same as bfloat16) and D 32, 64 or 128.
template <template <class, int> class K>
unsigned long smem_of(int dtype, int D) {
  if (dtype == 0) return D == 32 ? K<float, 32>::bytes : D == 64 ? K<float, 64>::bytes : K<float, 128>::bytes;
  return D == 32 ? K<fw_bf16, 32>::bytes : D == 64 ? K<fw_bf16, 64>::bytes : K<fw_bf16, 128>::bytes;
}
}  // namespace fw_ttt_mlp

#ifndef FW_EMULATE
// CUDA launchers (sm_90): one cluster of D / 32 CTAs per (batch, head), the read-out's
// backward one per (batch, head, mini-batch of the segment). dtype 1 bfloat16,
// 2 float16; D 64 or 128. Return a cudaError_t (cudaErrorInvalidValue for another dtype or
// head size).
namespace fw_ttt_mlp {
template <template <class, int> class K, class T, int D>
static cudaError_t launch(const typename K<T, D>::Args& a, cudaStream_t stream) {
  constexpr int C = D / 32;
  const int bytes = (int)K<T, D>::bytes;
  auto kernel = K<T, D>::get();
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(K<T, D>::clusters(a) * C, 1, 1);
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

template <template <class, int> class K>
static int dispatch(const typename K<fw_bf16, 64>::Args* a, int dtype, int D, void* stream) {
  cudaStream_t s = (cudaStream_t)stream;
  if (dtype == 1 && D == 64) return (int)launch<K, fw_bf16, 64>(*a, s);
  if (dtype == 1 && D == 128) return (int)launch<K, fw_bf16, 128>(*a, s);
  if (dtype == 2 && D == 64) return (int)launch<K, fw_half, 64>(*a, s);
  if (dtype == 2 && D == 128) return (int)launch<K, fw_half, 128>(*a, s);
  return (int)cudaErrorInvalidValue;
}
}  // namespace fw_ttt_mlp

extern "C" int fw_ttt_mlp_cluster_launch(const FwTTTMLPClusterArgs* a, int dtype, int D,
                                         void* stream) {
  return fw_ttt_mlp::dispatch<fw_ttt_mlp::FwdKernel>(a, dtype, D, stream);
}

extern "C" int fw_ttt_mlp_cluster_bwd_b_launch(const FwTTTMLPClusterBwdArgs* a, int dtype, int D,
                                               void* stream) {
  return fw_ttt_mlp::dispatch<fw_ttt_mlp::BwdKernel>(a, dtype, D, stream);
}

extern "C" int fw_ttt_mlp_cluster_bwd_a_launch(const FwTTTMLPClusterBwdAArgs* a, int dtype, int D,
                                               void* stream) {
  return fw_ttt_mlp::dispatch<fw_ttt_mlp::BwdAKernel>(a, dtype, D, stream);
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
template <template <class, int> class K, class T, int D>
static void emulate(const typename K<T, D>::Args& a, unsigned order) {
  fw_emu::Config cfg{dim3(K<T, D>::clusters(a) * (D / 32)), dim3(NT), D / 32,
                     (size_t)K<T, D>::bytes, order};
  fw_emu::launch(K<T, D>::get(), cfg, a);
}

template <template <class, int> class K, class T>
static void emulate_d(const typename K<T, 64>::Args& a, int D, unsigned order) {
  if (D == 32)
    emulate<K, T, 32>(a, order);
  else if (D == 64)
    emulate<K, T, 64>(a, order);
  else if (D == 128)
    emulate<K, T, 128>(a, order);
  else
    throw std::invalid_argument("D must be 32, 64 or 128");
}

template <template <class, int> class K>
static const char* emulate_entry(const typename K<float, 64>::Args* a, int dtype, int D,
                                 unsigned order) {
  return fw_emu::catch_error([&] {
    if (dtype == 0)
      emulate_d<K, float>(*a, D, order);
    else if (dtype == 1)
      emulate_d<K, fw_bf16>(*a, D, order);
    else if (dtype == 2)
      emulate_d<K, fw_half>(*a, D, order);
    else
      throw std::invalid_argument("dtype must be 0 (float32), 1 (bfloat16) or 2 (float16)");
  });
}
}  // namespace fw_ttt_mlp

extern "C" const char* fw_emu_ttt_mlp_cluster_fwd(const FwTTTMLPClusterArgs* a, int dtype, int D,
                                                  unsigned order) {
  return fw_ttt_mlp::emulate_entry<fw_ttt_mlp::FwdKernel>(a, dtype, D, order);
}

extern "C" const char* fw_emu_ttt_mlp_cluster_bwd_b(const FwTTTMLPClusterBwdArgs* a, int dtype,
                                                    int D, unsigned order) {
  return fw_ttt_mlp::emulate_entry<fw_ttt_mlp::BwdKernel>(a, dtype, D, order);
}

extern "C" const char* fw_emu_ttt_mlp_cluster_bwd_a(const FwTTTMLPClusterBwdAArgs* a, int dtype,
                                                    int D, unsigned order) {
  return fw_ttt_mlp::emulate_entry<fw_ttt_mlp::BwdAKernel>(a, dtype, D, order);
}

// The dynamic shared memory a CTA takes (bytes), dtype and D as above.
extern "C" unsigned long fw_emu_ttt_mlp_cluster_smem(int dtype, int D) {
  return fw_ttt_mlp::smem_of<fw_ttt_mlp::FwdKernel>(dtype, D);
}

extern "C" unsigned long fw_emu_ttt_mlp_cluster_bwd_b_smem(int dtype, int D) {
  return fw_ttt_mlp::smem_of<fw_ttt_mlp::BwdKernel>(dtype, D);
}
extern "C" unsigned long fw_emu_ttt_mlp_cluster_bwd_a_smem(int dtype, int D) {
  return fw_ttt_mlp::smem_of<fw_ttt_mlp::BwdAKernel>(dtype, D);
}
#endif
