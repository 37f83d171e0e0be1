// Decode attention over a paged KV cache on CPU, reading K and V where they are in the cache.
//
// One query token per sequence; the sequence's keys are the tokens [start, start + length) of
// its page-table row (logical pages, `page_size` tokens each). The G query heads that share a
// KV head are computed together, so each K and V row is read once. Work is split into
// (sequence, chunk of keys) tasks run by ATen's thread pool, each reading its keys' whole
// cache rows (every KV head) in order; a task keeps per head a running max, sum and weighted
// sum of V (online softmax) and the chunks are merged by log-sum-exp at the end.
//
// Registered as torch.ops.longctx.paged_decode (and store_kv, the step's K/V rows written in):
//   q [B, H, D] (float32 or bfloat16; rows may be strided), cache [P, 2, S, KVH, D] (q's dtype), pages [B, N] int32,
//   starts [B] int64, lengths [B] int64 (each >= 1), scale, chunk (keys per task)
//   -> [B, H, D] in q's dtype.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_vec.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using longctx::maybe_parallel;
#if defined(__AVX512F__)
using longctx::exp_nonpositive_ps;
#endif

constexpr int64_t kBlock = 32;  // keys scored before their softmax update

// The next block's rows, requested from memory while this block is computed: spread over the
// compute, the requests overlap it; issued in a burst per block (or left to the hardware
// prefetcher, which page boundaries in a shuffled table defeat) they did not. With bf16's
// VDPBF16PS path each of a key's lines (this head's K, then its V) has a slot of its own: one
// per query's score pass and one in the V pass (`fetch_lines`), non-temporal. On a Zen 5 core
// that reads 8k keys a layer (30 layers' caches in turn) in ~160 us against ~225 us with all
// of a key's lines requested in the first score pass, which in turn beat a burst per block
// (~420 -> ~290 us on Zen 4); one block ahead measured best of 1-4 blocks.
template <typename T>
struct Ahead {
  const T* const* rows = nullptr;
  int64_t n = 0;     // rows in the next block (0: none)
  int64_t half = 0;  // elements from a row's K to its V
  // always_inline: as a call, GCC deems it free of side effects (prefetches have none in its
  // model) and deletes it unused.
  __attribute__((always_inline)) inline void fetch(int64_t j, int64_t off, int64_t D) const {
    if (j >= n) return;
    const char* k = reinterpret_cast<const char*>(rows[j] + off);
    const char* v = reinterpret_cast<const char*>(rows[j] + off + half);
    for (int64_t byte = 0; byte < D * static_cast<int64_t>(sizeof(T)); byte += 64) {
      __builtin_prefetch(k + byte, 0, 1);
      __builtin_prefetch(v + byte, 0, 1);
    }
  }
  // Key j's lines [first, last) of this head's K row (at `off`) followed by its V row.
  // Non-temporal: the block reads them once, soon.
  template <int64_t kD>
  __attribute__((always_inline)) inline void fetch_lines(int64_t j, int64_t off, int64_t first, int64_t last) const {
    constexpr int64_t kLines = lines<kD>();
    if (j >= n) return;
    for (int64_t line = first; line < last; ++line) {
      const T* row = rows[j] + off + (line < kLines ? 0 : half);
      __builtin_prefetch(reinterpret_cast<const char*>(row) + 64 * (line % kLines), 0, 0);
    }
  }
  // Lines of a K (or V) row of kD elements.
  template <int64_t kD>
  static constexpr int64_t lines() { return (kD * static_cast<int64_t>(sizeof(T)) + 63) / 64; }
  // The first line of slot `slot` of `slots` (slot `slots` ends after the last line).
  template <int64_t kD>
  static constexpr int64_t slot_start(int64_t slot, int64_t slots) { return (slot * 2 * lines<kD>() + slots - 1) / slots; }
};
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// exp(x) for x <= 0 within ~2e-7 relative (clamped at 2^-126), in plain arithmetic the compiler vectorizes
// (a libm call per score would not be): 2^(x log2 e) split into an integer power of two,
// set in the exponent bits, and a degree-6 polynomial for the fraction.
inline float exp_nonpositive(float x) {
  const float t = std::max(x * 1.44269504089f, -126.f);
  const float fi = std::floor(t);
  const float f = t - fi;
  float p = 2.1690609e-4f;  // least squares in relative error: max 9e-8 on [0, 1)
  p = p * f + 1.2443082e-3f;
  p = p * f + 9.6784728e-3f;
  p = p * f + 5.5483524e-2f;
  p = p * f + 2.4022980e-1f;
  p = p * f + 6.9314700e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]);
}

// One KV head's part of a block of n keys: `rows[j] + off` is key j's K (and `+ half` its V)
// for this head; qf holds the head's G queries [G, D] (scaled), acc their outputs [G, D].
// scores[g * kBlock + j] = q_g . k_j.
template <typename T, int64_t kD>
inline void score_block(const T* const* rows, int64_t off, int64_t n, const float* qf, int64_t G, int64_t D, float* kf,
                        float* scores, const Ahead<T>& ahead) {
  for (int64_t j = 0; j < n; ++j) {
    ahead.fetch(j, off, D);
    load_row(rows[j] + off, kf, D);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * kf[d];
      scores[g * kBlock + j] = dot;
    }
  }
}

// acc[g] += sum_j p[g][j] v_j, p = scores after the softmax update.
template <typename T, int64_t kD>
inline void accumulate_block(const T* const* rows, int64_t off, int64_t n, const float* scores, int64_t G, int64_t D,
                             float* kf, float* acc) {
  for (int64_t j = 0; j < n; ++j) {
    load_row(rows[j] + off, kf, D);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * kBlock + j];
      float* ag = acc + g * D;
      for (int64_t d = 0; d < D; ++d) ag[d] += p * kf[d];
    }
  }
}

#if defined(__AVX512F__)
// The same two steps in 16-float vectors for head dims that are multiples of 16: a key's row
// is converted once and kept in registers for its G dot products.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) { return longctx::widen_bf16(p); }

// One query's block of n <= kBlock = 32 scores, in place: the new running max (from `m`) is
// returned, the scores become exp(score - max), and their sum goes to *sum.
inline float softmax_block_avx512(float* s, int64_t n, float m, float* sum) {
  static_assert(kBlock == 32, "two vectors per block");
  const __mmask16 m0 = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  const __mmask16 m1 = n >= 32 ? 0xFFFF : n > 16 ? static_cast<__mmask16>((1u << (n - 16)) - 1) : 0;
  const __m512 s0 = _mm512_maskz_loadu_ps(m0, s), s1 = _mm512_maskz_loadu_ps(m1, s + 16);
  const float bm = std::max({m, _mm512_mask_reduce_max_ps(m0, s0), _mm512_mask_reduce_max_ps(m1, s1)});
  const __m512 b = _mm512_set1_ps(bm);
  const __m512 p0 = _mm512_maskz_mov_ps(m0, exp_nonpositive_ps(_mm512_sub_ps(s0, b)));
  const __m512 p1 = _mm512_maskz_mov_ps(m1, exp_nonpositive_ps(_mm512_sub_ps(s1, b)));
  _mm512_storeu_ps(s, p0);
  _mm512_storeu_ps(s + 16, p1);
  *sum = _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
  return bm;
}

template <typename T, int64_t kD>
inline void score_block_avx512(const T* const* rows, int64_t off, int64_t n, const float* qf, int64_t G,
                               float* scores, const Ahead<T>& ahead) {
  constexpr int64_t V = kD / 16;
  for (int64_t j = 0; j < n; ++j) {
    ahead.fetch(j, off, kD);
    const T* kr = rows[j] + off;
    __m512 k[V];
    for (int64_t v = 0; v < V; ++v) k[v] = load16(kr + 16 * v);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * kD;
      __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
      for (int64_t v = 1; v < V; ++v) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * v), k[v], dot);
      scores[g * kBlock + j] = _mm512_reduce_add_ps(dot);
    }
  }
}

// acc[g] += sum_j p[g][j] v_j with GN queries' outputs held in registers over the block (a
// store and reload per key would chain every key's update to the previous one's).
template <typename T, int64_t kD, int64_t GN>
inline void accumulate_queries_avx512(const T* const* rows, int64_t off, int64_t n, const float* scores, float* acc) {
  constexpr int64_t V = kD / 16;
  __m512 a[GN][V];
  for (int64_t g = 0; g < GN; ++g)
    for (int64_t v = 0; v < V; ++v) a[g][v] = _mm512_loadu_ps(acc + g * kD + 16 * v);
  for (int64_t j = 0; j < n; ++j) {
    const T* vr = rows[j] + off;
    __m512 val[V];
    for (int64_t v = 0; v < V; ++v) val[v] = load16(vr + 16 * v);
    for (int64_t g = 0; g < GN; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * kBlock + j]);
      for (int64_t v = 0; v < V; ++v) a[g][v] = _mm512_fmadd_ps(p, val[v], a[g][v]);
    }
  }
  for (int64_t g = 0; g < GN; ++g)
    for (int64_t v = 0; v < V; ++v) _mm512_storeu_ps(acc + g * kD + 16 * v, a[g][v]);
}

template <typename T, int64_t kD>
inline void accumulate_block_avx512(const T* const* rows, int64_t off, int64_t n, const float* scores, int64_t G,
                                    float* acc) {
  constexpr int64_t GB = kD <= 64 ? 4 : 2;  // queries per pass: 16 accumulators (4 x D 64 or 2 x D 128)
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const float* sg = scores + g0 * kBlock;
    float* ag = acc + g0 * kD;
    switch (std::min(GB, G - g0)) {
      case 1: accumulate_queries_avx512<T, kD, 1>(rows, off, n, sg, ag); break;
      case 2: accumulate_queries_avx512<T, kD, 2>(rows, off, n, sg, ag); break;
      case 3: accumulate_queries_avx512<T, kD, 3>(rows, off, n, sg, ag); break;
      default: accumulate_queries_avx512<T, kD, GB>(rows, off, n, sg, ag); break;
    }
  }
}

#if defined(__AVX512BF16__)
// Queries per bf16 score pass (`score_block_bf16`); the first pass's queries and the V pass
// share the next block's lines between them (`accumulate_block_bf16`).
constexpr int64_t kScoreQueries = 4;

template <int64_t kD>
inline __m512 dot_bf16(const c10::BFloat16* kr, const __m512bh* q) {
  constexpr int64_t W = kD / 32;
  __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(kr), q[0]);
  for (int64_t w = 1; w < W; ++w) dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(kr + 32 * w), q[w]);
  return dot;
}

// bf16 scores by VDPBF16PS: each instruction multiplies 32 bf16 pairs exactly and adds them in
// float32, so a key row is used as stored (no conversion) against the unscaled bf16 queries;
// the scale is applied to the sums. GN queries stay in registers over the block. Each query's
// pass requests its slot of the next block's lines; the V pass requests the last slot.
template <int64_t kD, int64_t GN>
inline void score_queries_bf16(const c10::BFloat16* const* rows, int64_t off, int64_t n, const c10::BFloat16* q,
                               float scale, float* scores, const Ahead<c10::BFloat16>& ahead) {
  constexpr int64_t W = kD / 32;
  __m512bh qv[GN][W];
  for (int64_t g = 0; g < GN; ++g)
    for (int64_t w = 0; w < W; ++w) qv[g][w] = (__m512bh)_mm512_loadu_si512(q + g * kD + 32 * w);
  const __m512 sv = _mm512_set1_ps(scale);
  using A = Ahead<c10::BFloat16>;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {  // 16 keys at a time, their sums reduced together
    for (int64_t g = 0; g < GN; ++g) {
      __m512 d[16];
      for (int64_t i = 0; i < 16; ++i) {
        d[i] = dot_bf16<kD>(rows[j + i] + off, qv[g]);
        ahead.fetch_lines<kD>(j + i, off, A::slot_start<kD>(g, GN + 1), A::slot_start<kD>(g + 1, GN + 1));
      }
      _mm512_storeu_ps(scores + g * kBlock + j, _mm512_mul_ps(longctx::sum16(d), sv));
    }
  }
  for (; j < n; ++j)
    for (int64_t g = 0; g < GN; ++g)
      scores[g * kBlock + j] = _mm512_reduce_add_ps(dot_bf16<kD>(rows[j] + off, qv[g])) * scale;
}

template <int64_t kD>
inline void score_block_bf16(const c10::BFloat16* const* rows, int64_t off, int64_t n, const c10::BFloat16* q,
                             int64_t G, float scale, float* scores, const Ahead<c10::BFloat16>& ahead) {
  constexpr int64_t GB = kScoreQueries;
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const c10::BFloat16* qg = q + g0 * kD;
    float* sg = scores + g0 * kBlock;
    const Ahead<c10::BFloat16> a = g0 == 0 ? ahead : Ahead<c10::BFloat16>{};  // once per key
    switch (std::min(GB, G - g0)) {
      case 1: score_queries_bf16<kD, 1>(rows, off, n, qg, scale, sg, a); break;
      case 2: score_queries_bf16<kD, 2>(rows, off, n, qg, scale, sg, a); break;
      case 3: score_queries_bf16<kD, 3>(rows, off, n, qg, scale, sg, a); break;
      default: score_queries_bf16<kD, GB>(rows, off, n, qg, scale, sg, a); break;
    }
  }
}
// acc[g] += sum_j p[g][j] v_j by VDPBF16PS, keys in pairs: the two V rows interleaved (one bf16
// of each per 32-bit lane) against each query's pair of weights, rounded to bf16, broadcast.
// The accumulators keep the interleave's dim order over the block (`split_interleaved`,
// cpu_vec.h) and are permuted back to `acc` after it. Weights past n must be zero.
template <int64_t kD, int64_t GN>
inline void accumulate_queries_bf16(const c10::BFloat16* const* rows, int64_t off, int64_t n, const float* scores,
                                    float* acc, const Ahead<c10::BFloat16>& ahead, int64_t first, int64_t last) {
  constexpr int64_t W = kD / 32;
  __m512 lo[GN][W], hi[GN][W];
  alignas(64) uint32_t pairs[GN][kBlock / 2];
  static_assert(kBlock == 32, "one vector of weight pairs per query");
  for (int64_t g = 0; g < GN; ++g) {
    for (int64_t w = 0; w < W; ++w) {
      const __m512 a0 = _mm512_loadu_ps(acc + g * kD + 32 * w), a1 = _mm512_loadu_ps(acc + g * kD + 32 * w + 16);
      longctx::split_interleaved(a0, a1, &lo[g][w], &hi[g][w]);
    }
    const __m512bh p = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(scores + g * kBlock + 16), _mm512_loadu_ps(scores + g * kBlock));
    _mm512_store_si512(pairs[g], (__m512i)p);
  }
  for (int64_t j = 0; j < n; j += 2) {
    const c10::BFloat16* r0 = rows[j] + off;
    const c10::BFloat16* r1 = (j + 1 < n ? rows[j + 1] : rows[j]) + off;  // weight 0 past n
    ahead.fetch_lines<kD>(j, off - ahead.half, first, last);
    ahead.fetch_lines<kD>(j + 1, off - ahead.half, first, last);
    for (int64_t w = 0; w < W; ++w) {
      const __m512i x = _mm512_loadu_si512(r0 + 32 * w), y = _mm512_loadu_si512(r1 + 32 * w);
      const __m512bh vl = (__m512bh)_mm512_unpacklo_epi16(x, y), vh = (__m512bh)_mm512_unpackhi_epi16(x, y);
      for (int64_t g = 0; g < GN; ++g) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[g][j / 2]));
        lo[g][w] = _mm512_dpbf16_ps(lo[g][w], vl, p);
        hi[g][w] = _mm512_dpbf16_ps(hi[g][w], vh, p);
      }
    }
  }
  for (int64_t g = 0; g < GN; ++g)
    for (int64_t w = 0; w < W; ++w) {
      __m512 a, b;
      longctx::join_interleaved(lo[g][w], hi[g][w], &a, &b);
      _mm512_storeu_ps(acc + g * kD + 32 * w, a);
      _mm512_storeu_ps(acc + g * kD + 32 * w + 16, b);
    }
}

template <int64_t kD>
inline void accumulate_block_bf16(const c10::BFloat16* const* rows, int64_t off, int64_t n, const float* scores,
                                  int64_t G, float* acc, const Ahead<c10::BFloat16>& ahead) {
  constexpr int64_t GB = kD <= 64 ? 4 : 2;  // queries per pass: 16 accumulators
  // The last slot of the next block's lines: after the first score pass's query slots.
  using A = Ahead<c10::BFloat16>;
  const int64_t slots = std::min(G, kScoreQueries) + 1;
  const int64_t first = A::slot_start<kD>(slots - 1, slots), last = A::slot_start<kD>(slots, slots);
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const float* sg = scores + g0 * kBlock;
    float* ag = acc + g0 * kD;
    const int64_t f = g0 ? 0 : first, l = g0 ? 0 : last;  // the first pass only: once per key
    switch (std::min(GB, G - g0)) {
      case 1: accumulate_queries_bf16<kD, 1>(rows, off, n, sg, ag, ahead, f, l); break;
      case 2: accumulate_queries_bf16<kD, 2>(rows, off, n, sg, ag, ahead, f, l); break;
      case 3: accumulate_queries_bf16<kD, 3>(rows, off, n, sg, ag, ahead, f, l); break;
      default: accumulate_queries_bf16<kD, GB>(rows, off, n, sg, ag, ahead, f, l); break;
    }
  }
}
constexpr bool kBF16Dot = true;
#else
template <int64_t kD>
inline void score_block_bf16(const c10::BFloat16* const*, int64_t, int64_t, const c10::BFloat16*, int64_t, float,
                             float*, const Ahead<c10::BFloat16>&) {}
template <int64_t kD>
inline void accumulate_block_bf16(const c10::BFloat16* const*, int64_t, int64_t, const float*, int64_t, float*,
                                  const Ahead<c10::BFloat16>&) {}
constexpr bool kBF16Dot = false;
#endif
constexpr bool kVector = true;
#else
template <typename T, int64_t kD>
inline void score_block_avx512(const T* const*, int64_t, int64_t, const float*, int64_t, float*, const Ahead<T>&) {}
template <typename T, int64_t kD>
inline void accumulate_block_avx512(const T* const*, int64_t, int64_t, const float*, int64_t, float*) {}
template <int64_t kD>
inline void score_block_bf16(const c10::BFloat16* const*, int64_t, int64_t, const c10::BFloat16*, int64_t, float,
                             float*, const Ahead<c10::BFloat16>&) {}
template <int64_t kD>
inline void accumulate_block_bf16(const c10::BFloat16* const*, int64_t, int64_t, const float*, int64_t, float*,
                                  const Ahead<c10::BFloat16>&) {}
inline float softmax_block_avx512(float*, int64_t, float m, float*) { return m; }
constexpr bool kVector = false;
constexpr bool kBF16Dot = false;
#endif

// kD > 0: the head dim as a compile-time constant (unrolled, vectorized loops); 0: any.
template <typename T, int64_t kD>
void run(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& pages, const at::Tensor& starts,
         const at::Tensor& lengths, double scale, int64_t chunk, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = kD > 0 ? kD : q.size(2);
  const int64_t S = cache.size(2), KVH = cache.size(3);
  const int64_t G = H / KVH, N = pages.size(1);
  const T* qp = q.data_ptr<T>();
  const int64_t q_stride = q.stride(0);  // rows may be strided (a slice of the QKV output)
  const T* cp = cache.data_ptr<T>();
  const int32_t* pp = pages.data_ptr<int32_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = std::max(max_len, lp[b]);
  const int64_t C = std::max<int64_t>(1, (max_len + chunk - 1) / chunk);
  // Per task (sequence, chunk of keys) and query head: running max, sum, and the
  // unnormalized output [D]. A task reads every KV head of its keys: whole cache rows, in order.
  std::vector<float> part_m(B * C * H), part_l(B * C * H), part_acc(B * C * H * D);
  const int64_t row = KVH * D;   // one token of one page half
  const int64_t half = S * row;  // K or V of one page
  const float fscale = static_cast<float>(scale);

  int64_t total_len = 0;
  for (int64_t b = 0; b < B; ++b) total_len += lp[b];
  // The rows of a task's first block (sequence b, chunk c) -> how many: the task starts with
  // them, and they are requested during the last block of the task before it on the same
  // thread (at 2k keys a layer, 8 tasks of 256 keys, ~10% faster than leaving each task's
  // first block to demand misses).
  auto first_rows = [&](int64_t task, const T** out) -> int64_t {
    const int64_t c = task % C, b = task / C;
    const int64_t t0 = c * chunk, count = std::max<int64_t>(0, std::min({kBlock, lp[b] - t0, chunk}));
    for (int64_t j = 0; j < count; ++j) {
      const int64_t pos = sp[b] + t0 + j;
      out[j] = cp + static_cast<int64_t>(pp[b * N + pos / S]) * 2 * half + (pos % S) * row;
    }
    return count;
  };
  maybe_parallel(B * C, total_len * H * D, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), kf(D), scores(G * kBlock);
    const T* rows[kBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = task % C, b = task / C;
      const int64_t t0 = c * chunk, t1 = std::min(lp[b], t0 + chunk);
      float* m = &part_m[task * H];
      float* l = &part_l[task * H];
      float* acc = &part_acc[task * H * D];
      std::fill(m, m + H, -std::numeric_limits<float>::infinity());
      std::fill(l, l + H, 0.f);
      if (t0 >= t1) continue;
      std::fill(acc, acc + H * D, 0.f);
      for (int64_t i = 0; i < H * D; ++i) qf[i] = to_float(qp[b * q_stride + i]) * fscale;
      const int32_t* table = pp + b * N;
      const int64_t start = sp[b];
      int64_t n = first_rows(task, rows);
      int64_t page = (start + t0 + n) / S, offset = (start + t0 + n) % S;  // of the next key
      auto next_rows = [&](const T** out, int64_t count) {
        for (int64_t j = 0; j < count; ++j) {
          out[j] = cp + static_cast<int64_t>(table[page]) * 2 * half + offset * row;
          if (++offset == S) offset = 0, ++page;
        }
      };
      const T* ahead_rows[kBlock];
      for (int64_t k0 = t0; k0 < t1; k0 += kBlock) {
        int64_t n_ahead = std::max<int64_t>(0, std::min(kBlock, t1 - k0 - kBlock));
        next_rows(ahead_rows, n_ahead);
        if (n_ahead == 0 && task + 1 < end) n_ahead = first_rows(task + 1, ahead_rows);  // this thread's next task
        const Ahead<T> ahead{ahead_rows, n_ahead, half};
        for (int64_t h = 0; h < KVH; ++h) {
          if constexpr (kBF16Dot && std::is_same_v<T, c10::BFloat16> && kD > 0 && kD % 32 == 0) {
            score_block_bf16<kD>(rows, h * D, n, qp + b * q_stride + h * G * D, G, fscale, scores.data(), ahead);
          } else if constexpr (kVector && kD > 0 && kD % 16 == 0) {
            score_block_avx512<T, kD>(rows, h * D, n, &qf[h * G * D], G, scores.data(), ahead);
          } else {
            score_block<T, kD>(rows, h * D, n, &qf[h * G * D], G, D, kf.data(), scores.data(), ahead);
          }
          for (int64_t g = 0; g < G; ++g) {
            const int64_t head = h * G + g;
            float* sg = &scores[g * kBlock];
            float bm = m[head];
            float sum = 0.f;
            if constexpr (kVector) {
              bm = softmax_block_avx512(sg, n, bm, &sum);
            } else {
              for (int64_t j = 0; j < n; ++j) bm = std::max(bm, sg[j]);
              for (int64_t j = 0; j < n; ++j) {
                sg[j] = exp_nonpositive(sg[j] - bm);
                sum += sg[j];
              }
            }
            const float corr = exp_nonpositive(m[head] - bm);
            l[head] = l[head] * corr + sum;
            m[head] = bm;
            float* ag = &acc[head * D];
            for (int64_t d = 0; d < D; ++d) ag[d] *= corr;
          }
          if constexpr (kBF16Dot && std::is_same_v<T, c10::BFloat16> && kD > 0 && kD % 32 == 0) {  // the values
            accumulate_block_bf16<kD>(rows, half + h * D, n, scores.data(), G, &acc[h * G * D], ahead);
          } else if constexpr (kVector && kD > 0 && kD % 16 == 0) {  // each page's V half
            accumulate_block_avx512<T, kD>(rows, half + h * D, n, scores.data(), G, &acc[h * G * D]);
          } else {
            accumulate_block<T, kD>(rows, half + h * D, n, scores.data(), G, D, kf.data(), &acc[h * G * D]);
          }
        }
        std::copy(ahead_rows, ahead_rows + n_ahead, rows);
        n = n_ahead;
      }
    }
  });

  T* op = out.data_ptr<T>();
  maybe_parallel(B * H, B * H * C * D, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, head = bh % H;
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < C; ++c) M = std::max(M, part_m[(b * C + c) * H + head]);
      float L = 0.f;
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t c = 0; c < C; ++c) {
        const int64_t at = (b * C + c) * H + head;
        if (part_l[at] == 0.f) continue;
        const float w = std::exp(part_m[at] - M);  // (few: no need to vectorize)
        L += part_l[at] * w;
        const float* a = &part_acc[at * D];
        for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
      }
      T* dst = op + bh * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d] / L);
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& pages,
                        const at::Tensor& starts, const at::Tensor& lengths, double scale, int64_t chunk) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q: [B, H, D], each row's heads contiguous");
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() && cache.size(1) == 2, "cache must be [P, 2, S, KVH, D]");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type(), "q and cache must have one dtype");
  TORCH_CHECK(cache.size(4) == q.size(2) && q.size(1) % cache.size(3) == 0, "head shapes disagree");
  TORCH_CHECK(pages.scalar_type() == at::kInt && pages.dim() == 2 && pages.is_contiguous(), "pages: [B, N] int32");
  TORCH_CHECK(pages.size(0) == q.size(0) && starts.numel() == q.size(0) && lengths.numel() == q.size(0),
              "one page row, start and length per query");
  TORCH_CHECK(starts.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong, "starts, lengths: int64");
  TORCH_CHECK(chunk >= 1, "chunk must be >= 1");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_decode supports float32 and bfloat16");
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  const at::Tensor s = starts.contiguous(), l = lengths.contiguous();
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  switch (q.size(2)) {
    case 64:
      bf16 ? run<c10::BFloat16, 64>(q, cache, pages, s, l, scale, chunk, out)
           : run<float, 64>(q, cache, pages, s, l, scale, chunk, out);
      break;
    case 128:
      bf16 ? run<c10::BFloat16, 128>(q, cache, pages, s, l, scale, chunk, out)
           : run<float, 128>(q, cache, pages, s, l, scale, chunk, out);
      break;
    default:
      bf16 ? run<c10::BFloat16, 0>(q, cache, pages, s, l, scale, chunk, out)
           : run<float, 0>(q, cache, pages, s, l, scale, chunk, out);
  }
  return out;
}

// The step's new K and V rows into the cache: cache [P, 2, S, KVH, D] viewed flat as rows of
// [KVH, D]; k, v [T, KVH, D] (rows may be strided); slots [2T] int64, the rows of K then of V.
void store_kv(at::Tensor& cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK(cache.is_contiguous() && k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type(),
              "store_kv: a contiguous cache and K/V of its dtype");
  const int64_t T = k.size(0), row = cache.size(3) * cache.size(4);
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && v.size(0) == T && slots.numel() == 2 * T, "store_kv: shapes");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2) &&
                  k.size(1) * k.size(2) == row && v.size(1) * v.size(2) == row,
              "store_kv: each token's K/V must be one contiguous row of the cache's width");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "store_kv: int64 slots");
  const int64_t rows = cache.numel() / row, bytes = row * cache.element_size();
  const int64_t* sp = slots.data_ptr<int64_t>();
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* src[2] = {static_cast<const char*>(k.data_ptr()), static_cast<const char*>(v.data_ptr())};
  const int64_t stride[2] = {k.stride(0) * k.element_size(), v.stride(0) * v.element_size()};
  for (int64_t i = 0; i < 2 * T; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < rows, "store_kv: slot out of range");
    std::memcpy(dst + sp[i] * bytes, src[i / T] + (i % T) * stride[i / T], bytes);
  }
}

}  // namespace

TORCH_LIBRARY(longctx, m) {
  m.def("paged_decode(Tensor q, Tensor cache, Tensor pages, Tensor starts, Tensor lengths, float scale, int chunk) -> Tensor");
  m.def("store_kv(Tensor(a!) cache, Tensor k, Tensor v, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(longctx, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("store_kv", &store_kv);
}
