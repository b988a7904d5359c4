// y[M, N] = x[M, K] @ W[K, N] in fp32 for a handful of rows (decoding), as an XLA FFI handler.
//
// W is stored packed in column panels of 16: panels[p, k, j] = W[k, 16 p + j] (zero where
// 16 p + j >= N), so one panel is one contiguous [K, 16] stream. A panel is computed for 16
// rows at a time with 16 accumulators of 16 floats: per k, one 64-byte load of the panel and
// 16 broadcast multiply-adds from x^T. The weights are read once per call, sequentially, which
// keeps the hardware prefetchers busy. On the 2-core benchmark host XLA's library dots at
// M = 16 reach about half the FMA peak, this kernel about two thirds of it (docs/rollout.md).
//
// Every output element is one sequential sum over k, computed by one thread: the result does
// not depend on the thread count or on scheduling. Panels are handed out through an atomic
// counter to the calling thread and the tasks it schedules on XLA's intra-op pool; the caller
// only waits for panels a running thread has claimed, so a busy pool never deadlocks it.
//
// Portable C++ (GCC/Clang vector extensions); built for the host CPU on first use by
// bapo_jax/kernels/panel_matmul.py.

#include <algorithm>
#include <atomic>
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

typedef float Vec __attribute__((vector_size(kPanel * sizeof(float))));

// x^T in row tiles: xt[g, k, r] = x[kRows g + r, k] (zero past M).
void TransposeRows(const float* x, int64_t m, int64_t k, float* xt) {
  const int64_t tiles = (m + kRows - 1) / kRows;
  std::memset(xt, 0, sizeof(float) * tiles * k * kRows);
  for (int64_t row = 0; row < m; ++row) {
    float* out = xt + (row / kRows) * k * kRows + row % kRows;
    const float* in = x + row * k;
    for (int64_t i = 0; i < k; ++i) out[i * kRows] = in[i];
  }
}

// y[:, 16 p : 16 p + 16] for every row tile.
void Panel(const float* xt, const float* panel, float* y, int64_t m, int64_t k, int64_t n,
           int64_t p) {
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
      std::memcpy(y + (tile * kRows + r) * n + col, &acc[r], sizeof(float) * width);
    }
  }
}

struct Work {
  const float* xt;
  const float* panels;
  float* y;
  int64_t m, k, n, num_panels;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    for (int64_t p = next.fetch_add(1); p < num_panels; p = next.fetch_add(1)) {
      Panel(xt, panels + p * k * kPanel, y, m, k, n, p);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                       ffi::Buffer<ffi::F32> panels, ffi::ResultBuffer<ffi::F32> y) {
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
  std::vector<float> xt(((m + kRows - 1) / kRows) * k * kRows);
  TransposeRows(x.typed_data(), m, k, xt.data());

  auto work = std::make_shared<Work>();
  work->xt = xt.data();
  work->panels = panels.typed_data();
  work->y = y->typed_data();
  work->m = m;
  work->k = k;
  work->n = n;
  work->num_panels = wd[0];
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->num_panels) - 1;
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
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
