// y[M, N] = x[M, K] @ W[K, N] in fp32 for a handful of rows (decoding), as an XLA FFI handler.
//
// W is stored packed in column panels of 16: panels[p, k, j] = W[k, 16 p + j] (zero where
// 16 p + j >= N), so one panel is one contiguous [K, 16] stream. A panel is computed for 16
// rows at a time with 16 accumulators of 16 floats: per k, one 64-byte load of the panel and
// 16 broadcast multiply-adds from x^T. The weights are read once per call, sequentially, which
// keeps the hardware prefetchers busy. On the 2-core benchmark host XLA's library dots at
// M = 16 reach about half the FMA peak, this kernel about two thirds of it (docs/rollout.md).
//
// Fused around the product, because in XLA they are thunks of their own (a 31M decode step ran
// 174 fusions besides its 33 products, 106 with these inside): an optional RMSNorm of x's rows
// (`scale`, `eps`: HF Qwen2RMSNorm, in fp32) before x is transposed, and an optional
// `residual` added to each output as it is written:
//
//     y = residual + rms_norm(x; scale, eps) @ W
//
// Every output element is one sequential sum over k, computed by one thread: the result does
// not depend on the thread count or on scheduling. Runs of adjacent panels are handed out
// through an atomic counter to the calling thread and the tasks it schedules on XLA's intra-op
// pool; the caller only waits for panels a running thread has claimed, so a busy pool never
// deadlocks it.
//
// Portable C++ (GCC/Clang vector extensions); built for the host CPU on first use by
// bapo_jax/kernels/library.py.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 16;  // columns per panel
constexpr int64_t kRows = 16;   // rows per register tile
constexpr int64_t kPrefetch = 16;  // panel rows (64 bytes each) read ahead of the loads

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

typedef float Vec __attribute__((vector_size(kPanel * sizeof(float))));

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

// x^T in row tiles: xt[g, k, r] = x[kRows g + r, k] (zero past M). In 16 x 16 blocks, so a
// block's 1 KB of output and its 16 input lines stay in L1.
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

struct Work {
  const float* xt;
  const float* panels;
  const float* residual;  // [M, N] added to the product, or nullptr
  float* y;
  int64_t m, k, n, num_panels, chunk;
  std::atomic<int64_t> next{0};  // first unclaimed panel
  std::atomic<int64_t> done{0};  // panels written

  // y[:, 16 p : 16 p + 16] for every row tile.
  void Panel(int64_t p) const {
    const float* panel = panels + p * k * kPanel;
    const int64_t col = p * kPanel;
    const int64_t width = std::min(kPanel, n - col);
    for (int64_t tile = 0; tile * kRows < m; ++tile) {
      const float* a = xt + tile * k * kRows;
      Vec acc[kRows] = {};
      for (int64_t i = 0; i < k; ++i) {
        Vec b;
        std::memcpy(&b, panel + i * kPanel, sizeof(Vec));
        __builtin_prefetch(panel + (i + kPrefetch) * kPanel);
#pragma GCC unroll 16
        for (int64_t r = 0; r < kRows; ++r) acc[r] += a[i * kRows + r] * b;
      }
      const int64_t rows = std::min(kRows, m - tile * kRows);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = (tile * kRows + r) * n + col;
        if (residual != nullptr) {
          Vec add = {};
          std::memcpy(&add, residual + at, sizeof(float) * width);
          acc[r] = add + acc[r];
        }
        std::memcpy(y + at, &acc[r], sizeof(float) * width);
      }
    }
  }

  // Claims runs of `chunk` adjacent panels until none is left: each thread streams long
  // contiguous stretches of W (one panel per claim ran ~10 % slower, its prefetches running
  // into the other thread's panels).
  void Run() {
    for (int64_t c = next.fetch_add(chunk); c < num_panels; c = next.fetch_add(chunk)) {
      const int64_t end = std::min(c + chunk, num_panels);
      for (int64_t p = c; p < end; ++p) Panel(p);
      done.fetch_add(end - c, std::memory_order_release);
    }
  }
};

// Claims per thread: a few, so a helper that starts late still takes its share.
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
  if (wd[1] != k || yd[0] != m || wd[0] != (n + kPanel - 1) / kPanel) {
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
  xt.resize(((m + kRows - 1) / kRows) * k * kRows);
  TransposeRows(rows, m, k, xt.data());

  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  auto work = std::make_shared<Work>();  // shared: a helper may start after the caller returns
  work->xt = xt.data();
  work->panels = panels.typed_data();
  work->residual = residual.element_count() != 0 ? residual.typed_data() : nullptr;
  work->y = y->typed_data();
  work->m = m;
  work->k = k;
  work->n = n;
  work->num_panels = wd[0];
  work->chunk = std::max<int64_t>(1, CeilDiv(work->num_panels, threads * kClaimsPerThread));
  const int64_t helpers = std::min(threads, CeilDiv(work->num_panels, work->chunk)) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->num_panels) {
    std::this_thread::yield();
  }
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
