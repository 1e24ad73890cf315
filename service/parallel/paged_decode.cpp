// One decode step's attention over a rank's paged KV pool, in place (service.parallel.paged_decode).
//
// Math: for session i of a step, its one query row q_i [H, D] at position len_i - 1 attends
// positions 0 .. len_i - 1 of its session, which lie in the pool at
//     pool[table_i[p / B], p % B, h / G, :]     (G = H / KVH: grouped-query attention)
//     out_i[h] = sum_p softmax_p(scale * q_i[h] . K[p, h / G]) V[p, h / G]
// exactly what the gather path computes after copying the pages out.
//
// How: a session's pages are cut into chunks, and the chunks of every session of the step are
// shared among the threads (OpenMP, torch's own libgomp: the same soname). A chunk walks its
// pages; on each it scores every query head against every token (the K pass), keeps a running
// maximum and sum per head (the online softmax, rescaled once per page), then adds each token's
// weighted V row into the head's accumulator (the V pass). The chunks of a session are merged by
// their maxima at the end. So each byte of a session's K/V is read once per step, with no copy:
// the memory floor's term.
//
// The vector path (heads of 64 or 128, grouped or plain, over pages of a multiple of 16 tokens): the
// next page is prefetched; the K pass reads the page token by token (its bytes in order), each
// token's K row once for the G query heads that share it, and keeps each (head, token) product
// as 16 lanes; sixteen tokens' lanes are then summed at once by a transposing reduction
// (sum_lanes_of_16), so no dot product ends in a horizontal sum of its own (with 4 query heads a
// K/V head, the sums were most of the work). The V pass holds a head's accumulator in registers
// across a page's tokens. Other shapes take the scalar loops, which the compiler vectorizes along
// the head dimension.
//
// Numbers: float32 accumulation for every element type; the running maximum starts at a large
// finite negative (not -inf, so the arithmetic stays finite under -ffast-math).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr float kNoMax = -1e30f;

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {  // bfloat16: the high half of a float32
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
inline float to_float(_Float16 x) { return static_cast<float>(x); }

inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, uint16_t* out) {  // round to nearest even (finite inputs)
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  *out = static_cast<uint16_t>(bits >> 16);
}
inline void from_float(float x, _Float16* out) { *out = static_cast<_Float16>(x); }

// 16 float32 lanes (GCC/Clang vector extensions: AVX-512 registers where the CPU has them, pairs
// or quads of narrower ones elsewhere).
typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef _Float16 v16h __attribute__((vector_size(32)));

inline v16f load16(const float* p) {
  v16f x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
inline v16f load16(const uint16_t* p) {  // bfloat16: each the high half of a float32
  v16u16 x;
  std::memcpy(&x, p, sizeof x);
  const v16u32 bits = __builtin_convertvector(x, v16u32) << 16;
  v16f out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
inline v16f load16(const _Float16* p) {
  v16h x;
  std::memcpy(&x, p, sizeof x);
  return __builtin_convertvector(x, v16f);
}

// Sixteen vectors in, one out: lane t of the result is the sum of a[t]'s 16 lanes. Four levels,
// each adding the two halves of every block of two vectors at once (15 pairs of two-source
// shuffles and an add in all, against 16 horizontal sums of 4 levels each).
inline v16f sum_lanes_of_16(const v16f* a) {
  v16f r[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // r[i]: a[2i]'s 8 pair sums, then a[2i+1]'s
    r[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // u[i]: 4 tokens, 4 lanes each
    u[i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(r[2 * i], r[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // w[i]: 8 tokens, 2 lanes each
    w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

struct Chunk {
  int64_t session, first_page, end_page;
};

// One page's scores, s[h * B + t] = q_h . K[t, h / G] (q already scaled), for its first `tokens`
// tokens. NC = D / 16 on the vector path (B a multiple of 16), 0 for the scalar loops. The vector
// path scores whole groups of 16 tokens: past `tokens` it reads the page's stale rows (inside the
// pool) into lanes nothing uses.
template <typename T, int NC>
void score_page(const T* kpage, int64_t tokens, const float* qf, int64_t H, int64_t KVH, int64_t D, int64_t B,
                v16f* dots, float* s) {
  const int64_t G = H / KVH, token_stride = KVH * D;
  if constexpr (NC > 0) {
    for (int64_t t0 = 0; t0 < tokens; t0 += 16) {
      for (int64_t t = 0; t < 16; ++t) {
        const T* krow = kpage + (t0 + t) * token_stride;
        for (int64_t g = 0; g < KVH; ++g) {
          v16f kv[NC];
          for (int c = 0; c < NC; ++c) kv[c] = load16(krow + g * D + 16 * c);
          for (int64_t h = g * G; h < (g + 1) * G; ++h) {
            const float* qh = qf + h * D;
            v16f prod = load16(qh) * kv[0];
            for (int c = 1; c < NC; ++c) prod += load16(qh + 16 * c) * kv[c];
            dots[h * 16 + t] = prod;
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        const v16f scores = sum_lanes_of_16(dots + h * 16);
        std::memcpy(s + h * B + t0, &scores, sizeof scores);
      }
    }
  } else {
    for (int64_t t = 0; t < tokens; ++t) {
      const T* krow = kpage + t * token_stride;
      for (int64_t g = 0; g < KVH; ++g) {
        const T* kr = krow + g * D;
        for (int64_t h = g * G; h < (g + 1) * G; ++h) {
          const float* qh = qf + h * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qh[d] * to_float(kr[d]);
          s[h * B + t] = dot;
        }
      }
    }
  }
}

// acc[h] += sum_t w[h * B + t] * V[t, h / G] over the page's first `tokens` tokens.
template <typename T, int NC>
void accumulate_page(const T* vpage, int64_t tokens, const float* w, int64_t H, int64_t KVH, int64_t D, int64_t B,
                     float* acc) {
  const int64_t G = H / KVH, token_stride = KVH * D;
  if constexpr (NC > 0) {
    for (int64_t g = 0; g < KVH; ++g) {
      const T* vg = vpage + g * D;
      for (int64_t h = g * G; h < (g + 1) * G; ++h) {
        float* ah = acc + h * D;
        const float* wh = w + h * B;
        v16f a[NC];
        for (int c = 0; c < NC; ++c) a[c] = load16(ah + 16 * c);
        for (int64_t t = 0; t < tokens; ++t) {
          const T* vr = vg + t * token_stride;
          for (int c = 0; c < NC; ++c) a[c] += wh[t] * load16(vr + 16 * c);
        }
        std::memcpy(ah, a, sizeof a);
      }
    }
  } else {
    for (int64_t t = 0; t < tokens; ++t) {
      const T* vrow = vpage + t * token_stride;
      for (int64_t g = 0; g < KVH; ++g) {
        const T* vr = vrow + g * D;
        for (int64_t h = g * G; h < (g + 1) * G; ++h) {
          float* a = acc + h * D;
          const float wt = w[h * B + t];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += wt * to_float(vr[d]);
        }
      }
    }
  }
}

template <typename T, int NC>
void attend_chunk(const Chunk& c, const T* q, const T* k, const T* v, const int64_t* table, int64_t length,
                  int64_t H, int64_t KVH, int64_t D, int64_t B, float scale, float* part) {
  // part: [H] maxima, [H] sums, [H, D] accumulators of this chunk
  const int64_t page_stride = B * KVH * D;
  float* m = part;
  float* l = part + H;
  float* acc = part + 2 * H;
  std::vector<float> qf(H * D), s(H * B);
  std::vector<v16f> dots(NC > 0 ? H * 16 : 0);  // the vector path's 16 tokens' lanes, per head
  for (int64_t i = 0; i < H * D; ++i) qf[i] = to_float(q[i]) * scale;
  for (int64_t h = 0; h < H; ++h) { m[h] = kNoMax; l[h] = 0.f; }
  std::fill(acc, acc + H * D, 0.f);
  for (int64_t p = c.first_page; p < c.end_page; ++p) {
    const T* kpage = k + table[p] * page_stride;
    const T* vpage = v + table[p] * page_stride;
    const int64_t tokens = std::min(B, length - p * B);
    if (NC > 0 && p + 1 < c.end_page) {  // the next page on its way while this one computes (pages lie anywhere)
      const char* next_k = reinterpret_cast<const char*>(k + table[p + 1] * page_stride);
      const char* next_v = reinterpret_cast<const char*>(v + table[p + 1] * page_stride);
      for (int64_t i = 0; i < page_stride * static_cast<int64_t>(sizeof(T)); i += 64) {
        __builtin_prefetch(next_k + i);
        __builtin_prefetch(next_v + i);
      }
    }
    score_page<T, NC>(kpage, tokens, qf.data(), H, KVH, D, B, dots.data(), s.data());
    for (int64_t h = 0; h < H; ++h) {  // the page's weights, the running max and sum rescaled once
      float* sh = s.data() + h * B;
      float top = m[h];
      for (int64_t t = 0; t < tokens; ++t) top = std::max(top, sh[t]);
      const float rescale = std::exp(m[h] - top);
      float sum = l[h] * rescale;
      for (int64_t t = 0; t < tokens; ++t) {
        sh[t] = std::exp(sh[t] - top);
        sum += sh[t];
      }
      float* a = acc + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] *= rescale;
      m[h] = top;
      l[h] = sum;
    }
    accumulate_page<T, NC>(vpage, tokens, s.data(), H, KVH, D, B, acc);
  }
}

template <typename T>
void paged_decode(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* table_starts,
                  const int64_t* lengths, int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t B, float scale,
                  T* out, int threads, int64_t chunk_pages) {
  std::vector<Chunk> chunks;
  std::vector<int64_t> first_chunk(S + 1);
  for (int64_t i = 0; i < S; ++i) {
    first_chunk[i] = static_cast<int64_t>(chunks.size());
    const int64_t pages = (lengths[i] + B - 1) / B;
    for (int64_t p = 0; p < pages; p += chunk_pages) chunks.push_back({i, p, std::min(pages, p + chunk_pages)});
  }
  first_chunk[S] = static_cast<int64_t>(chunks.size());
  const int64_t n = static_cast<int64_t>(chunks.size()), part_size = H * (D + 2);
  std::vector<float> parts(n * part_size);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t j = 0; j < n; ++j) {
      const Chunk& c = chunks[j];
      const T* qs = q + c.session * H * D;
      const int64_t* table = tables + table_starts[c.session];
      float* part = parts.data() + j * part_size;
      // The vector path for every head layout with pages of a multiple of 16 tokens: plain heads
      // (one query head a K/V head) too, since a paired in-process A/B (the two builds alternated
      // step by step, the 12-layer stack at 32 sessions) measured it 3-17 ms faster a ~220 ms
      // step and even at 1 and 8 sessions (bench/NOTES.md); a served A/B could not tell.
      const bool vector_path = B % 16 == 0;
      if (vector_path && D == 64)
        attend_chunk<T, 4>(c, qs, k, v, table, lengths[c.session], H, KVH, D, B, scale, part);
      else if (vector_path && D == 128)
        attend_chunk<T, 8>(c, qs, k, v, table, lengths[c.session], H, KVH, D, B, scale, part);
      else
        attend_chunk<T, 0>(c, qs, k, v, table, lengths[c.session], H, KVH, D, B, scale, part);
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < S; ++i) {  // merge a session's chunks by their maxima
      std::vector<float> o(D);
      for (int64_t h = 0; h < H; ++h) {
        float top = kNoMax;
        for (int64_t j = first_chunk[i]; j < first_chunk[i + 1]; ++j) top = std::max(top, parts[j * part_size + h]);
        float total = 0.f;
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t j = first_chunk[i]; j < first_chunk[i + 1]; ++j) {
          const float* part = parts.data() + j * part_size;
          const float w = std::exp(part[h] - top);
          total += part[H + h] * w;
          const float* a = part + 2 * H + h * D;
          for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
        }
        T* dst = out + (i * H + h) * D;
        for (int64_t d = 0; d < D; ++d) from_float(o[d] / total, dst + d);
      }
    }
  }
}

}  // namespace

// dtype: 0 float32, 1 bfloat16, 2 float16. q, out [S, H, D]; k, v one layer of the pool
// [num_blocks, B, KVH, D], contiguous; tables: the sessions' block ids concatenated, session i's
// at table_starts[i] .. table_starts[i + 1] - 1; lengths[i]: positions session i attends.
// Returns 0, or -1 when an argument is out of range (nothing is read then).
extern "C" int gangserve_paged_decode(int dtype, const void* q, const void* k, const void* v, const int64_t* tables,
                                      const int64_t* table_starts, const int64_t* lengths, int64_t S, int64_t H,
                                      int64_t KVH, int64_t D, int64_t B, int64_t num_blocks, float scale, void* out,
                                      int threads, int64_t chunk_pages) {
  if (S < 0 || H < 1 || KVH < 1 || H % KVH || D < 1 || B < 1 || threads < 1 || chunk_pages < 1) return -1;
  for (int64_t i = 0; i < S; ++i) {
    const int64_t pages = (lengths[i] + B - 1) / B;
    if (lengths[i] < 1 || table_starts[i + 1] - table_starts[i] < pages) return -1;
    for (int64_t p = 0; p < pages; ++p) {
      const int64_t block = tables[table_starts[i] + p];
      if (block < 0 || block >= num_blocks) return -1;
    }
  }
  switch (dtype) {
    case 0:
      paged_decode(static_cast<const float*>(q), static_cast<const float*>(k), static_cast<const float*>(v), tables,
                   table_starts, lengths, S, H, KVH, D, B, scale, static_cast<float*>(out), threads, chunk_pages);
      return 0;
    case 1:
      paged_decode(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v),
                   tables, table_starts, lengths, S, H, KVH, D, B, scale, static_cast<uint16_t*>(out), threads,
                   chunk_pages);
      return 0;
    case 2:
      paged_decode(static_cast<const _Float16*>(q), static_cast<const _Float16*>(k), static_cast<const _Float16*>(v),
                   tables, table_starts, lengths, S, H, KVH, D, B, scale, static_cast<_Float16*>(out), threads,
                   chunk_pages);
      return 0;
    default:
      return -1;
  }
}
