// PyTorch binding of the TTT-MLP cluster forward's launcher (ttt_mlp_cluster.cu): the Python
// side (ops/ttt/cluster.py) checks and allocates every tensor and passes raw addresses, the
// sizes and flags, and the current CUDA stream. Built on first use by
// torch.utils.cpp_extension.load with nvcc for sm_90a.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "ttt_mlp_cluster.h"

extern "C" int fw_ttt_mlp_cluster_launch(const FwTTTMLPClusterArgs* a, int dtype, int D,
                                         void* stream);
extern "C" const char* fw_ttt_mlp_cluster_error(int code);

// ptrs: q, k, v, eta, tau, lnw, lnb, w1, c1, w2, c2, o, s1, sb1, s2, sb2, ck1, ckb1, ck2, ckb2;
// ints: B, T, H, b, N, NF, seg, store_ck, has_b1, has_b2, has_ln, has_lnb, residual.
static void launch(const std::vector<int64_t>& ptrs, const std::vector<int64_t>& ints,
                   int64_t dtype, int64_t D, int64_t stream) {
  TORCH_CHECK(ptrs.size() == 20, "ttt_mlp_cluster: 20 addresses expected, got ", ptrs.size());
  TORCH_CHECK(ints.size() == 13, "ttt_mlp_cluster: 13 sizes and flags expected, got ",
              ints.size());
  FwTTTMLPClusterArgs a;
  const void** in[] = {&a.q, &a.k, &a.v};
  for (int i = 0; i < 3; ++i) *in[i] = reinterpret_cast<const void*>(ptrs[i]);
  a.eta = reinterpret_cast<const float*>(ptrs[3]);
  a.tau = reinterpret_cast<const float*>(ptrs[4]);
  a.lnw = reinterpret_cast<const float*>(ptrs[5]);
  a.lnb = reinterpret_cast<const float*>(ptrs[6]);
  float** out[] = {&a.w1, &a.c1, &a.w2, &a.c2};
  for (int i = 0; i < 4; ++i) *out[i] = reinterpret_cast<float*>(ptrs[7 + i]);
  a.o = reinterpret_cast<void*>(ptrs[11]);
  float** rest[] = {&a.s1, &a.sb1, &a.s2, &a.sb2, &a.ck1, &a.ckb1, &a.ck2, &a.ckb2};
  for (int i = 0; i < 8; ++i) *rest[i] = reinterpret_cast<float*>(ptrs[12 + i]);
  int* sizes[] = {&a.B, &a.T, &a.H, &a.b, &a.N, &a.NF, &a.seg, &a.store_ck,
                  &a.has_b1, &a.has_b2, &a.has_ln, &a.has_lnb, &a.residual};
  for (int i = 0; i < 13; ++i) *sizes[i] = static_cast<int>(ints[i]);
  const int err = fw_ttt_mlp_cluster_launch(&a, static_cast<int>(dtype), static_cast<int>(D),
                                            reinterpret_cast<void*>(stream));
  TORCH_CHECK(err == 0, "ttt_mlp_cluster launch failed: ", fw_ttt_mlp_cluster_error(err));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("launch", &launch, "TTT-MLP cluster forward (ops/ttt/cluster.py)");
}
