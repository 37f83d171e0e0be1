// bf16 linears for CPUs with AVX-512 but without AVX512-BF16 or AMX, where oneDNN's bf16
// matmuls are emulated and run several times slower than float32 ones (engine/model/linear.py).
// y [M, N] = x [M, K] W^T + b, x, W and b bf16, products and sums in float32, y rounded to bf16
// once; a bf16 value widens to float32 exactly (a 16-bit shift), so the sums are float32
// matmul sums of the same numbers.
//
// Each output tile of MR rows x NR weight rows (MR * NR = 16) keeps 16 float32 accumulators
// over K, 16 columns per step: NR weight vectors widened (VPMOVZXWD + VPSLLD) and MR rows of x
// (widened once per call into a float32 buffer), MR * NR FMAs; the 16 accumulators' sums land
// in one vector (`sum16`). One row of x: 1 x 16 (the weights' bytes are the bound); two or
// three: 2 x 8; four and more: 4 x 4, weight rows read from L1 by each group of four rows.
// Threads take contiguous ranges of 16 weight rows.
//
// Registered as torch.ops.longctx.linear_bf16(x [M, K], w [N, K], b [N] or None) -> [M, N]
// (K a multiple of 16, x's rows and w contiguous) and linear_bf16_supported() -> bool.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "../attention/cpu_vec.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

#if defined(__AVX512F__)

// The sums of 16 vectors' elements in one vector (element j = the sum of d[j]).
inline __m512 sum16(const __m512* d) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]), _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xDD));
}

// 16 bf16 values widened to float32.
inline __m512 widen(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Output rows m0..m0+MR-1, weight rows n0..n0+NR-1: y[m][n] = x[m] . w[n] (+ b[n]).
template <int MR, int NR>
inline void tile(const float* xf, const c10::BFloat16* w, const c10::BFloat16* b, int64_t K, int64_t N, int64_t m0,
                 int64_t n0, c10::BFloat16* y) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const float* xr = xf + m0 * K;
  const c10::BFloat16* wr = w + n0 * K;
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[NR], xv[MR];
    for (int j = 0; j < NR; ++j) wv[j] = widen(wr + j * K + k);
    for (int i = 0; i < MR; ++i) xv[i] = _mm512_loadu_ps(xr + i * K + k);
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i * NR + j] = _mm512_fmadd_ps(xv[i], wv[j], acc[i * NR + j]);
  }
  alignas(64) float s[16];
  _mm512_store_ps(s, sum16(acc));
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const float bias = b != nullptr ? static_cast<float>(b[n0 + j]) : 0.f;
      y[(m0 + i) * N + n0 + j] = c10::BFloat16(s[i * NR + j] + bias);
    }
}

// Weight rows n0..n0+15 against every row of x.
inline void block16(const float* xf, const c10::BFloat16* w, const c10::BFloat16* b, int64_t M, int64_t K, int64_t N,
                    int64_t n0, c10::BFloat16* y) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4)
    for (int64_t j = 0; j < 16; j += 4) tile<4, 4>(xf, w, b, K, N, m, n0 + j, y);
  for (; m + 2 <= M; m += 2)
    for (int64_t j = 0; j < 16; j += 8) tile<2, 8>(xf, w, b, K, N, m, n0 + j, y);
  for (; m < M; ++m) tile<1, 16>(xf, w, b, K, N, m, n0, y);
}

// The last N % 16 weight rows, one dot product at a time.
inline void tail(const float* xf, const c10::BFloat16* w, const c10::BFloat16* b, int64_t M, int64_t K, int64_t N,
                 int64_t n0, c10::BFloat16* y) {
  for (int64_t n = n0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(xf + m * K + k), widen(w + n * K + k), acc);
      const float bias = b != nullptr ? static_cast<float>(b[n]) : 0.f;
      y[m * N + n] = c10::BFloat16(_mm512_reduce_add_ps(acc) + bias);
    }
}

bool supported() { return true; }

#else

bool supported() { return false; }

#endif

bool linear_bf16_supported() { return supported(); }

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(), "linear_bf16: this build has no AVX-512 path");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "x and w must be bf16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x: [M, K] with contiguous rows");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1), "w: [N, K] contiguous, K as x's");
  TORCH_CHECK(x.size(1) % 16 == 0, "K must be a multiple of 16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const c10::BFloat16* bp = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.numel() == N, "b: [N] bf16");
    bp = b.data_ptr<c10::BFloat16>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX512F__)
  if (M == 0 || N == 0) return y;
  std::vector<float> xf(M * K);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 16) _mm512_storeu_ps(&xf[m * K + k], widen(xp + m * x.stride(0) + k));
  const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t blocks = N / 16;
  longctx::maybe_parallel(blocks, blocks * 16 * K * std::max<int64_t>(M, 4), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) block16(xf.data(), wp, bp, M, K, N, 16 * i, yp);
  });
  tail(xf.data(), wp, bp, M, K, N, 16 * blocks, yp);
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longctx, m) {
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? b) -> Tensor");
  m.def("linear_bf16_supported() -> bool", &linear_bf16_supported);
}

TORCH_LIBRARY_IMPL(longctx, CPU, m) { m.impl("linear_bf16", &linear_bf16); }
