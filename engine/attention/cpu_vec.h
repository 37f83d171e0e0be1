// Helpers shared by the CPU attention kernels (paged_decode.cpp, paged_prefill.cpp).
#pragma once

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>

namespace longctx {

// Below this many elements of work a loop runs on the calling thread: waking the pool's
// threads costs more than a short context's attention (a few microseconds per region).
constexpr int64_t kParallelFrom = 1 << 16;

// at::parallel_for over [0, n) when `work` is worth the threads, else inline.
template <typename F>
void maybe_parallel(int64_t n, int64_t work, const F& f) {
  if (n <= 1 || work < kParallelFrom) {
    f(0, n);
  } else {
    at::parallel_for(0, n, 1, f);
  }
}

#if defined(__AVX512F__)
// exp(x) for x <= 0 on 16 floats (clamped at 2^-126): 2^(x log2 e) as an integer power of two,
// applied by VSCALEFPS, times a degree-6 polynomial for the fraction (paged_decode.cpp's
// scalar exp_nonpositive is the same).
inline __m512 exp_nonpositive_ps(__m512 x) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)), _mm512_set1_ps(-126.f));
  const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(2.1690609e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.2443082e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6784728e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5483524e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022980e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314700e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, fi);
}

#endif

}  // namespace longctx
