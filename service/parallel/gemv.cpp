// y = x W^T + b for a few rows of x (service.parallel.linear, mode `native`).
//
// Math: y[r, o] = b[o] + sum_i x[r, i] W[o, i], x [R, in], W [out, in] (row-major, torch's
// nn.Linear layout, read where it lies), y [R, out], float32 throughout.
//
// Why: a decode step multiplies one or two rows by every weight matrix, so it is a pass over the
// weights and nothing else: its time is the weights' bytes over the memory bandwidth. Each output
// row's weights are read once, contiguously, and dotted with the R rows of x (in cache); the
// output rows are split among the threads. Measured against oneDNN's packed matmul over the
// 12-layer E768 stack's 340 MB, 2 threads: 1 row 10.1 against 15.0 ms (33.6 against 22.6 GB/s),
// 2 rows 14.3 against 17.5 ms, 4 rows even; so `linear` sends at most 2 rows here.
#include <cstdint>

namespace {

template <int R>
void few_rows(const float* x, const float* w, const float* b, float* y, int64_t in, int64_t out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t o = 0; o < out; ++o) {
    const float* wo = w + o * in;
    const float bias = b ? b[o] : 0.f;
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * in;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < in; ++i) dot += wo[i] * xr[i];
      y[r * out + o] = dot + bias;
    }
  }
}

}  // namespace

// x [rows, in], w [out, in], b [out] or null, y [rows, out]: contiguous float32. Returns 0, or -1
// for a row count this kernel does not serve (1 or 2) or a bad size (nothing is written then).
extern "C" int gangserve_few_rows_linear(const float* x, const float* w, const float* b, float* y, int64_t rows,
                                         int64_t in, int64_t out, int threads) {
  if (in < 1 || out < 1 || threads < 1) return -1;
  switch (rows) {
    case 1:
      few_rows<1>(x, w, b, y, in, out, threads);
      return 0;
    case 2:
      few_rows<2>(x, w, b, y, in, out, threads);
      return 0;
    default:
      return -1;
  }
}
