// Prefill attention over a paged KV cache on CPU: one sequence's chunk of T query tokens against
// its cached keys (the chunk's own K/V already written), causal and optionally windowed, read
// where the keys are in the cache (no gathered copy of the context).
//
// Keys are numbered from token 0 of the page list's first page; query t sits at key position
// q0 + t and attends keys k with k <= q0 + t (and k > q0 + t - window when window > 0).
//
// Head dims 64 and 128 with AVX-512, flash-attention style: both products as outer products,
// in bf16 by VDPBF16PS (without AVX512-BF16 its pairs widened to float32 for FMA, cpu_vec.h),
// in float32 by FMA. Work is split into (KV head, tile of kTile tokens) tasks; a task's rows
// are its tokens x the G query heads sharing the KV head.
// Per block of kKeys keys the task
//   - transposes the block's K rows into 32-bit words by key (16 keys per vector; a word is a
//     pair of bf16 dims or one float32 dim), so a score vector is 16 keys of one row: the sum
//     over words of K words x the row's broadcast query word;
//   - updates each row's running max and sum (online softmax); in bf16 its weights rounded to
//     bf16 pairs;
//   - adds weights x V rows to the rows' float32 outputs: in bf16 the block's V rows
//     interleaved by key pairs against weight pairs (the outputs' dims in the interleave's
//     order, restored at the end), in float32 each V row against its broadcast weight.
//
// Registered as torch.ops.longctx.paged_prefill:
//   q [T, H, D] (each row's heads contiguous; rows may be strided), cache [P, 2, S, KVH, D],
//   pages [N] int32, q0, window (0: none), scale -> [T, H, D]
// and paged_prefill_supported(dtype, head_dim) -> bool (whether this build has that path).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)

// Keys per block and query tokens per task: measured best of 32/64 keys x 8/16/32 tokens
// (64 x 32 ~10% faster than 32 x 16 at 512 and 2048 tokens).
constexpr int64_t kKeys = 64;
constexpr int64_t kTile = 32;
constexpr int64_t kNV = kKeys / 16;  // score vectors per row and block

// 16 vectors of 16 int32 transposed in place (a[i][j] -> a[j][i]).
inline void transpose16(__m512i* a) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c], 128-bit lane L: column 4L + c of rows 4i..4i+3
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    a[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);      // lane 0 of every row
    a[4 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);  // lane 1
    a[8 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);  // lane 2
    a[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// Scores of RB rows against a block's keys: s[r][0..31] = q_r . k_j (unscaled), from the
// transposed K pairs kp[w * 2 + half] (half: keys 0-15 or 16-31) and each row's query pairs.
// acc + a . b per 32-bit word: bf16 pairs (VDPBF16PS) or float32 (FMA).
template <bool kBF>
inline __m512 word_fma(__m512 acc, __m512i a, __m512i b) {
  if constexpr (kBF) return longctx::dpbf16_ps(acc, a, b);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc);
}

// Scores of RB rows against a block's keys: s[r][j] = q_r . k_j (unscaled), from the K words
// kp[w * kNV + v] (keys 16v..16v+15) and each row's query words (W per row).
template <bool kBF, int64_t W, int64_t RB>
inline void score_rows(const __m512i* kp, const uint32_t* const* q, float* s) {
  __m512 acc[RB][kNV];
  for (int64_t r = 0; r < RB; ++r)
    for (int64_t v = 0; v < kNV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t w = 0; w < W; ++w) {
    __m512i k[kNV];
    for (int64_t v = 0; v < kNV; ++v) k[v] = kp[w * kNV + v];
    for (int64_t r = 0; r < RB; ++r) {
      const __m512i qw = _mm512_set1_epi32(static_cast<int>(q[r][w]));
      for (int64_t v = 0; v < kNV; ++v) acc[r][v] = word_fma<kBF>(acc[r][v], k[v], qw);
    }
  }
  for (int64_t r = 0; r < RB; ++r)
    for (int64_t v = 0; v < kNV; ++v) _mm512_storeu_ps(s + r * kKeys + 16 * v, acc[r][v]);
}

// An output pass over RB rows (kD / 16 float32 vectors each): their outputs loaded, scaled by
// each row's softmax correction, and stored back after the block's products are added.
template <int64_t kD, int64_t RB>
inline void load_outputs(const float* o, const float* corr, __m512 (&acc)[RB][kD / 16]) {
  for (int64_t r = 0; r < RB; ++r) {
    const __m512 c = _mm512_set1_ps(corr[r]);
    for (int64_t v = 0; v < kD / 16; ++v) acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o + r * kD + 16 * v), c);
  }
}
template <int64_t kD, int64_t RB>
inline void store_outputs(const __m512 (&acc)[RB][kD / 16], float* o) {
  for (int64_t r = 0; r < RB; ++r)
    for (int64_t v = 0; v < kD / 16; ++v) _mm512_storeu_ps(o + r * kD + 16 * v, acc[r][v]);
}

// Outputs of RB rows (float32 in dim order), float32 cache: o = o * corr + sum over the
// block's n keys of the row's weight p[r][j] x V row j.
template <int64_t kD, int64_t RB>
inline void accumulate_rows_f32(const float* const* vrows, int64_t n, const float* p, const float* corr, float* o) {
  constexpr int64_t C = kD / 16;
  __m512 acc[RB][C];
  load_outputs<kD, RB>(o, corr, acc);
  for (int64_t j = 0; j < n; ++j) {
    __m512 val[C];
    for (int64_t v = 0; v < C; ++v) val[v] = _mm512_loadu_ps(vrows[j] + 16 * v);
    for (int64_t r = 0; r < RB; ++r) {
      const __m512 pb = _mm512_set1_ps(p[r * kKeys + j]);
      for (int64_t v = 0; v < C; ++v) acc[r][v] = _mm512_fmadd_ps(pb, val[v], acc[r][v]);
    }
  }
  store_outputs<kD, RB>(acc, o);
}

// Outputs of RB rows (float32, interleaved dim order), bf16 cache: o = o * corr + sum over key
// pairs of the row's weight pair x the V pairs vp[pair * kD / 16 + c].
template <int64_t kD, int64_t RB>
inline void accumulate_rows_bf16(const __m512i* vp, int64_t pairs, const uint32_t* p, const float* corr, float* o) {
  constexpr int64_t C = kD / 16;
  __m512 acc[RB][C];
  load_outputs<kD, RB>(o, corr, acc);
  for (int64_t jp = 0; jp < pairs; ++jp) {
    for (int64_t r = 0; r < RB; ++r) {
      const __m512i pb = _mm512_set1_epi32(static_cast<int>(p[r * (kKeys / 2) + jp]));
      for (int64_t v = 0; v < C; ++v) acc[r][v] = word_fma<true>(acc[r][v], vp[jp * C + v], pb);
    }
  }
  store_outputs<kD, RB>(acc, o);
}

// A row's block of weights (kNV vectors): bf16 pairs (by key pairs) or float32.
template <bool kBF>
inline void store_weights(const __m512* pv, uint32_t* pairs, float* weights) {
  if constexpr (kBF) {
    for (int64_t v = 0; v < kNV; v += 2) _mm512_storeu_si512(pairs + 8 * v, longctx::cvtne2ps_bf16(pv[v + 1], pv[v]));
    return;
  }
  for (int64_t v = 0; v < kNV; ++v) _mm512_storeu_ps(weights + 16 * v, pv[v]);
}

// 32 floats (a then b) as bf16, rounded to nearest even.
template <typename T>
inline void store_bf16(T* dst, __m512 a, __m512 b) {
  _mm512_storeu_si512(dst, longctx::cvtne2ps_bf16(b, a));
}

template <typename T, int64_t kD>
void run(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& pages, int64_t q0, int64_t window,
         double scale, at::Tensor& out) {
  constexpr bool kBF = std::is_same_v<T, c10::BFloat16>;
  constexpr int64_t W = kBF ? kD / 2 : kD;  // 32-bit words per row of one head
  const int64_t T_ = q.size(0), H = q.size(1);
  const int64_t S = cache.size(2), KVH = cache.size(3), G = H / KVH;
  const int64_t row = KVH * kD, half = S * row;
  const T* qp = q.data_ptr<T>();
  const int64_t q_stride = q.stride(0);
  const T* cp = cache.data_ptr<T>();
  const int32_t* table = pages.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const int64_t tiles = (T_ + kTile - 1) / kTile, tasks = tiles * KVH;
  constexpr int64_t C = kD / 16;            // output vectors per row
  constexpr int64_t RS = 16 / kNV;          // rows per score pass (16 accumulators)
  constexpr int64_t RV = kD <= 64 ? 6 : 3;  // rows per output pass (24 accumulators)
  const float neg = -std::numeric_limits<float>::infinity();
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);

  // Tasks by decreasing cost (later tiles read more keys), dealt to the threads in turn.
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  int64_t keys_total = 0;
  for (int64_t i = 0; i < tiles; ++i) keys_total += q0 + std::min(T_, (i + 1) * kTile);
  longctx::maybe_parallel(threads, keys_total * kTile * H * kD, [&](int64_t begin, int64_t end) {
    const int64_t R = kTile * G;  // rows per task at most
    std::vector<float> o(R * kD), s(R * kKeys), m(R), l(R), corr(R);
    std::vector<uint32_t> p(kBF ? R * (kKeys / 2) : 0);  // bf16: weight pairs
    std::vector<float> pf(kBF ? 0 : R * kKeys);             // float32: weights
    std::vector<const uint32_t*> qrows(R);
    std::vector<int64_t> pos(R);
    std::vector<__m512i> kp(W * kNV), vp(kBF ? kKeys / 2 * C : 0);  // words x key groups; key pairs x C
    for (int64_t thread = begin; thread < end; ++thread) {
      for (int64_t order = thread; order < tasks; order += threads) {
        const int64_t tile = tiles - 1 - order / KVH, h = order % KVH;
        const int64_t t0 = tile * kTile, t1 = std::min(T_, t0 + kTile), rows = (t1 - t0) * G;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t t = t0 + r / G, head = h * G + r % G;
          qrows[r] = reinterpret_cast<const uint32_t*>(qp + t * q_stride + head * kD);
          pos[r] = q0 + t;
        }
        std::fill(o.begin(), o.begin() + rows * kD, 0.f);
        std::fill(m.begin(), m.begin() + rows, -std::numeric_limits<float>::infinity());
        std::fill(l.begin(), l.begin() + rows, 0.f);
        const int64_t first_pos = q0 + t0, last_pos = q0 + t1 - 1;
        const int64_t k_lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
        for (int64_t kb = k_lo / kKeys * kKeys; kb <= last_pos; kb += kKeys) {
          const int64_t n = std::min(kKeys, last_pos + 1 - kb);
          const T* krow[kKeys];
          for (int64_t j = 0; j < kKeys; ++j) {  // keys past n repeat the first (their weights are 0)
            const int64_t key = kb + (j < n ? j : 0);
            krow[j] = cp + static_cast<int64_t>(table[key / S]) * 2 * half + (key % S) * row + h * kD;
          }
          // K words by key: kp[w * kNV + v] lane j = word w of key 16 * v + j.
          for (int64_t v = 0; v < kNV; ++v) {
            if (16 * v >= n) {  // keys past n: any finite values (their weights are 0)
              for (int64_t w = 0; w < W; ++w) kp[w * kNV + v] = kp[w * kNV];
              continue;
            }
            for (int64_t w0 = 0; w0 < W; w0 += 16) {
              __m512i a[16];
              for (int64_t j = 0; j < 16; ++j)
                a[j] = _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(krow[16 * v + j]) + w0);
              transpose16(a);
              for (int64_t w = 0; w < 16; ++w) kp[(w0 + w) * kNV + v] = a[w];
            }
          }
          // bf16 V by key pairs: vp[jp * C + 2v (+1)] = unpacklo (unpackhi) of keys 2jp, 2jp + 1's
          // dims 32v..
          const int64_t pairs = (n + 1) / 2;
          for (int64_t jp = 0; kBF && jp < pairs; ++jp) {
            const T* v0 = krow[2 * jp] + half;
            const T* v1 = krow[2 * jp + 1] + half;
            for (int64_t v = 0; v < kD / 32; ++v) {
              const __m512i x = _mm512_loadu_si512(v0 + 32 * v), y = _mm512_loadu_si512(v1 + 32 * v);
              vp[jp * C + 2 * v] = _mm512_unpacklo_epi16(x, y);
              vp[jp * C + 2 * v + 1] = _mm512_unpackhi_epi16(x, y);
            }
          }
          int64_t r = 0;
          for (; r + RS <= rows; r += RS) score_rows<kBF, W, RS>(kp.data(), &qrows[r], &s[r * kKeys]);
          for (; r < rows; ++r) score_rows<kBF, W, 1>(kp.data(), &qrows[r], &s[r * kKeys]);
          // Online softmax per row; a mask only where the block crosses a row's bounds.
          const bool edge = kb + kKeys > first_pos + 1 || (window > 0 && kb <= last_pos - window);
          for (r = 0; r < rows; ++r) {
            __m512 sv[kNV];
            __mmask16 mk[kNV];
            float bm = m[r];
            for (int64_t v = 0; v < kNV; ++v) {
              sv[v] = _mm512_mul_ps(_mm512_loadu_ps(&s[r * kKeys + 16 * v]), _mm512_set1_ps(fscale));
              mk[v] = 0xFFFF;
              if (edge) {  // valid: lo < key <= pos (lo = pos - window, or -1)
                const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(kb + 16 * v)));
                const __m512i hi = _mm512_set1_epi32(static_cast<int>(pos[r]));
                const __m512i lo = _mm512_set1_epi32(static_cast<int>(window > 0 ? pos[r] - window : -1));
                mk[v] = _mm512_cmple_epi32_mask(key, hi) & _mm512_cmpgt_epi32_mask(key, lo);
              }
            }
            __m512 mx = _mm512_mask_mov_ps(_mm512_set1_ps(neg), mk[0], sv[0]);
            for (int64_t v = 1; v < kNV; ++v) mx = _mm512_mask_max_ps(mx, mk[v], mx, sv[v]);
            bm = std::max(bm, _mm512_reduce_max_ps(mx));
            __m512 pv[kNV];
            for (int64_t v = 0; v < kNV; ++v) pv[v] = _mm512_setzero_ps();
            float c = 1.f;
            if (bm != neg) {
              const __m512 b = _mm512_set1_ps(bm);
              for (int64_t v = 0; v < kNV; ++v)
                pv[v] = _mm512_maskz_mov_ps(mk[v], longctx::exp_nonpositive_ps(_mm512_sub_ps(sv[v], b)));
              c = m[r] == neg ? 0.f : _mm512_cvtss_f32(longctx::exp_nonpositive_ps(_mm512_set1_ps(m[r] - bm)));
              m[r] = bm;
            }
            __m512 sum = pv[0];
            for (int64_t v = 1; v < kNV; ++v) sum = _mm512_add_ps(sum, pv[v]);
            l[r] = l[r] * c + _mm512_reduce_add_ps(sum);
            corr[r] = c;
            store_weights<kBF>(pv, &p[kBF ? r * (kKeys / 2) : 0], &pf[kBF ? 0 : r * kKeys]);
          }
          if constexpr (kBF) {
            for (r = 0; r + RV <= rows; r += RV)
              accumulate_rows_bf16<kD, RV>(vp.data(), pairs, &p[r * (kKeys / 2)], &corr[r], &o[r * kD]);
            for (; r < rows; ++r)
              accumulate_rows_bf16<kD, 1>(vp.data(), pairs, &p[r * (kKeys / 2)], &corr[r], &o[r * kD]);
          } else {
            const float* vrows[kKeys];
            for (int64_t j = 0; j < n; ++j) vrows[j] = reinterpret_cast<const float*>(krow[j] + half);
            for (r = 0; r + RV <= rows; r += RV)
              accumulate_rows_f32<kD, RV>(vrows, n, &pf[r * kKeys], &corr[r], &o[r * kD]);
            for (; r < rows; ++r) accumulate_rows_f32<kD, 1>(vrows, n, &pf[r * kKeys], &corr[r], &o[r * kD]);
          }
        }
        for (int64_t r = 0; r < rows; ++r) {  // o / l (bf16: dims back in order)
          const int64_t t = t0 + r / G, head = h * G + r % G;
          const __m512 inv = _mm512_set1_ps(l[r] > 0.f ? 1.f / l[r] : 0.f);
          T* dst = op + (t * H + head) * kD;
          for (int64_t v = 0; v < kD / 32; ++v) {
            const __m512 lo = _mm512_loadu_ps(&o[r * kD + 32 * v]), hi = _mm512_loadu_ps(&o[r * kD + 32 * v + 16]);
            if constexpr (kBF) {
              __m512 a, b;
              longctx::join_interleaved(lo, hi, &a, &b);
              store_bf16(dst + 32 * v, _mm512_mul_ps(a, inv), _mm512_mul_ps(b, inv));
            } else {
              _mm512_storeu_ps(reinterpret_cast<float*>(dst) + 32 * v, _mm512_mul_ps(lo, inv));
              _mm512_storeu_ps(reinterpret_cast<float*>(dst) + 32 * v + 16, _mm512_mul_ps(hi, inv));
            }
          }
        }
      }
    }
  });
}

bool supported(c10::ScalarType dtype, int64_t head_dim) {
  return (dtype == at::kFloat || dtype == at::kBFloat16) && (head_dim == 64 || head_dim == 128);
}

#else

bool supported(c10::ScalarType, int64_t) { return false; }

#endif

bool paged_prefill_supported(c10::ScalarType dtype, int64_t head_dim) { return supported(dtype, head_dim); }

at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& pages, int64_t q0,
                         int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q: [T, H, D], each row's heads contiguous");
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() && cache.size(1) == 2, "cache must be [P, 2, S, KVH, D]");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type(), "q and cache must have one dtype");
  TORCH_CHECK(cache.size(4) == q.size(2) && q.size(1) % cache.size(3) == 0, "head shapes disagree");
  TORCH_CHECK(pages.scalar_type() == at::kInt && pages.dim() == 1 && pages.is_contiguous(), "pages: [N] int32");
  TORCH_CHECK(q0 >= 0 && window >= 0, "q0 and window must be >= 0");
  TORCH_CHECK((q0 + q.size(0) + cache.size(2) - 1) / cache.size(2) <= pages.size(0), "pages do not cover the keys");
  TORCH_CHECK(supported(q.scalar_type(), q.size(2)), "paged_prefill: no path for this dtype and head dim here");
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
#if defined(__AVX512F__)
  if (q.size(0) > 0) {
    const bool bf16 = q.scalar_type() == at::kBFloat16, d64 = q.size(2) == 64;
    if (bf16) {
      d64 ? run<c10::BFloat16, 64>(q, cache, pages, q0, window, scale, out)
          : run<c10::BFloat16, 128>(q, cache, pages, q0, window, scale, out);
    } else {
      d64 ? run<float, 64>(q, cache, pages, q0, window, scale, out)
          : run<float, 128>(q, cache, pages, q0, window, scale, out);
    }
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(longctx, m) {
  m.def("paged_prefill(Tensor q, Tensor cache, Tensor pages, int q0, int window, float scale) -> Tensor");
  m.def("paged_prefill_supported(ScalarType dtype, int head_dim) -> bool", &paged_prefill_supported);
}

TORCH_LIBRARY_IMPL(longctx, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
