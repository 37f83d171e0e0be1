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

// The sums of 16 vectors' elements, in one vector (element j = the sum of d[j]): a tree of
// unpacks and lane shuffles, ~3 instructions per vector instead of a horizontal add each.
inline __m512 sum16(const __m512* d) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]), _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of four vectors, in order
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // lanes across vectors: [u0 0+1, u0 2+3, u1 0+1, u1 2+3], then whole sums
  const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xDD));
}

// 16 bf16 values (raw 16-bit words) widened to float32: exact, a 16-bit shift.
inline __m512 widen_bf16(const void* p) {
  const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// acc + the sums of a's and b's bf16 pairs (word i: a[2i] b[2i] + a[2i+1] b[2i+1]): VDPBF16PS
// with AVX512-BF16, else each pair widened to float32 (a shift and a mask) and two FMAs.
inline __m512 dpbf16_ps(__m512 acc, __m512i a, __m512i b) {
#if defined(__AVX512BF16__)
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)),
                        acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, high)),
                         _mm512_castsi512_ps(_mm512_and_si512(b, high)), acc);
#endif
}

// 32 floats as bf16 rounded to nearest even, lo's in words 0-15 and hi's in 16-31
// (VCVTNE2PS2BF16 with AVX512-BF16; else the rounding in integers, NaN kept quiet).
inline __m512i cvtne2ps_bf16(__m512 hi, __m512 lo) {
#if defined(__AVX512BF16__)
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
#else
  const auto round = [](__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                              _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
  };
  return _mm512_inserti64x4(_mm512_castsi256_si512(round(lo)), round(hi), 1);
#endif
}

// bf16 products by VDPBF16PS over key pairs interleave two V rows within 128-bit lanes
// (unpacklo/unpackhi_epi16), so of a 32-dim slice the "lo" vector holds dims 0-3, 8-11, 16-19,
// 24-27 and "hi" the others. Float32 outputs in that order from and to dim order:
// split(d0..15, d16..31) -> (lo, hi); join(lo, hi) -> (d0..15, d16..31).
inline void split_interleaved(__m512 a, __m512 b, __m512* lo, __m512* hi) {
  *lo = _mm512_permutex2var_ps(a, _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27), b);
  *hi = _mm512_permutex2var_ps(a, _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31), b);
}
inline void join_interleaved(__m512 lo, __m512 hi, __m512* a, __m512* b) {
  *a = _mm512_permutex2var_ps(lo, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23), hi);
  *b = _mm512_permutex2var_ps(lo, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31), hi);
}

#endif

}  // namespace longctx
