// One decode step's attention against the KV cache, fp32, as an XLA FFI handler: for every
// row b and KV head k, its G = N / K query heads (grouped-query attention, K/V never repeated)
//
//     s[g, t] = q[b, k, g] . keys[b, k, :, t]        (q already scaled by 1 / sqrt(H))
//     p[g, t] = exp(s[g, t] - max_t s) / sum_t exp(...)   over the valid slots t, 0 elsewhere
//     out[b, k, g] = sum_t p[g, t] values[b, k, t]
//
// with keys [B, K, H, S] and values [B, K, S, H], so both products run along contiguous rows of
// the cache. In XLA this step is ~7 small thunks per layer (two batched dots, mask, max, exp,
// sum, divide) of ~15-25 us each on the benchmark host; here it is one call.
//
// The cache is cold when a step reaches it (the step streams every weight in between), so the
// call is bound by reading it: the (row, KV head) groups are shared out to the calling thread and
// XLA's intra-op pool (work_sharing.h). Each output is computed by one thread in a fixed order, so the
// result does not depend on the thread count. exp is a vectorized polynomial (Cephes' expf,
// relative error ~2e-7).
//
// Portable C++ (GCC/Clang vector extensions); built with panel_matmul.cc by
// bapo_jax/kernels/library.py.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "work_sharing.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IntVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

// e^x per lane for x <= 0 (softmax arguments): x = n ln2 + r, |r| <= ln2 / 2,
// e^x = 2^n * P(r) with Cephes' degree-5 polynomial; below -87.3 the result is 0. Every row
// needs a valid slot (a decode step always has the one it writes), so its max is a real score.
Vec ExpNonPositive(Vec x) {
  const IntVec underflow = x < -87.33654475f;
  x = underflow ? Vec{} - 87.33654475f : x;
  const Vec fx = x * 1.44269504088896341f + 0.5f;
  IntVec n = __builtin_convertvector(fx, IntVec);  // truncates toward zero
  n += __builtin_convertvector(n, Vec) > fx;      // -1 where that rounded up: floor(fx)
  const Vec nf = __builtin_convertvector(n, Vec);
  const Vec r = x - nf * 0.693359375f + nf * 2.12194440e-4f;  // x - n ln2 in two parts
  Vec p = Vec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const IntVec bits = (n + 127) << 23;  // 2^n
  Vec scale;
  std::memcpy(&scale, &bits, sizeof(Vec));
  return underflow ? Vec{} : p * scale;
}

// A score far below any real one: its exp underflows to exactly 0.
constexpr float kMasked = -3.0e38f;

Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(Vec));
  return v;
}

// One (row, KV head): its g queries [g, h] against keys [h, s] and values [s, h] -> out [g, h].
void Group(const float* __restrict__ q, const float* __restrict__ keys,
           const float* __restrict__ values, const float* __restrict__ penalty, int64_t g,
           int64_t h, int64_t s, int64_t padded, float* __restrict__ scores,
           float* __restrict__ out) {
  std::fill(scores, scores + g * padded, 0.0f);
  for (int64_t i = 0; i < h; ++i) {  // s[j, t] = sum_i q[j, i] keys[i, t]
    const float* __restrict__ key = keys + i * s;
    for (int64_t j = 0; j < g; ++j) {
      const float qi = q[j * h + i];
      float* __restrict__ row = scores + j * padded;
      for (int64_t t = 0; t < s; ++t) row[t] += qi * key[t];
    }
  }
  for (int64_t j = 0; j < g; ++j) {  // softmax over the valid slots
    float* row = scores + j * padded;
    Vec top = Vec{} + kMasked;
    for (int64_t t = 0; t < padded; t += kLanes) {
      const Vec v = Load(row + t) + Load(penalty + t);
      top = v > top ? v : top;
    }
    float max = kMasked;
    for (int64_t l = 0; l < kLanes; ++l) max = std::max(max, top[l]);
    Vec sum = {};
    for (int64_t t = 0; t < padded; t += kLanes) {
      const Vec e = ExpNonPositive(Load(row + t) + Load(penalty + t) - max);
      std::memcpy(row + t, &e, sizeof(Vec));
      sum += e;
    }
    float total = 0.0f;
    for (int64_t l = 0; l < kLanes; ++l) total += sum[l];
    for (int64_t t = 0; t < padded; ++t) row[t] /= total;
  }
  std::fill(out, out + g * h, 0.0f);
  for (int64_t t = 0; t < s; ++t) {  // out[j, :] = sum_t p[j, t] values[t, :]
    const float* __restrict__ value = values + t * h;
    for (int64_t j = 0; j < g; ++j) {
      const float p = scores[j * padded + t];
      float* __restrict__ o = out + j * h;
      for (int64_t i = 0; i < h; ++i) o[i] += p * value[i];
    }
  }
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,
                           ffi::Buffer<ffi::PRED> valid, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = keys.dimensions();
  const auto vd = values.dimensions();
  const auto md = valid.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || md.size() != 2) {
    return ffi::Error::InvalidArgument(
        "decode_attention: want q [B, K, G, H], keys [B, K, H, S], values [B, K, S, H], "
        "valid [B, S]");
  }
  const int64_t b = qd[0], kv = qd[1], g = qd[2], h = qd[3], s = kd[3];
  if (kd[0] != b || kd[1] != kv || kd[2] != h || vd[0] != b || vd[1] != kv || vd[2] != s ||
      vd[3] != h || md[0] != b || md[1] != s) {
    return ffi::Error::InvalidArgument("decode_attention: q, keys, values and valid disagree");
  }
  // The mask as an additive penalty per row, [B, padded] (zero where valid).
  const int64_t padded = bapo_kernels::CeilDiv(s, kLanes) * kLanes;
  thread_local std::vector<float> penalty;
  penalty.resize(b * padded);
  for (int64_t row = 0; row < b; ++row) {
    const bool* ok = valid.typed_data() + row * s;
    for (int64_t t = 0; t < padded; ++t) {
      penalty[row * padded + t] = t < s && ok[t] ? 0.0f : kMasked;
    }
  }
  // Helpers see the data through these: inside the lambda, `penalty` would name their own
  // thread_local.
  const float* penalty_data = penalty.data();
  const float* q_data = q.typed_data();
  const float* key_data = keys.typed_data();
  const float* value_data = values.typed_data();
  float* out_data = out->typed_data();
  bapo_kernels::ShareOut(pool, b * kv, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;  // [G, padded], this thread's
    scores.resize(g * padded);
    for (int64_t c = begin; c < end; ++c) {  // group c: row c / kv, KV head c % kv
      Group(q_data + c * g * h, key_data + c * h * s, value_data + c * s * h,
            penalty_data + (c / kv) * padded, g, h, s, padded, scores.data(),
            out_data + c * g * h);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BapoDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()   // values
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // valid
                                  .Ret<ffi::Buffer<ffi::F32>>());
