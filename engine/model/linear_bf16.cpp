// bf16 linears for CPUs with AVX-512 but without AVX512-BF16 or AMX, where oneDNN's bf16
// matmuls are emulated and run several times slower than float32 ones (engine/model/linear.py).
// y [M, N] = x [M, K] W^T + b, x, W and b bf16, products and sums in float32, y rounded to bf16
// once; a bf16 value widens to float32 exactly (a 16-bit shift), so the sums are float32
// matmul sums of the same numbers.
//
// Each output tile of MR rows x NR weight rows (MR * NR = 16) keeps 16 float32 accumulators
// over K, 32 columns per step: each weight row's 32 bf16 values widened by two instructions into
// its even- and odd-numbered columns, against x's rows widened once per call into that order,
// 2 * MR * NR FMAs; the 16 accumulators' sums land in one vector (`sum16`). One row of x: 1 x 16
// (the weights' bytes are the bound); two or three: 2 x 8; four and more: 4 x 4, weight rows
// read from L1 by each group of four rows. Threads take contiguous ranges of 16 weight rows.
// The same tiles take int8 weights (int8 weight-only linears with bf16 activations, where
// `_weight_int8pack_mm` is slower on such CPUs): 32 codes sign-extended and converted in two
// vectors (x's rows then in order), each row's sum times its scale. With AVX512-VNNI (on every
// CPU that has it, emulated bf16 or not) int8 weights take `tile_vnni` instead: x's rows
// quantized to int16 once per call, 32 codes sign-extended to int16 by one instruction and
// multiplied and summed in pairs by one VPDPWSSD per row of x, exactly, in int32.
//
// Registered as torch.ops.longctx.linear_bf16(x [M, K], w [N, K], b [N] or None) -> [M, N],
// linear_int8(x [M, K] bf16, w [N, K] int8, scales [N], widen=False) -> [M, N] bf16 (K a multiple
// of 16, x's rows and w contiguous; `widen` takes the float32 tiles even with VNNI), their
// float32-output forms linear_bf16_f32(x, w, widen=False) and linear_int8_f32(x, w, scales,
// widen=False) (the LM head: logits in float32 on every CPU with AVX-512),
// linear_bf16_supported() -> bool and linear_int8_vnni() -> bool (the build has `tile_vnni`).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "../attention/cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)

// 32 bf16 values widened to float32 in two vectors, one instruction each: the even-numbered
// values (a 32-bit word's low half shifted up) and the odd-numbered (its high half kept).
inline void widen_pairs(const c10::BFloat16* p, __m512* even, __m512* odd) {
  const __m512i v = _mm512_loadu_si512(p);
  *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// x's rows in float32: with `pairs`, each 32 columns as their even-numbered then odd-numbered
// values (the order `widen_pairs` gives bf16 weights), else in order; a last 16 columns
// (K % 32 == 16) in order.
inline void widen_rows(const c10::BFloat16* x, int64_t stride, int64_t M, int64_t K, bool pairs, float* xf) {
  for (int64_t m = 0; m < M; ++m) {
    const c10::BFloat16* src = x + m * stride;
    float* dst = xf + m * K;
    int64_t k = 0;
    for (; pairs && k + 32 <= K; k += 32) {
      __m512 e, o;
      widen_pairs(src + k, &e, &o);
      _mm512_storeu_ps(dst + k, e);
      _mm512_storeu_ps(dst + k + 16, o);
    }
    for (; k < K; k += 16) _mm512_storeu_ps(dst + k, longctx::widen_bf16(src + k));
  }
}

// A weight row's values as float32: 32 at a time in two vectors, in the order x's rows are
// widened to (`kPairs`), and 16 in order (K's last 16 when K % 32 == 16).
template <typename W>
struct Weights;
template <>
struct Weights<c10::BFloat16> {
  static constexpr bool kPairs = true;
  static void load32(const c10::BFloat16* p, __m512* a, __m512* b) { widen_pairs(p, a, b); }
  static __m512 load16(const c10::BFloat16* p) { return longctx::widen_bf16(p); }
};
template <>
struct Weights<int8_t> {  // int8 codes, sign-extended and converted
  static constexpr bool kPairs = false;
  static void load32(const int8_t* p, __m512* a, __m512* b) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    *a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
    *b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
  }
  static __m512 load16(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};

// y[m][n] = x[m] . w[n] (times sc[n] for int8 codes, plus b[n]), rounded to bf16 once, or
// kept in float32 (`yf`: the LM head's logits, whose bf16 rounding would tie near-equal tokens).
struct Out {
  const float* sc;          // per weight row, or nullptr
  const c10::BFloat16* b;   // per weight row, or nullptr
  c10::BFloat16* y;         // [M, N], or nullptr when yf is set
  int64_t N;
  float* yf = nullptr;      // [M, N] float32 output instead of y
  void store(int64_t m, int64_t n, float dot) const {
    const float v = (sc != nullptr ? dot * sc[n] : dot) + (b != nullptr ? static_cast<float>(b[n]) : 0.f);
    if (yf != nullptr)
      yf[m * N + n] = v;
    else
      y[m * N + n] = c10::BFloat16(v);
  }
};

// Output rows m0..m0+MR-1, weight rows n0..n0+NR-1. kAhead: also prefetch the same columns of
// the weight rows 16 further on into L2 (the weights stream from memory once per step: ~1.5-2x
// faster for the LM head's 56 MB at 1-16 rows; into L1 they would evict x's rows).
template <typename W, int MR, int NR, bool kAhead = false>
inline void tile(const float* xf, const W* w, int64_t K, int64_t m0, int64_t n0, const Out& out) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const float* xr = xf + m0 * K;
  const W* wr = w + n0 * K;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512 we[NR], wo[NR];
    for (int j = 0; j < NR; ++j) Weights<W>::load32(wr + j * K + k, &we[j], &wo[j]);
    if constexpr (kAhead)
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(wr + (16 + j) * K + k), _MM_HINT_T1);
    for (int i = 0; i < MR; ++i) {
      const __m512 xe = _mm512_loadu_ps(xr + i * K + k), xo = _mm512_loadu_ps(xr + i * K + k + 16);
      for (int j = 0; j < NR; ++j) {
        acc[i * NR + j] = _mm512_fmadd_ps(xe, we[j], acc[i * NR + j]);
        acc[i * NR + j] = _mm512_fmadd_ps(xo, wo[j], acc[i * NR + j]);
      }
    }
  }
  if (k < K) {
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_loadu_ps(xr + i * K + k);
      for (int j = 0; j < NR; ++j)
        acc[i * NR + j] = _mm512_fmadd_ps(xv, Weights<W>::load16(wr + j * K + k), acc[i * NR + j]);
    }
  }
  alignas(64) float s[16];
  _mm512_store_ps(s, longctx::sum16(acc));
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out.store(m0 + i, n0 + j, s[i * NR + j]);
}

// An output tile's shape: MR rows of x by NR weight rows (MR * NR = 16 accumulators).
template <int R, int C>
struct Shape {
  static constexpr int MR = R, NR = C;
};

// Weight rows n0..n0+15 against every row of x, as tiles of 4 x 4, then 2 x 8, then 1 x 16:
// `tile(Shape<MR, NR>{}, ahead, m0, n0)` for each, `ahead` for the first rows' tiles (those
// prefetch the next 16 weight rows, the next block's). Every kind of tile below is laid out so.
template <typename Tile>
inline void tiles16(int64_t M, int64_t n0, const Tile& tile) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4)
    for (int64_t j = 0; j < 16; j += 4) tile(Shape<4, 4>{}, m == 0, m, n0 + j);
  for (; m + 2 <= M; m += 2)
    for (int64_t j = 0; j < 16; j += 8) tile(Shape<2, 8>{}, m == 0, m, n0 + j);
  for (; m < M; ++m) tile(Shape<1, 16>{}, m == 0, m, n0);
}

template <typename W>
inline void block16(const float* xf, const W* w, int64_t M, int64_t K, int64_t n0, const Out& out) {
  tiles16(M, n0, [&](auto shape, bool ahead, int64_t m, int64_t n) {
    using S = decltype(shape);
    ahead ? tile<W, S::MR, S::NR, true>(xf, w, K, m, n, out) : tile<W, S::MR, S::NR>(xf, w, K, m, n, out);
  });
}

// The last N % 16 weight rows, one dot product at a time.
template <typename W>
inline void tail(const float* xf, const W* w, int64_t M, int64_t K, int64_t n0, const Out& out) {
  for (int64_t n = n0; n < out.N; ++n)
    for (int64_t m = 0; m < M; ++m) {
      __m512 acc = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 32 <= K; k += 32) {
        __m512 e, o;
        Weights<W>::load32(w + n * K + k, &e, &o);
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(xf + m * K + k), e, acc);
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(xf + m * K + k + 16), o, acc);
      }
      if (k < K) acc = _mm512_fmadd_ps(_mm512_loadu_ps(xf + m * K + k), Weights<W>::load16(w + n * K + k), acc);
      out.store(m, n, _mm512_reduce_add_ps(acc));
    }
}

#if defined(__AVX512BF16__)
// With AVX512-BF16, bf16 weights against bf16 x by VDPBF16PS: one instruction per 32 products
// of a tile's pair of rows (float32 products, float32 sums), x read as it is, not widened. Same
// tiles and prefetch as `tile`. The last 16 columns (K % 32 == 16) load masked, zero above.
template <int MR, int NR, bool kAhead = false>
inline void tile_dp(const c10::BFloat16* x, int64_t xs, const c10::BFloat16* w, int64_t K, int64_t m0, int64_t n0,
                    const Out& out) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const c10::BFloat16* xr = x + m0 * xs;
  const c10::BFloat16* wr = w + n0 * K;
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = k + 32 <= K ? ~__mmask32(0) : __mmask32(0xFFFF);
    __m512i wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_maskz_loadu_epi16(mask, wr + j * K + k);
    if constexpr (kAhead)
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(wr + (16 + j) * K + k), _MM_HINT_T1);
    for (int i = 0; i < MR; ++i) {
      const __m512i xv = _mm512_maskz_loadu_epi16(mask, xr + i * xs + k);
      for (int j = 0; j < NR; ++j) acc[i * NR + j] = longctx::dpbf16_ps(acc[i * NR + j], xv, wv[j]);
    }
  }
  alignas(64) float s[16];
  _mm512_store_ps(s, longctx::sum16(acc));
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out.store(m0 + i, n0 + j, s[i * NR + j]);
}

inline void block16_dp(const c10::BFloat16* x, int64_t xs, const c10::BFloat16* w, int64_t M, int64_t K, int64_t n0,
                       const Out& out) {
  tiles16(M, n0, [&](auto shape, bool ahead, int64_t m, int64_t n) {
    using S = decltype(shape);
    ahead ? tile_dp<S::MR, S::NR, true>(x, xs, w, K, m, n, out) : tile_dp<S::MR, S::NR>(x, xs, w, K, m, n, out);
  });
}

// Every row of x against weight rows n0..N-1 (the last N % 16) with 1 x 1 tiles' dot products.
inline void tail_dp(const c10::BFloat16* x, int64_t xs, const c10::BFloat16* w, int64_t M, int64_t K, int64_t n0,
                    const Out& out) {
  for (int64_t n = n0; n < out.N; ++n)
    for (int64_t m = 0; m < M; ++m) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask = k + 32 <= K ? ~__mmask32(0) : __mmask32(0xFFFF);
        acc = longctx::dpbf16_ps(acc, _mm512_maskz_loadu_epi16(mask, x + m * xs + k),
                                 _mm512_maskz_loadu_epi16(mask, w + n * K + k));
      }
      out.store(m, n, _mm512_reduce_add_ps(acc));
    }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// With AVX512-VNNI, int8 weights against x's rows quantized to int16 by VPDPWSSD: 32 codes
// sign-extended to int16 by one instruction (instead of two extensions and two conversions to
// float32), then one instruction per 32 products of a tile's pair of rows, summed exactly in
// int32. x's rows become int16 codes with one scale per row (`quantize_rows`): x ~= xq * xs,
// |xq| <= 32767, an error of at most 2^-16 of the row's largest |x| per value, below bf16's own
// rounding of every value within 2^7 of that largest (and far below the weights' int8 step). A
// lane sums at most 256 products of |xq w| <= 2^22 between conversions to float32 (every
// `kFlush` columns), so int32 never overflows.
constexpr int64_t kFlush = 4096;

inline void quantize_rows(const c10::BFloat16* x, int64_t stride, int64_t M, int64_t K, int16_t* xq, float* xs) {
  for (int64_t m = 0; m < M; ++m) {
    const c10::BFloat16* src = x + m * stride;
    __m512 mx = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = longctx::widen_bf16(src + k);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
    }
    const float absmax = _mm512_reduce_max_ps(mx);
    // A row holding NaN or infinity gives NaN products, as a float32 product would give NaN or
    // infinities: never finite codes that hide it.
    xs[m] = nan == 0 && std::isfinite(absmax) ? absmax / 32767.f : std::numeric_limits<float>::quiet_NaN();
    const __m512 inv = _mm512_set1_ps(absmax > 0.f ? 32767.f / absmax : 0.f);
    for (int64_t k = 0; k < K; k += 16) {  // rounded to nearest, saturated (x * inv may pass 32767 by an ulp)
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(longctx::widen_bf16(src + k), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + k), _mm512_cvtsepi32_epi16(q));
    }
  }
}

// 32 int8 codes (16 where `mask` says) sign-extended to int16.
inline __m512i codes16(const int8_t* p, __mmask32 mask) {
  return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, p));
}

template <int MR, int NR, bool kAhead = false>
inline void tile_vnni(const int16_t* xq, const float* xs, const int8_t* w, int64_t K, int64_t m0, int64_t n0,
                      const Out& out) {
  __m512i acc[16];
  __m512 sums[16];
  for (int i = 0; i < 16; ++i) sums[i] = _mm512_setzero_ps();
  const int16_t* xr = xq + m0 * K;
  const int8_t* wr = w + n0 * K;
  for (int64_t k0 = 0; k0 < K; k0 += kFlush) {
    const int64_t k1 = std::min(K, k0 + kFlush);
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k1; k += 32) {
      const __mmask32 mask = k + 32 <= k1 ? ~__mmask32(0) : __mmask32(0xFFFF);
      __m512i wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = codes16(wr + j * K + k, mask);
      if constexpr (kAhead)
        for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(wr + (16 + j) * K + k), _MM_HINT_T1);
      for (int i = 0; i < MR; ++i) {
        const __m512i xv = _mm512_maskz_loadu_epi16(mask, xr + i * K + k);
        for (int j = 0; j < NR; ++j) acc[i * NR + j] = _mm512_dpwssd_epi32(acc[i * NR + j], xv, wv[j]);
      }
    }
    for (int i = 0; i < 16; ++i) sums[i] = _mm512_add_ps(sums[i], _mm512_cvtepi32_ps(acc[i]));
  }
  alignas(64) float s[16];
  _mm512_store_ps(s, longctx::sum16(sums));
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out.store(m0 + i, n0 + j, s[i * NR + j] * xs[m0 + i]);
}

inline void block16_vnni(const int16_t* xq, const float* xs, const int8_t* w, int64_t M, int64_t K, int64_t n0,
                         const Out& out) {
  tiles16(M, n0, [&](auto shape, bool ahead, int64_t m, int64_t n) {
    using S = decltype(shape);
    ahead ? tile_vnni<S::MR, S::NR, true>(xq, xs, w, K, m, n, out) : tile_vnni<S::MR, S::NR>(xq, xs, w, K, m, n, out);
  });
}

// The last N % 16 weight rows, one row of x at a time.
inline void tail_vnni(const int16_t* xq, const float* xs, const int8_t* w, int64_t M, int64_t K, int64_t n0,
                      const Out& out) {
  for (int64_t n = n0; n < out.N; ++n)
    for (int64_t m = 0; m < M; ++m) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k0 = 0; k0 < K; k0 += kFlush) {
        const int64_t k1 = std::min(K, k0 + kFlush);
        __m512i acc = _mm512_setzero_si512();
        for (int64_t k = k0; k < k1; k += 32) {
          const __mmask32 mask = k + 32 <= k1 ? ~__mmask32(0) : __mmask32(0xFFFF);
          acc = _mm512_dpwssd_epi32(acc, _mm512_maskz_loadu_epi16(mask, xq + m * K + k), codes16(w + n * K + k, mask));
        }
        sum = _mm512_add_ps(sum, _mm512_cvtepi32_ps(acc));
      }
      out.store(m, n, _mm512_reduce_add_ps(sum) * xs[m]);
    }
}

constexpr bool kInt8Vnni = true;
#else
constexpr bool kInt8Vnni = false;
#endif

// widen: bf16 weights widened to float32 even where VDPBF16PS is there (the path of CPUs that
// emulate bf16, forced for tests on CPUs that do not).
template <typename W>
void run(const at::Tensor& x, const W* w, int64_t N, const Out& out, bool widen = false) {
  const int64_t M = x.size(0), K = x.size(1);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<W, c10::BFloat16>) {
    if (!widen) {
      const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
      const int64_t xs = x.stride(0), blocks = N / 16;
      longctx::maybe_parallel(blocks, blocks * 16 * K * std::max<int64_t>(M, 4), [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) block16_dp(xp, xs, w, M, K, 16 * i, out);
      });
      tail_dp(xp, xs, w, M, K, 16 * blocks, out);
      return;
    }
  }
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<W, int8_t>) {
    if (!widen) {
      std::vector<int16_t> xq(M * K);
      std::vector<float> xs(M);
      quantize_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), M, K, xq.data(), xs.data());
      const int64_t blocks = N / 16;
      longctx::maybe_parallel(blocks, blocks * 16 * K * std::max<int64_t>(M, 4), [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) block16_vnni(xq.data(), xs.data(), w, M, K, 16 * i, out);
      });
      tail_vnni(xq.data(), xs.data(), w, M, K, 16 * blocks, out);
      return;
    }
  }
#endif
  std::vector<float> xf(M * K);
  widen_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), M, K, Weights<W>::kPairs, xf.data());
  const int64_t blocks = N / 16;
  longctx::maybe_parallel(blocks, blocks * 16 * K * std::max<int64_t>(M, 4), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) block16<W>(xf.data(), w, M, K, 16 * i, out);
  });
  tail<W>(xf.data(), w, M, K, 16 * blocks, out);
}

bool supported() { return true; }
bool int8_vnni() { return kInt8Vnni; }

#else

bool supported() { return false; }
bool int8_vnni() { return false; }

#endif

bool linear_bf16_supported() { return supported(); }
bool linear_int8_vnni() { return int8_vnni(); }

void check_x(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(supported(), "linear kernels: this build has no AVX-512 path");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be bf16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x: [M, K] with contiguous rows");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1), "w: [N, K] contiguous, K as x's");
  TORCH_CHECK(x.size(1) % 16 == 0, "K must be a multiple of 16");
}

// The output: bf16 as x, or float32 (`float_out`).
at::Tensor output(const at::Tensor& x, int64_t N, bool float_out) {
  return at::empty({x.size(0), N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
}

#if defined(__AVX512F__)
Out out_for(at::Tensor& y, const float* sc, const c10::BFloat16* b, int64_t N) {
  if (y.scalar_type() == at::kFloat) return Out{sc, b, nullptr, N, y.data_ptr<float>()};
  return Out{sc, b, y.data_ptr<c10::BFloat16>(), N};
}
#endif

at::Tensor bf16_product(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, bool float_out,
                        bool widen) {
  check_x(x, w);
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "w must be bf16");
  const int64_t M = x.size(0), N = w.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.numel() == N, "b: [N] bf16");
  }
  at::Tensor y = output(x, N, float_out);
#if defined(__AVX512F__)
  if (M > 0 && N > 0)
    run<c10::BFloat16>(x, w.data_ptr<c10::BFloat16>(), N,
                       out_for(y, nullptr, b.defined() ? b.data_ptr<c10::BFloat16>() : nullptr, N), widen);
#endif
  return y;
}

at::Tensor int8_product(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, bool float_out,
                        bool widen) {
  check_x(x, w);
  TORCH_CHECK(w.scalar_type() == at::kChar, "w must be int8");
  const int64_t M = x.size(0), N = w.size(0);
  TORCH_CHECK(scales.dim() == 1 && scales.numel() == N, "scales: [N]");
  const at::Tensor sc = scales.to(at::kFloat).contiguous();
  at::Tensor y = output(x, N, float_out);
#if defined(__AVX512F__)
  if (M > 0 && N > 0) run<int8_t>(x, w.data_ptr<int8_t>(), N, out_for(y, sc.data_ptr<float>(), nullptr, N), widen);
#endif
  return y;
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return bf16_product(x, w, bias, false, true);
}

at::Tensor linear_bf16_f32(const at::Tensor& x, const at::Tensor& w, bool widen) {
  return bf16_product(x, w, std::nullopt, true, widen);
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, bool widen) {
  return int8_product(x, w, scales, false, widen);
}

at::Tensor linear_int8_f32(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, bool widen) {
  return int8_product(x, w, scales, true, widen);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longctx, m) {
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? b) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor w, Tensor scales, bool widen=False) -> Tensor");
  m.def("linear_bf16_f32(Tensor x, Tensor w, bool widen=False) -> Tensor");
  m.def("linear_int8_f32(Tensor x, Tensor w, Tensor scales, bool widen=False) -> Tensor");
  m.def("linear_bf16_supported() -> bool", &linear_bf16_supported);
  m.def("linear_int8_vnni() -> bool", &linear_int8_vnni);
}

TORCH_LIBRARY_IMPL(longctx, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_int8", &linear_int8);
  m.impl("linear_bf16_f32", &linear_bf16_f32);
  m.impl("linear_int8_f32", &linear_int8_f32);
}
