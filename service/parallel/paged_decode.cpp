// One decode step's attention over a rank's paged KV pool, in place (service.parallel.paged_decode).
//
// Math: for session i of a step, its one query row q_i [H, D] at position len_i - 1 attends
// positions 0 .. len_i - 1 of its session, which lie in the pool at
//     pool[table_i[p / B], p % B, h / G, :]     (G = H / KVH: grouped-query attention)
//     out_i[h] = sum_p softmax_p(scale * q_i[h] . K[p, h / G]) V[p, h / G]
// exactly what the gather path computes after copying the pages out.
//
// How: a session's pages are cut into chunks, and the chunks of every session of the step are
// shared among the threads (OpenMP, torch's own libgomp: the same soname). A chunk reads each
// token's K row once (every K/V head, contiguous) and scores all H query heads on it, keeps a
// running maximum and sum per head (the online softmax, rescaled once per page), then reads each
// token's V row once. The chunks of a session are merged by their maxima at the end. So each byte
// of a session's K/V is read once per step, with no copy: the memory floor's term.
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

struct Chunk {
  int64_t session, first_page, end_page;
};

template <typename T>
void attend_chunk(const Chunk& c, const T* q, const T* k, const T* v, const int64_t* table, int64_t length,
                  int64_t H, int64_t KVH, int64_t D, int64_t B, float scale, float* part) {
  // part: [H] maxima, [H] sums, [H, D] accumulators of this chunk
  const int64_t G = H / KVH, token_stride = KVH * D, page_stride = B * token_stride;
  float* m = part;
  float* l = part + H;
  float* acc = part + 2 * H;
  std::vector<float> qf(H * D), s(H * B);
  for (int64_t i = 0; i < H * D; ++i) qf[i] = to_float(q[i]) * scale;
  for (int64_t h = 0; h < H; ++h) { m[h] = kNoMax; l[h] = 0.f; }
  std::fill(acc, acc + H * D, 0.f);
  for (int64_t p = c.first_page; p < c.end_page; ++p) {
    const T* kpage = k + table[p] * page_stride;
    const T* vpage = v + table[p] * page_stride;
    const int64_t tokens = std::min(B, length - p * B);
    for (int64_t t = 0; t < tokens; ++t) {
      const T* krow = kpage + t * token_stride;
      for (int64_t h = 0; h < H; ++h) {
        const T* kr = krow + (h / G) * D;
        const float* qh = qf.data() + h * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qh[d] * to_float(kr[d]);
        s[h * B + t] = dot;
      }
    }
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
    for (int64_t t = 0; t < tokens; ++t) {
      const T* vrow = vpage + t * token_stride;
      for (int64_t h = 0; h < H; ++h) {
        const T* vr = vrow + (h / G) * D;
        float* a = acc + h * D;
        const float w = s[h * B + t];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += w * to_float(vr[d]);
      }
    }
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
      attend_chunk(c, q + c.session * H * D, k, v, tables + table_starts[c.session], lengths[c.session], H, KVH, D,
                   B, scale, parts.data() + j * part_size);
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
