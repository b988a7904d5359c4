// y[M, N] = x[M, K] @ W[K, N] in fp32 for a handful of rows (decoding), as an XLA FFI handler.
//
// W is stored packed in column panels of 16: panels[p, k, j] = W[k, 16 p + j] (zero where
// 16 p + j >= N), so one panel is one contiguous [K, 16] stream. A panel is computed for a tile
// of rows at a time, the accumulators in vector registers: per k, one 64-byte load of the panel
// and a broadcast multiply-add per row and register. The tile fits the host's registers: with
// AVX-512 a panel row is one register and a tile 16 rows (16 accumulators); with AVX2 two
// registers and 6 rows (12 accumulators of the 16 registers; 16 rows of 64-byte vectors there
// spilled to the stack every step, ~10 GFLOP/s). The weights are read once per call,
// sequentially, which keeps the hardware prefetchers busy (docs/rollout.md).
//
// Fused around the product, because in XLA they are thunks of their own (a 31M decode step ran
// 174 fusions besides its 33 products, 106 with these inside): an optional RMSNorm of x's rows
// (`scale`, `eps`: HF Qwen2RMSNorm, in fp32) before x is transposed, and an optional
// `residual` added to each output as it is written:
//
//     y = residual + rms_norm(x; scale, eps) @ W
//
// Every output element is one sequential sum over k, computed by one thread: the result does
// not depend on the thread count or on scheduling. Runs of adjacent panels are shared out to
// the calling thread and XLA's intra-op pool (work_sharing.h).
//
// Portable C++ (GCC/Clang vector extensions); built for the host CPU on first use by
// bapo_jax/kernels/library.py.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "work_sharing.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using bapo_kernels::CeilDiv;

constexpr int64_t kPanel = 16;  // columns per panel
constexpr int64_t kPrefetch = 16;  // panel rows (64 bytes each) read ahead of the loads

// Register tile: kLanes floats per vector register, kRows rows of kParts = kPanel / kLanes
// accumulators each, plus kParts registers for the panel row and one for the broadcast.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16, kRows = 16;  // 32 zmm registers
#elif defined(__AVX__)
constexpr int64_t kLanes = 8, kRows = 6;  // 16 ymm registers
#else
constexpr int64_t kLanes = 4, kRows = 3;  // 16 xmm registers (SSE2)
#endif
constexpr int64_t kParts = kPanel / kLanes;

typedef float Vec __attribute__((vector_size(kPanel * sizeof(float))));
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
// The same vector at any float's address: plain vector loads and stores (a memcpy of several
// registers' worth went through the stack, and its reload stalled on store forwarding).
typedef float LanesAt __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

// 1 / sqrt(mean(x^2) + eps) of one row: squares summed in 16 fp32 lanes, the lanes in double.
float InverseRms(const float* x, int64_t k, float eps) {
  Vec lanes = {};
  int64_t i = 0;
  for (; i + kPanel <= k; i += kPanel) {
    Vec v;
    std::memcpy(&v, x + i, sizeof(Vec));
    lanes += v * v;
  }
  double squares = 0.0;
  for (int64_t j = 0; j < kPanel; ++j) squares += lanes[j];
  for (; i < k; ++i) squares += static_cast<double>(x[i]) * x[i];
  return 1.0f / std::sqrt(static_cast<float>(squares / k) + eps);
}

// x^T in row tiles: xt[g, k, r] = x[kRows g + r, k] (zero past M). In blocks of kRows rows x
// 16 columns, so a block's output and its input lines stay in L1.
void TransposeRows(const float* x, int64_t m, int64_t k, float* xt) {
  static const float kZeros[kPanel] = {};
  for (int64_t tile = 0; tile * kRows < m; ++tile) {
    const int64_t rows = std::min(kRows, m - tile * kRows);
    float* out = xt + tile * k * kRows;
    for (int64_t i0 = 0; i0 < k; i0 += kPanel) {
      const int64_t width = std::min(kPanel, k - i0);
      for (int64_t r = 0; r < kRows; ++r) {
        const float* in = r < rows ? x + (tile * kRows + r) * k + i0 : kZeros;
        for (int64_t j = 0; j < width; ++j) out[(i0 + j) * kRows + r] = in[j];
      }
    }
  }
}

// HF Qwen2RMSNorm in fp32, row by row: out = scale * (x * InverseRms(x)).
void RmsNormRows(const float* x, int64_t m, int64_t k, const float* scale, float eps,
                 float* out) {
  for (int64_t row = 0; row < m; ++row) {
    const float* in = x + row * k;
    const float inv = InverseRms(in, k, eps);
    for (int64_t i = 0; i < k; ++i) out[row * k + i] = scale[i] * (in[i] * inv);
  }
}

// The product over x^T's row tiles, one 16-column panel at a time.
struct Product {
  const float* xt;
  const float* panels;
  const float* residual;  // [M, N] added to the product, or nullptr
  float* y;
  int64_t m, k, n;

  // y[:, 16 p : 16 p + 16] for every row tile.
  void Panel(int64_t p) const {
    const float* panel = panels + p * k * kPanel;
    const int64_t col = p * kPanel;
    const int64_t width = std::min(kPanel, n - col);
    for (int64_t tile = 0; tile * kRows < m; ++tile) {
      const float* a = xt + tile * k * kRows;
      Lanes acc[kRows][kParts] = {};
      for (int64_t i = 0; i < k; ++i) {
        Lanes b[kParts];
        for (int64_t part = 0; part < kParts; ++part) {
          b[part] = *reinterpret_cast<const LanesAt*>(panel + i * kPanel + part * kLanes);
        }
        __builtin_prefetch(panel + (i + kPrefetch) * kPanel);
#pragma GCC unroll 16
        for (int64_t r = 0; r < kRows; ++r) {
          const float ar = a[i * kRows + r];
#pragma GCC unroll 4
          for (int64_t part = 0; part < kParts; ++part) acc[r][part] += ar * b[part];
        }
      }
      const int64_t rows = std::min(kRows, m - tile * kRows);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = (tile * kRows + r) * n + col;
        Vec out;
        for (int64_t part = 0; part < kParts; ++part) {
          *reinterpret_cast<LanesAt*>(reinterpret_cast<float*>(&out) + part * kLanes) = acc[r][part];
        }
        if (residual != nullptr) {
          Vec add = {};
          std::memcpy(&add, residual + at, sizeof(float) * width);
          out = add + out;
        }
        std::memcpy(y + at, &out, sizeof(float) * width);
      }
    }
  }
};

// Claims per thread: a few, so a helper that starts late still takes its share. Each claim is a
// run of adjacent panels, so each thread streams long contiguous stretches of W (one panel per
// claim ran ~10 % slower, its prefetches running into the other thread's panels).
constexpr int64_t kClaimsPerThread = 2;

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                       ffi::Buffer<ffi::F32> panels, ffi::Buffer<ffi::F32> scale,
                       ffi::Buffer<ffi::F32> residual, float eps,
                       ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = panels.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kPanel) {
    return ffi::Error::InvalidArgument("panel_matmul: want x [M, K], panels [P, K, 16], y [M, N]");
  }
  const int64_t m = xd[0], k = xd[1], n = yd[1];
  if (wd[1] != k || yd[0] != m || wd[0] != CeilDiv(n, kPanel)) {
    return ffi::Error::InvalidArgument("panel_matmul: x, panels and y shapes disagree");
  }
  // An empty `scale` / `residual` means none.
  if (scale.element_count() != 0 && scale.element_count() != static_cast<size_t>(k)) {
    return ffi::Error::InvalidArgument("panel_matmul: scale must be [K] or empty");
  }
  if (residual.element_count() != 0 && residual.element_count() != static_cast<size_t>(m * n)) {
    return ffi::Error::InvalidArgument("panel_matmul: residual must be [M, N] or empty");
  }
  // Per-thread scratch, kept for the thread's next call.
  thread_local std::vector<float> normed, xt;
  const float* rows = x.typed_data();
  if (scale.element_count() != 0) {
    normed.resize(m * k);
    RmsNormRows(rows, m, k, scale.typed_data(), eps, normed.data());
    rows = normed.data();
  }
  xt.resize(CeilDiv(m, kRows) * k * kRows);
  TransposeRows(rows, m, k, xt.data());

  const Product product{xt.data(), panels.typed_data(),
                        residual.element_count() != 0 ? residual.typed_data() : nullptr,
                        y->typed_data(), m, k, n};
  const int64_t num_panels = wd[0];
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  bapo_kernels::ShareOut(pool, num_panels, CeilDiv(num_panels, threads * kClaimsPerThread),
                         [&product](int64_t begin, int64_t end) {
                           for (int64_t p = begin; p < end; ++p) product.Panel(p);
                         });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BapoPanelMatmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // panels
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // residual
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>());
