// y = act(norm(x) W^T + b) for a few rows of x (service.parallel.linear, mode `native`).
//
// Math: y[r, o] = act(b[o] + sum_i n(x)[r, i] W[o, i]), x [R, in], W [out, in] (row-major, torch's
// nn.Linear layout, read where it lies), y [R, out], float32 throughout; act is the identity,
// relu (max(v, 0)) or gelu (v / 2 (1 + erf(v / sqrt 2)), torch's exact F.gelu); n is the
// identity, a layer norm of each row ((x - mean) / sqrt(var + eps) g + beta, var biased) or an
// RMS norm (x / sqrt(mean(x^2) + eps) g), statistics accumulated in double. Then, optionally, each
// head of width d of each output row is rotated (rotary position embedding, transformers'
// apply_rotary_pos_emb): y[i] cos[i] - y[i + d/2] sin[i] and y[i + d/2] cos[i + d/2] + y[i]
// sin[i + d/2], i < d/2, with that row's cos, sin [d].
//
// Why: a decode step multiplies one or two rows by every weight matrix, so it is a pass over the
// weights and nothing else: its time is the weights' bytes over the memory bandwidth. Each output
// row's weights are read once, contiguously, and dotted with the R rows of x (in cache); the
// output rows are split among the threads. Measured against oneDNN's packed matmul over the
// 12-layer E768 stack's 340 MB, 2 threads: 1 row 10.1 against 15.0 ms (33.6 against 22.6 GB/s),
// 2 rows 14.3 against 17.5 ms, 4 rows even; so `linear` sends at most 2 rows here. The activation
// is applied here, to each output while it is in a register: as a torch op after the matmul, the
// MLP's gelu cost ~0.7 ms of a 17 ms one-row step of the 12-layer stack (its code and its input
// cold after the pass over the weights; 10 us a call alone, 37 in the step). So is the norm before
// the matmul (the transformer's layer norms ~0.6 ms of that step, the Llama stack's RMS norms ~0.7
// of its 16 ms), computed here for the R rows before the pass over the weights, and the Llama
// stack's rotary embedding (0.5 ms) after it.
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

enum Activation : int { kIdentity = 0, kRelu = 1, kGelu = 2 };
enum Norm : int { kNoNorm = 0, kLayerNorm = 1, kRmsNorm = 2 };

// rows [R, in] -> out [R, in], each row normalized (g [in]; beta [in] or null: layer norm only).
void normalize(const float* rows, int64_t R, int64_t in, int norm, const float* g, const float* beta, float eps,
               float* out) {
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = rows + r * in;
    float* nr = out + r * in;
    double mean = 0.0, square = 0.0;
    if (norm == kLayerNorm) {
      for (int64_t i = 0; i < in; ++i) mean += xr[i];
      mean /= static_cast<double>(in);
      for (int64_t i = 0; i < in; ++i) square += (xr[i] - mean) * (xr[i] - mean);
    } else {
      for (int64_t i = 0; i < in; ++i) square += static_cast<double>(xr[i]) * xr[i];
    }
    const float m = static_cast<float>(mean);
    const float scale = static_cast<float>(1.0 / std::sqrt(square / static_cast<double>(in) + eps));
    for (int64_t i = 0; i < in; ++i) nr[i] = (xr[i] - m) * scale * g[i] + (beta ? beta[i] : 0.f);
  }
}

inline float activate(float v, int activation) {
  if (activation == kRelu) return v > 0.f ? v : 0.f;
  if (activation == kGelu) return 0.5f * v * (1.f + std::erf(v * 0.70710678118654752f));
  return v;
}

template <int R>
void few_rows(const float* x, const float* w, const float* b, float* y, int64_t in, int64_t out, int threads,
              int activation) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t o = 0; o < out; ++o) {
    const float* wo = w + o * in;
    const float bias = b ? b[o] : 0.f;
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * in;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < in; ++i) dot += wo[i] * xr[i];
      y[r * out + o] = activate(dot + bias, activation);
    }
  }
}

// y [R, out]: each row's heads of width d rotated in place by that row's cos, sin [R, d].
void rotate(float* y, int64_t R, int64_t out, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t r = 0; r < R; ++r) {
    const float* c = cos + r * d;
    const float* s = sin + r * d;
    for (int64_t h = 0; h < out; h += d) {
      float* yh = y + r * out + h;
      for (int64_t i = 0; i < half; ++i) {
        const float a = yh[i], b = yh[i + half];
        yh[i] = a * c[i] - b * s[i];
        yh[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

}  // namespace

// x [rows, in], w [out, in], b [out] or null, y [rows, out]: contiguous float32; activation 0
// (identity), 1 (relu) or 2 (gelu); norm 0 (none), 1 (layer norm: g, beta [in], beta may be null)
// or 2 (RMS norm: g [in]), with eps; rope_dim 0 (no rotation) or the head width d (even, dividing
// out) with rope_cos, rope_sin [rows, d]. Returns 0, or -1 for a row count this kernel does not
// serve (1 or 2), a bad size, an unknown activation or norm, a norm without g, or a rotation that
// does not fit (nothing is written then).
extern "C" int gangserve_few_rows_linear(const float* x, const float* w, const float* b, float* y, int64_t rows,
                                         int64_t in, int64_t out, int threads, int activation, int norm,
                                         const float* g, const float* beta, float eps, const float* rope_cos,
                                         const float* rope_sin, int64_t rope_dim) {
  if (in < 1 || out < 1 || threads < 1 || activation < kIdentity || activation > kGelu || norm < kNoNorm ||
      norm > kRmsNorm || (norm != kNoNorm && g == nullptr) || rows < 1 || rows > 2 || rope_dim < 0 ||
      (rope_dim > 0 && (rope_dim % 2 || out % rope_dim || rope_cos == nullptr || rope_sin == nullptr)))
    return -1;
  std::vector<float> normalized;
  if (norm != kNoNorm) {
    normalized.resize(static_cast<size_t>(rows * in));
    normalize(x, rows, in, norm, g, beta, eps, normalized.data());
    x = normalized.data();
  }
  if (rows == 1)
    few_rows<1>(x, w, b, y, in, out, threads, activation);
  else
    few_rows<2>(x, w, b, y, in, out, threads, activation);
  if (rope_dim > 0) rotate(y, rows, out, rope_cos, rope_sin, rope_dim);
  return 0;
}
