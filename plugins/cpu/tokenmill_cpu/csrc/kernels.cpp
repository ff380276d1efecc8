// Fused CPU kernels: the small ops of a step, a small-batch GEMV and paged attention.
//
// At batch 1 a decode step of a small model is hundreds of tiny ATen calls: each norm,
// rotary and activation is several kernels and allocations, and paged attention is a
// gather plus SDPA. Each element-wise kernel here does one of those ops in one pass over
// its data, computing in float32 and rounding where the core's reference ops round, so
// outputs match them to within the last bit of the activation dtype. The bf16 paged
// attention serves prefill and decode rows alike, reading the cache in place.
//
// Built on first use by tokenmill_cpu.kernels (torch.utils.cpp_extension, -march=native);
// every entry point has an ATen fallback in tokenmill_cpu.ops.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define TM_HAS_BF16_DOT 1
#else
#define TM_HAS_BF16_DOT 0
#endif

namespace {

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }

// FP8 cache codes (e4m3fn, e5m2) as float32 by a 256-entry table per format, built once
// at load from c10's own conversion: every code is exactly a float, so the table is exact,
// and a lookup is cheaper than c10's bit manipulation per element.
template <typename C>
std::array<float, 256> fp8_table() {
  std::array<float, 256> t{};
  for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(C(static_cast<uint8_t>(i), C::from_bits()));
  return t;
}
const std::array<float, 256> kE4M3Table = fp8_table<c10::Float8_e4m3fn>();
const std::array<float, 256> kE5M2Table = fp8_table<c10::Float8_e5m2>();
inline float to_f(c10::Float8_e4m3fn x) { return kE4M3Table[x.x]; }
inline float to_f(c10::Float8_e5m2 x) { return kE5M2Table[x.x]; }

template <typename C>
constexpr bool kIsFp8 = std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, c10::Float8_e5m2>;

// n cache entries as float32. FP8 with F16C: 8 codes at a time through fp16, exactly
// (e5m2 is fp16's top byte; e4m3fn's exponent and mantissa bits sit in fp16's, with the
// exponent bias 8 lower: times 2^8, subnormals included; its NaN codes stay NaN).
template <typename C>
inline void row_to_f(const C* src, float* dst, int64_t n) {
  int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
  if constexpr (kIsFp8<C>) {
    for (; d + 8 <= n; d += 8) {
      const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d)));
      if constexpr (std::is_same_v<C, c10::Float8_e5m2>) {
        _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_slli_epi16(b, 8)));
      } else {
        const __m128i low = _mm_and_si128(b, _mm_set1_epi16(0x7F));
        const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                       _mm_slli_epi16(low, 7));
        const __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
        const __m256 is_nan = _mm256_castsi256_ps(
            _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(low, _mm_set1_epi16(0x7F))));
        _mm256_storeu_ps(dst + d, _mm256_blendv_ps(f, _mm256_set1_ps(NAN), is_nan));
      }
    }
  }
#endif
  for (; d < n; ++d) dst[d] = to_f(src[d]);
}
template <typename T> inline T from_f(float x) { return static_cast<T>(x); }
// Round through the activation dtype, as an ATen op producing `T` would.
template <typename T> inline float round_to(float x) { return to_f(from_f<T>(x)); }

void check_last_dim_contiguous(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dim");
}

// Vector helpers: 16 channels as float32 from float or bf16 storage, and exp.
#if defined(__AVX512F__)
#define TM_HAS_AVX512 1
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) for 16 floats: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' expf
// polynomial (about 1 ulp), times 2^n by scalef. Inputs below -87.3 (-inf included) give
// ~1e-38, not 0: callers use it for softmax weights, where that is 0 to every sum.
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#else
#define TM_HAS_AVX512 0
#endif

#if TM_HAS_BF16_DOT
// 16 floats rounded to bf16 (nearest even, as c10::BFloat16) and back to float.
inline __m512 round_bf16(__m512 x) {
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
inline void store_bf16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
}
#endif

// ---------------------------------------------------------------------------------------
// RMS norm: y = w * round(x / sqrt(mean(x^2) + eps)); with a residual, x = round(x + r)
// first and that sum is returned too.

template <typename T>
void rms_norm_rows(const T* x, const T* res, const T* w, T* out, T* sum_out, int64_t rows,
                   int64_t hidden, int64_t x_stride, int64_t res_stride, float eps) {
  // rows in parallel past a few dozen (one row is ~2 us: a parallel region costs as much)
  at::parallel_for(0, rows, 32, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(hidden);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * x_stride;
      float ss = 0.f;
      if (res != nullptr) {
        const T* rr = res + r * res_stride;
        T* sr = sum_out + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          T s = from_f<T>(to_f(xr[i]) + to_f(rr[i]));
          sr[i] = s;
          buf[i] = to_f(s);
        }
      } else {
        for (int64_t i = 0; i < hidden; ++i) buf[i] = to_f(xr[i]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < hidden; ++i) ss += buf[i] * buf[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
      T* o = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) o[i] = from_f<T>(to_f(w[i]) * round_to<T>(buf[i] * inv));
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_last_dim_contiguous(x, "x");
  const int64_t hidden = x.size(-1);
  auto x2 = x.reshape({-1, hidden});
  auto out = torch::empty(x2.sizes(), x.options());
  auto wc = w.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x2.data_ptr<scalar_t>(), nullptr, wc.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), nullptr, x2.size(0), hidden,
                            x2.stride(0), 0, static_cast<float>(eps));
  });
  return out.view(x.sizes());
}

std::tuple<torch::Tensor, torch::Tensor> fused_add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                              torch::Tensor w, double eps) {
  check_last_dim_contiguous(x, "x");
  check_last_dim_contiguous(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual must have the same shape and dtype");
  const int64_t hidden = x.size(-1);
  auto x2 = x.reshape({-1, hidden});
  auto r2 = residual.reshape({-1, hidden});
  auto out = torch::empty(x2.sizes(), x.options());
  auto summed = torch::empty(x2.sizes(), x.options());
  auto wc = w.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "fused_add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(x2.data_ptr<scalar_t>(), r2.data_ptr<scalar_t>(),
                            wc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            summed.data_ptr<scalar_t>(), x2.size(0), hidden, x2.stride(0),
                            r2.stride(0), static_cast<float>(eps));
  });
  return {out.view(x.sizes()), summed.view(x.sizes())};
}

// ---------------------------------------------------------------------------------------
// Neox rotary on the first rotary_dim channels of each head, in the activations' dtype as
// transformers computes it: cos/sin rounded to T, each product rounded, then the sum.

template <typename T>
void rotary_heads(const int64_t* positions, const T* src, T* dst, const float* cache,
                  int64_t tokens, int64_t heads, int64_t head_size, int64_t rotary_dim,
                  int64_t src_token_stride, int64_t src_head_stride) {
  const int64_t half = rotary_dim / 2;
  at::parallel_for(0, tokens, 32, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* cos = cache + positions[t] * rotary_dim;
      const float* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* s = src + t * src_token_stride + h * src_head_stride;
        T* d = dst + (t * heads + h) * head_size;
        for (int64_t i = 0; i < half; ++i) {
          const float c = round_to<T>(cos[i]), sn = round_to<T>(sin[i]);
          const float x1 = to_f(s[i]), x2 = to_f(s[i + half]);
          d[i] = from_f<T>(round_to<T>(x1 * c) - round_to<T>(x2 * sn));
          d[i + half] = from_f<T>(round_to<T>(x2 * c) + round_to<T>(x1 * sn));
        }
        for (int64_t i = rotary_dim; i < head_size; ++i) d[i] = s[i];
      }
    }
  });
}

torch::Tensor rotary_one(const torch::Tensor& positions, const torch::Tensor& x,
                         const torch::Tensor& cache) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary input must be [tokens, heads, head_size]"
              " with contiguous head_size");
  auto out = torch::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rotary", [&] {
    rotary_heads<scalar_t>(positions.data_ptr<int64_t>(), x.data_ptr<scalar_t>(),
                           out.data_ptr<scalar_t>(), cache.data_ptr<float>(), x.size(0),
                           x.size(1), x.size(2), cache.size(1), x.stride(0), x.stride(1));
  });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> rotary_embedding(torch::Tensor positions, torch::Tensor query,
                                            torch::Tensor key, torch::Tensor cos_sin_cache) {
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous(),
              "cos_sin_cache must be contiguous float32");
  auto pos = positions.to(at::kLong).contiguous();
  return {rotary_one(pos, query, cos_sin_cache), rotary_one(pos, key, cos_sin_cache)};
}

// ---------------------------------------------------------------------------------------
// silu(gate) * up over [rows, 2d] -> [rows, d]; silu rounded to T as ATen's silu would be.

// The vectorised part of one row: returns how many leading channels it wrote.
template <typename T>
int64_t silu_and_mul_vec(const T* g, const T* u, T* o, int64_t d) {
  int64_t i = 0;
#if TM_HAS_BF16_DOT
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; i + 16 <= d; i += 16) {
      const __m512 gf = load16(g + i);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gf));
      const __m512 s = round_bf16(_mm512_div_ps(gf, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
      store_bf16(o + i, _mm512_mul_ps(s, load16(u + i)));
    }
  }
#endif
  return i;
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  check_last_dim_contiguous(x, "x");
  const int64_t d = x.size(-1) / 2;
  auto x2 = x.reshape({-1, 2 * d});
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = d;
  auto out = torch::empty({x2.size(0), d}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "silu_and_mul", [&] {
    const int64_t rows = x2.size(0), stride = x2.stride(0);
    const scalar_t* src = x2.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* g = src + r * stride;
        const scalar_t* u = g + d;
        scalar_t* o = dst + r * d;
        for (int64_t i = silu_and_mul_vec(g, u, o, d); i < d; ++i) {
          const float gf = to_f(g[i]);
          o[i] = from_f<scalar_t>(round_to<scalar_t>(gf / (1.f + std::exp(-gf))) * to_f(u[i]));
        }
      }
    });
  });
  return out.view(out_sizes);
}

// ---------------------------------------------------------------------------------------
// y[M, N] = x[M, K] @ w[N, K]^T (+ b) in bf16 for small M (decode), float32 accumulation.
// Weights stay in their natural row-major layout and each thread reads its band of rows
// front to back: one sequential stream, which the hardware prefetchers follow best
// (interleaving 16 rows at a time was ~10% slower). Each row serves every x row from L1.

bool has_bf16_dot() { return TM_HAS_BF16_DOT; }

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
#if TM_HAS_BF16_DOT
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "linear_bf16 takes bfloat16 x and w");
  TORCH_CHECK(w.is_contiguous() && w.size(1) % 32 == 0,
              "linear_bf16 needs a contiguous weight with in_features % 32 == 0");
  const int64_t K = w.size(1), N = w.size(0);
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto y = torch::empty({M, N}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x2.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const float* bp = nullptr;
  torch::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    bp = bias_f.data_ptr<float>();
  }
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint16_t* row = wp + n * K;
      for (int64_t m = 0; m < M; ++m) {
        const uint16_t* xr = xp + m * K;
        // two accumulators: the adds of one chain would otherwise wait on each other
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) {
          a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(xr + k),
                                (__m512bh)_mm512_loadu_si512(row + k));
          a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(xr + k + 32),
                                (__m512bh)_mm512_loadu_si512(row + k + 32));
        }
        if (k < K)
          a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(xr + k),
                                (__m512bh)_mm512_loadu_si512(row + k));
        const float v = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + (bp ? bp[n] : 0.f);
        yp[m * N + n] = c10::BFloat16(v).x;
      }
    }
  });
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  return y.view(out_sizes);
#else
  TORCH_CHECK(false, "linear_bf16 needs a CPU with AVX512-BF16");
#endif
}

// ---------------------------------------------------------------------------------------
// Paged attention for decode rows (one query token per sequence), reading keys and values
// straight from the paged cache: no gather, no padding, no mask tensors.
//   query    [T, Hq, D] (token stride free, heads contiguous)
//   kv_cache [2, num_blocks, block_size, Hk, D]
//   block_tables int32 [S, max_blocks]; seq_lens int32 [S] (context incl. the new token)
//   rows     int64 [S]: the query row of each sequence; out [T, Hq, D] written at those rows
// A sequence attends to positions [max(0, seq_len - window), seq_len) (window <= 0: all).
// Softmax in float32 over all of a sequence's scores at once.

// One (sequence, kv head) pair: scores of its G query heads against every visible key,
// softmax, weighted sum of values. `q` holds the G scaled query rows as float32 [G, D];
// `scores` has room for G * n floats, `acc` for G * D.
template <typename T, bool Vec>
void attend_one(const float* q, const T* k_base, const T* v_base, const int32_t* table,
                int64_t first, int64_t len, int64_t block_size, int64_t block_stride,
                int64_t slot_stride, int64_t G, int64_t D, float* scores, float* acc,
                float* kf) {
  const int64_t n = len - first;
  for (int64_t p = first; p < len; ++p) {
    const int64_t at = table[p / block_size] * block_stride + (p % block_size) * slot_stride;
    const T* k = k_base + at;
#if TM_HAS_AVX512
    if constexpr (Vec) {
      __m512 kv[16];  // D <= 256
      const int64_t chunks = D / 16;
      for (int64_t c = 0; c < chunks; ++c) kv[c] = load16(k + 16 * c);
      for (int64_t g = 0; g < G; ++g) {
        __m512 dot = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c)
          dot = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 16 * c), kv[c], dot);
        scores[g * n + (p - first)] = _mm512_reduce_add_ps(dot);
      }
      continue;
    }
#endif
    row_to_f(k, kf, D);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * kf[d];
      scores[g * n + (p - first)] = dot;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sg[j]);
    float total = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      sg[j] = std::exp(sg[j] - mx);
      total += sg[j];
    }
    const float inv = 1.f / total;
    for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
  }
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t p = first; p < len; ++p) {
    const int64_t at = table[p / block_size] * block_stride + (p % block_size) * slot_stride;
    const T* v = v_base + at;
#if TM_HAS_AVX512
    if constexpr (Vec) {
      const int64_t chunks = D / 16;
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512 vv = load16(v + 16 * c);
        for (int64_t g = 0; g < G; ++g) {
          float* a = acc + g * D + 16 * c;
          const __m512 w = _mm512_set1_ps(scores[g * n + (p - first)]);
          _mm512_storeu_ps(a, _mm512_fmadd_ps(w, vv, _mm512_loadu_ps(a)));
        }
      }
      continue;
    }
#endif
    row_to_f(v, kf, D);
    for (int64_t g = 0; g < G; ++g) {
      const float w = scores[g * n + (p - first)];
      float* a = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += w * kf[d];
    }
  }
}

#if TM_HAS_BF16_DOT
// The 16 lanes of each of v[0..15] summed: result lane j = sum of v[j]. A tree of
// in-lane unpacks, shuffles and 128-bit lane shuffles (45 instructions; 16 horizontal
// reductions take about 130).
inline __m512 sum16x16(__m512* v) {
  __m512 t[8], u[4], w[2];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [a02, b02, a13, b13]
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                         _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // per 128-bit lane L: the lane-L sums of 4 vectors
    u[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 2; ++k)
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0b10001000),
                         _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0b11011101));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0b10001000),
                       _mm512_shuffle_f32x4(w[0], w[1], 0b11011101));
}

// Paged attention in bf16 for head sizes 64 and 128, any number of query rows per
// sequence (prefill chunks and decode rows alike), reading keys and values from the cache
// in place. One work item is a block of a sequence's query rows (row r at position
// pos0 + r, seeing [max(0, pos + 1 - window), pos + 1)) times a range of its kv heads and
// their query heads; keys go by in tiles of 16 positions with an online softmax (running
// max and sum per query row and head, rescaled per tile).
//  - Each position's keys (then values) of the item's heads are one contiguous read:
//    walking one head's 128 bytes out of each slot made the prefetchers fetch the other
//    heads' lines too.
//  - q.k in bf16 pairs (vdpbf16ps) into float32, 16 positions at a time, reduced by
//    sum16x16; the scale is applied to the float32 scores.
//  - p.v in bf16 pairs too: the tile's value rows interleaved two positions at a time
//    (once per tile, shared by every row and query head of the item), the softmax
//    weights rounded to bf16 (as PyTorch's flash attention does for bf16), float32
//    accumulation. The interleave permutes channels within each 32-channel chunk (lo/hi
//    halves of 128-bit lanes); the final store puts them back in order.
struct RowBlock {
  const c10::BFloat16* q;  // the block's first query row (heads contiguous)
  c10::BFloat16* out;      // its first output row
  int64_t q_stride, o_stride;
  int64_t rows, pos0;      // number of rows, position of the first
  const int32_t* table;    // the sequence's block table
  int64_t h0, h1;          // kv heads
  // Split keys (a single decode row whose keys are shared out between threads): only keys
  // in [k0, k1) are read, and the unnormalised state goes to the partials buffer at float
  // offset `partial` ([NQ] max, [NQ] sum, [NQ][D] accumulators in channel order) instead
  // of `out`. k1 = 0: not split.
  int64_t k0 = 0, k1 = 0, partial = 0;
};

inline int64_t attend_bf16_work(int64_t rows, int64_t heads, int64_t G, int64_t D) {
  // accumulators, running max and sum, interleaved value tile
  return rows * heads * G * (D + 2) + heads * 8 * D;
}

// Cache offsets of the n positions from p0 of an item's tile (tiles start at multiples of
// n), one block-table lookup per block rather than a division per position; positions
// at or past kend (the item's last key + 1) get 0, the block table may end before them.
inline void tile_offsets(const RowBlock& rb, int64_t p0, int n, int64_t kend, int64_t block_size,
                         int64_t block_stride, int64_t slot_stride, int64_t D, int64_t* at) {
  for (int j = 0; j < n;) {
    const int64_t p = p0 + j, in_block = p % block_size;
    if (p >= kend) {
      std::fill(at + j, at + n, int64_t{0});
      return;
    }
    const int64_t base = rb.table[p / block_size] * block_stride + rb.h0 * D;
    const int m = static_cast<int>(std::min<int64_t>(n - j, block_size - in_block));
    for (int e = 0; e < m; ++e) at[j + e] = base + (in_block + e) * slot_stride;
    j += m;
  }
}

// The next tile's keys and values (at the cache offsets `at`, `lines` 64-byte lines in
// all, key and value lines alternating per position), prefetched a few lines at a time
// through the current tile's work: upto(k) issues the first k.
struct TilePrefetch {
  const c10::BFloat16* k_cache;
  const c10::BFloat16* v_cache;
  const int64_t* at;
  int64_t lines_per_pos, lines, done = 0;

  void upto(int64_t k) {
    for (; done < std::min(k, lines); ++done) {
      const int64_t pos = done / (2 * lines_per_pos), rest = done % (2 * lines_per_pos);
      const c10::BFloat16* base = (rest & 1 ? v_cache : k_cache) + at[pos];
      _mm_prefetch(reinterpret_cast<const char*>(base) + (rest >> 1) * 64, _MM_HINT_T0);
    }
  }
};

// A tile's values for H heads, two positions interleaved per pair (a null position reads
// as 0): pair t of head h at vi[(h * pairs + t) * 2P ...], position by position, every head
// of a position being one contiguous read.
template <int D>
inline void interleave_values(const c10::BFloat16* const* vp, int pairs, int64_t H, __m512i* vi) {
  constexpr int P = D / 32;
  for (int t = 0; t < pairs; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int c = 0; c < P; ++c) {
        const auto* a = vp[2 * t];
        const auto* b = vp[2 * t + 1];
        const __m512i va = a ? _mm512_loadu_si512(a + h * D + 32 * c) : _mm512_setzero_si512();
        const __m512i vb = b ? _mm512_loadu_si512(b + h * D + 32 * c) : _mm512_setzero_si512();
        __m512i* dst = vi + (h * pairs + t) * 2 * P + 2 * c;
        _mm512_store_si512(dst, _mm512_unpacklo_epi16(va, vb));
        _mm512_store_si512(dst + 1, _mm512_unpackhi_epi16(va, vb));
      }
}

// One row and head's D accumulators (lo/hi halves per 32-channel chunk, as p.v leaves
// them: lo lane 4L + w holds channel 8L + w of its chunk, hi lane 4L + w channel 8L + 4 + w)
// times `inv`, in channel order as bf16.
template <int D>
inline void store_head_bf16(const float* acc, __m512 inv, c10::BFloat16* o) {
  alignas(64) static const int32_t kOrder[2][16] = {
      {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23},
      {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31}};
  const __m512i order0 = _mm512_load_si512(kOrder[0]), order1 = _mm512_load_si512(kOrder[1]);
  for (int c = 0; c < D / 32; ++c) {
    const __m512 lo = _mm512_load_ps(acc + 32 * c);
    const __m512 hi = _mm512_load_ps(acc + 32 * c + 16);
    store_bf16(o + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(lo, order0, hi), inv));
    store_bf16(o + 32 * c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, order1, hi), inv));
  }
}

template <int D>
void attend_bf16(const RowBlock& rb, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                 int64_t window, int64_t block_size, int64_t block_stride, int64_t slot_stride,
                 int64_t G, float scale, float* work, float* partials) {
  constexpr int P = D / 32;  // 32-channel chunks per head row
  const int64_t H = rb.h1 - rb.h0, NQ = H * G, R = rb.rows;
  // [H][8 pairs][2P] vectors of interleaved bf16 values (64-byte aligned: first in work)
  __m512i* vi = reinterpret_cast<__m512i*>(work);
  float* acc = work + H * 8 * D;  // [R][NQ][2P][16]: lo/hi halves per chunk
  float* mx = acc + R * NQ * D;   // [R][NQ] running max
  float* sum = mx + R * NQ;       // [R][NQ] running sum
  std::fill(acc, acc + R * NQ * D, 0.f);
  std::fill(mx, mx + R * NQ, -INFINITY);
  std::fill(sum, sum + R * NQ, 0.f);
  auto first_of = [&](int64_t pos) { return window > 0 ? std::max<int64_t>(0, pos + 1 - window) : 0; };
  int64_t kstart = first_of(rb.pos0), kend = rb.pos0 + R;
  if (rb.k1 > 0) {
    kstart = std::max(kstart, rb.k0);
    kend = std::min(kend, rb.k1);
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  const c10::BFloat16* kp[16];
  const c10::BFloat16* vp[16];
  const int64_t row_bytes = H * D * 2;  // one position's keys (or values) of the item
  auto offsets = [&](int64_t p0, int64_t* at) {
    tile_offsets(rb, p0, 16, kend, block_size, block_stride, slot_stride, D, at);
  };
  int64_t at[16], next_at[16];
  for (int64_t p0 = kstart & ~int64_t{15}; p0 < kend; p0 += 16) {
    offsets(p0, at);
    for (int j = 0; j < 16; ++j) {
      const int64_t p = p0 + j;
      const bool inside = p >= kstart && p < kend;
      kp[j] = inside ? k_cache + at[j] : nullptr;
      vp[j] = inside ? v_cache + at[j] : nullptr;
    }
    // Prefetch this tile's keys: the q.k loop reads them head by head, a strided walk the
    // hardware prefetchers follow poorly.
    for (int j = 0; j < 16; ++j)
      if (kp[j])
        for (int64_t b = 0; b < row_bytes; b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(kp[j]) + b, _MM_HINT_T0);
    // The next tile's keys and values, a few lines at a time through this tile's work
    // (blocks sit anywhere in the pool, so the hardware prefetchers lose the stream at
    // each block; issued all at once, the prefetches overflow the miss queues): decode
    // at b=64, ctx 1000 went from ~14 to ~18.6 GB/s.
    int next_n = 0;
    if (p0 + 16 < kend) {
      offsets(p0 + 16, next_at);
      next_n = static_cast<int>(std::min<int64_t>(16, kend - p0 - 16));
    }
    const int64_t lines_per_pos = row_bytes / 64;
    const int64_t next_lines = next_n * lines_per_pos * 2;
    TilePrefetch prefetch{k_cache, v_cache, next_at, lines_per_pos, next_lines};
    interleave_values<D>(vp, 8, H, vi);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t pos = rb.pos0 + r;
      const int64_t lo = std::max({first_of(pos), kstart, p0}) - p0;
      const int64_t hi = std::min({pos + 1, kend, p0 + 16}) - p0;
      if (lo >= hi) continue;
      const __mmask16 live = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
      const c10::BFloat16* qr = rb.q + r * rb.q_stride + rb.h0 * G * D;
      for (int64_t i = 0; i < NQ; ++i) {
        prefetch.upto((r * NQ + i + 1) * next_lines / (R * NQ));
        const int64_t h = i / G, ri = r * NQ + i;
        __m512bh qv[P];
        for (int c = 0; c < P; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qr + i * D + 32 * c);
        __m512 dots[16];
        for (int j = 0; j < 16; ++j) {
          dots[j] = _mm512_setzero_ps();
          if (j >= lo && j < hi)
            for (int c = 0; c < P; ++c)
              dots[j] = _mm512_dpbf16_ps(
                  dots[j], qv[c], (__m512bh)_mm512_loadu_si512(kp[j] + h * D + 32 * c));
        }
        const __m512 sv = _mm512_mul_ps(sum16x16(dots), vscale);
        const float m_new = std::max(mx[ri], _mm512_mask_reduce_max_ps(live, sv));
        // lane 0: the old max's rescale, 0 on the first tile (max = -inf); lanes: weights
        const __m512 m_vec = _mm512_set1_ps(m_new);
        const __m512 valpha = _mm512_permutexvar_ps(
            _mm512_setzero_si512(), exp512(_mm512_sub_ps(_mm512_set1_ps(mx[ri]), m_vec)));
        const __m512 pv = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(sv, m_vec)));
        sum[ri] = sum[ri] * _mm512_cvtss_f32(valpha) + _mm512_reduce_add_ps(pv);
        mx[ri] = m_new;
        // the weights as bf16 pairs (positions 2t, 2t + 1 in 32-bit lane t)
        const __m512i pairs =
            _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(pv));
        float* ai = acc + ri * D;
        __m512 a[2 * P];
        for (int c = 0; c < 2 * P; ++c) a[c] = _mm512_mul_ps(_mm512_load_ps(ai + 16 * c), valpha);
        const __m512i* vh = vi + h * 8 * 2 * P;
        for (int64_t t = lo / 2; 2 * t < hi; ++t) {
          const __m512bh w =
              (__m512bh)_mm512_permutexvar_epi32(_mm512_set1_epi32(static_cast<int>(t)), pairs);
          for (int c = 0; c < 2 * P; ++c)
            a[c] = _mm512_dpbf16_ps(a[c], w, (__m512bh)_mm512_load_si512(vh + t * 2 * P + c));
        }
        for (int c = 0; c < 2 * P; ++c) _mm512_store_ps(ai + 16 * c, a[c]);
      }
    }
  }
  // lo lane 4L + w holds channel 8L + w of its chunk, hi lane 4L + w channel 8L + 4 + w
  alignas(64) static const int32_t kOrder[2][16] = {
      {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23},
      {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31}};
  const __m512i order0 = _mm512_load_si512(kOrder[0]), order1 = _mm512_load_si512(kOrder[1]);
  if (rb.k1 > 0) {  // one row: its unnormalised state, channels in order
    float* pm = partials + rb.partial;
    for (int64_t i = 0; i < NQ; ++i) {
      pm[i] = mx[i];
      pm[NQ + i] = sum[i];
      float* pa = pm + 2 * NQ + i * D;
      for (int c = 0; c < P; ++c) {
        const __m512 lo = _mm512_load_ps(acc + i * D + 32 * c);
        const __m512 hi = _mm512_load_ps(acc + i * D + 32 * c + 16);
        _mm512_storeu_ps(pa + 32 * c, _mm512_permutex2var_ps(lo, order0, hi));
        _mm512_storeu_ps(pa + 32 * c + 16, _mm512_permutex2var_ps(lo, order1, hi));
      }
    }
    return;
  }
  for (int64_t r = 0; r < R; ++r) {
    c10::BFloat16* o = rb.out + r * rb.o_stride + rb.h0 * G * D;
    for (int64_t i = 0; i < NQ; ++i) {
      const int64_t ri = r * NQ + i;
      store_head_bf16<D>(acc + ri * D, _mm512_set1_ps(1.f / sum[ri]), o + i * D);
    }
  }
}
#endif

// The G heads' float32 results into the output row, in T.
template <typename T>
inline void write_heads(T* op, const float* acc, int64_t row, int64_t o_stride, int64_t h,
                            int64_t G, int64_t D) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) op[row * o_stride + (h * G + g) * D + d] = from_f<T>(acc[g * D + d]);
}

// T: the query's and output's dtype; C: the cache's (T itself, or an FP8 format, then
// k_scale / v_scale are float32 [Hk]: a cache entry reads as stored * scale of its kv head).
// The key scale is folded into the scaled query and the value scale into the output, so
// the FP8 codes are read in place with no dequantized copy.
template <typename T, typename C>
void decode_attention_impl(const torch::Tensor& query, const torch::Tensor& kv_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                           const torch::Tensor& rows, int64_t window, float scale,
                           const float* k_scale, const float* v_scale, torch::Tensor& out) {
  const int64_t S = rows.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t Hk = kv_cache.size(3), block_size = kv_cache.size(2);
  const int64_t G = Hq / Hk;
  const int64_t q_stride = query.stride(0), o_stride = out.stride(0);
  const int64_t kv_half = kv_cache.stride(0), block_stride = kv_cache.stride(1);
  const int64_t slot_stride = kv_cache.stride(2);
  const int64_t table_stride = block_tables.stride(0);
  const T* qp = query.data_ptr<T>();
  const C* cache = reinterpret_cast<const C*>(kv_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const bool vec = TM_HAS_AVX512 && D % 16 == 0 && D <= 256;
  at::parallel_for(0, S * Hk, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> q(G * D), acc(G * D), kf(D), scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / Hk, h = i % Hk;
      const int64_t len = lens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t row = row_ids[s];
      const float q_scale = k_scale != nullptr ? scale * k_scale[h] : scale;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          q[g * D + d] = to_f(qp[row * q_stride + (h * G + g) * D + d]) * q_scale;
      scores.resize(G * (len - first));
      const int32_t* table = tables + s * table_stride;
      const C* k_base = cache + h * D;
      const C* v_base = cache + kv_half + h * D;
      constexpr bool kVecType = std::is_same_v<C, float> || std::is_same_v<C, c10::BFloat16>;
      bool done = false;
      if constexpr (kVecType) {
        if (vec) {
          attend_one<C, true>(q.data(), k_base, v_base, table, first, len, block_size,
                              block_stride, slot_stride, G, D, scores.data(), acc.data(),
                              kf.data());
          done = true;
        }
      }
      if (!done)
        attend_one<C, false>(q.data(), k_base, v_base, table, first, len, block_size,
                             block_stride, slot_stride, G, D, scores.data(), acc.data(),
                             kf.data());
      if (v_scale != nullptr)
        for (int64_t j = 0; j < G * D; ++j) acc[j] *= v_scale[h];
      write_heads(op, acc.data(), row, o_stride, h, G, D);
    }
  });
}

void check_decode_args(const torch::Tensor& query, const torch::Tensor& kv_cache,
                       const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                       const torch::Tensor& rows, const torch::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [tokens, heads, head_size] with contiguous heads");
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "out must be [tokens, heads, head_size] with contiguous heads");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.stride(4) == 1 && kv_cache.stride(3) == kv_cache.size(4),
              "kv_cache must be [2, blocks, block_size, kv_heads, head_size], heads contiguous");
  TORCH_CHECK(query.scalar_type() == out.scalar_type(), "query and out must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  rows.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int32, rows int64");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "query heads must be a multiple of kv heads");
}

void decode_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                      torch::Tensor seq_lens, torch::Tensor rows, int64_t window, double scale,
                      torch::Tensor out) {
  check_decode_args(query, kv_cache, block_tables, seq_lens, rows, out);
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(),
              "query, out and kv_cache must share a dtype");
  auto tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto rws = rows.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, query.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t, scalar_t>(query, kv_cache, tables, lens, rws, window,
                                              static_cast<float>(scale), nullptr, nullptr, out);
  });
}

// decode_attention over an FP8 cache (float8_e4m3fn or float8_e5m2) read in place:
// query / out float32 or bfloat16, k_scale / v_scale float32 [kv_heads] (per-layer scales
// are one value repeated). Each row may be a prefill row too: `rows` and `seq_lens` then
// list every query row with its own causal length.
void decode_attention_fp8(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                          torch::Tensor seq_lens, torch::Tensor rows, int64_t window,
                          double scale, torch::Tensor k_scale, torch::Tensor v_scale,
                          torch::Tensor out) {
  check_decode_args(query, kv_cache, block_tables, seq_lens, rows, out);
  const auto cache_type = kv_cache.scalar_type();
  TORCH_CHECK(cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2,
              "decode_attention_fp8 takes a float8_e4m3fn or float8_e5m2 cache, not ", cache_type);
  const int64_t Hk = kv_cache.size(3);
  for (const auto* t : {&k_scale, &v_scale})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == Hk,
                "k_scale / v_scale must be float32 with one value per kv head (", Hk, "), not ",
                t->scalar_type(), " of ", t->numel());
  auto ks = k_scale.contiguous(), vs = v_scale.contiguous();
  auto tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto rws = rows.contiguous();
  const float* ksp = ks.data_ptr<float>();
  const float* vsp = vs.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, query.scalar_type(), "decode_attention_fp8", [&] {
    if (cache_type == at::kFloat8_e4m3fn)
      decode_attention_impl<scalar_t, c10::Float8_e4m3fn>(query, kv_cache, tables, lens, rws,
                                                          window, sc, ksp, vsp, out);
    else
      decode_attention_impl<scalar_t, c10::Float8_e5m2>(query, kv_cache, tables, lens, rws,
                                                        window, sc, ksp, vsp, out);
  });
}

#if TM_HAS_BF16_DOT
// Work items of at least this many query rows (prefill chunks) go to attend_rows_bf16;
// fewer (decode rows) to attend_bf16.
constexpr int64_t kRowsMinRows = 4;

inline int64_t attend_rows_bf16_work(int64_t rows, int64_t heads, int64_t G, int64_t D) {
  // accumulators, running max, running sums (16 lanes), interleaved values, transposed keys
  return rows * heads * G * (D + 1 + 16) + 2 * heads * 16 * D;
}

// attend_bf16 for many query rows (prefill chunks): the same flash-style walk, retuned for
// rows that share every tile. Tiles are 32 positions. Each tile's keys are transposed once
// (32-bit word c of lane j: channel pair c of position j), so that a row's 32 scores are
// D / 2 dot-product steps against its broadcast channel pairs with no reduction across
// lanes; U rows go together, their accumulators in registers, so the dot-product chains
// overlap. Running sums stay 16-lane vectors until the end, and one exp serves the U
// rows' rescales. No key splitting (items of one decode row go to attend_bf16).
template <int D>
void attend_rows_bf16(const RowBlock& rb, const c10::BFloat16* k_cache,
                      const c10::BFloat16* v_cache, int64_t window, int64_t block_size,
                      int64_t block_stride, int64_t slot_stride, int64_t G, float scale,
                      float* work) {
  constexpr int P = D / 32;            // 32-channel chunks per head row
  constexpr int U = D == 64 ? 4 : 2;   // rows per group
  constexpr int TP = 32;               // positions per tile
  const int64_t H = rb.h1 - rb.h0, NQ = H * G, R = rb.rows;
  // [H][16 pairs][2P] vectors of interleaved bf16 values (64-byte aligned: first in work)
  __m512i* vi = reinterpret_cast<__m512i*>(work);
  // [H][D / 2][32] words: the key tile transposed
  uint32_t* kt = reinterpret_cast<uint32_t*>(work + H * 16 * D);
  float* acc = work + 2 * H * 16 * D;  // [R][NQ][2P][16]: lo/hi halves per chunk
  float* sums = acc + R * NQ * D;      // [R][NQ][16] running sums by lane
  float* mx = sums + R * NQ * 16;      // [R][NQ] running max
  std::fill(acc, acc + R * NQ * (D + 16), 0.f);
  std::fill(mx, mx + R * NQ, -INFINITY);
  auto first_of = [&](int64_t pos) { return window > 0 ? std::max<int64_t>(0, pos + 1 - window) : 0; };
  const int64_t kstart = first_of(rb.pos0), kend = rb.pos0 + R;
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t row_bytes = H * D * 2;  // one position's keys (or values) of the item
  const int64_t lines_per_pos = row_bytes / 64;
  auto offsets = [&](int64_t p0, int64_t* at) {
    tile_offsets(rb, p0, TP, kend, block_size, block_stride, slot_stride, D, at);
  };
  const c10::BFloat16* kp[TP];
  const c10::BFloat16* vp[TP];
  int64_t at[TP], next_at[TP];
  alignas(64) float scratch[2 * P * 16] = {};  // accumulators of rows past the end
  for (int64_t p0 = kstart & ~int64_t{TP - 1}; p0 < kend; p0 += TP) {
    offsets(p0, at);
    for (int j = 0; j < TP; ++j) {
      const int64_t p = p0 + j;
      const bool inside = p >= kstart && p < kend;
      kp[j] = inside ? k_cache + at[j] : nullptr;
      vp[j] = inside ? v_cache + at[j] : nullptr;
    }
    // the next tile's keys and values, a few lines at a time through this tile's rows
    int next_n = 0;
    if (p0 + TP < kend) {
      offsets(p0 + TP, next_at);
      next_n = static_cast<int>(std::min<int64_t>(TP, kend - p0 - TP));
    }
    const int64_t next_lines = next_n * lines_per_pos * 2;
    TilePrefetch prefetch{k_cache, v_cache, next_at, lines_per_pos, next_lines};
    interleave_values<D>(vp, TP / 2, H, vi);
    // keys transposed (0 outside the item)
    for (int64_t h = 0; h < H; ++h) {
      uint32_t* kth = kt + h * (D / 2) * TP;
      for (int j = 0; j < TP; ++j) {
        if (kp[j] == nullptr) {
          for (int c = 0; c < D / 2; ++c) kth[c * TP + j] = 0u;
          continue;
        }
        const uint32_t* src = reinterpret_cast<const uint32_t*>(kp[j] + h * D);
        for (int c = 0; c < D / 2; ++c) kth[c * TP + j] = src[c];
      }
    }
    for (int64_t i = 0; i < NQ; ++i) {
      prefetch.upto((i + 1) * next_lines / NQ);
      const int64_t h = i / G;
      const uint32_t* kth = kt + h * (D / 2) * TP;
      const __m512i* vh = vi + h * 16 * 2 * P;
      for (int64_t r0 = 0; r0 < R; r0 += U) {
        const int64_t n = std::min<int64_t>(U, R - r0);
        const uint32_t* qw[U];  // rows past the end repeat the last (never stored)
        for (int u = 0; u < U; ++u)
          qw[u] = reinterpret_cast<const uint32_t*>(
              rb.q + std::min<int64_t>(r0 + u, R - 1) * rb.q_stride + (rb.h0 * G + i) * D);
        __m512 s0[U], s1[U];  // scores of positions 0-15 and 16-31
        for (int u = 0; u < U; ++u) s0[u] = s1[u] = _mm512_setzero_ps();
        for (int c = 0; c < D / 2; ++c) {
          const __m512bh k0 = (__m512bh)_mm512_load_si512(kth + c * TP);
          const __m512bh k1 = (__m512bh)_mm512_load_si512(kth + c * TP + 16);
          for (int u = 0; u < U; ++u) {
            const __m512bh qc = (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[u][c]));
            s0[u] = _mm512_dpbf16_ps(s0[u], qc, k0);
            s1[u] = _mm512_dpbf16_ps(s1[u], qc, k1);
          }
        }
        // online softmax: new maxima, then one exp for the U rows' rescales
        alignas(64) float m_old[16], m_new[16];
        __mmask16 live0[U], live1[U];
        bool seen[U];
        int64_t t0 = TP / 2, t1 = 0;  // value pairs any row of the group weighs
        for (int u = 0; u < 16; ++u) m_old[u] = m_new[u] = 0.f;
        for (int u = 0; u < U; ++u) {
          seen[u] = false;
          if (u >= n) continue;
          const int64_t pos = rb.pos0 + r0 + u;
          const int64_t lo = std::max({first_of(pos), kstart, p0}) - p0;
          const int64_t hi = std::min({pos + 1, kend, p0 + TP}) - p0;
          if (lo >= hi) continue;
          seen[u] = true;
          const uint32_t live = static_cast<uint32_t>(
              ((hi == TP ? ~uint64_t{0} : (uint64_t{1} << hi) - 1) & ~((uint64_t{1} << lo) - 1)));
          live0[u] = static_cast<__mmask16>(live & 0xffff);
          live1[u] = static_cast<__mmask16>(live >> 16);
          s0[u] = _mm512_mul_ps(s0[u], vscale);
          s1[u] = _mm512_mul_ps(s1[u], vscale);
          const __m512 neg = _mm512_set1_ps(-INFINITY);
          const __m512 both = _mm512_max_ps(_mm512_mask_mov_ps(neg, live0[u], s0[u]),
                                            _mm512_mask_mov_ps(neg, live1[u], s1[u]));
          const float* m = mx + (r0 + u) * NQ + i;
          m_old[u] = *m;
          m_new[u] = std::max(*m, _mm512_reduce_max_ps(both));
          t0 = std::min(t0, lo / 2);
          t1 = std::max(t1, (hi + 1) / 2);
        }
        // 0 on a row's first tile (old max -inf); lanes of unseen rows give exp(0) = 1
        alignas(64) float alpha[16];
        _mm512_store_ps(alpha, exp512(_mm512_sub_ps(_mm512_load_ps(m_old), _mm512_load_ps(m_new))));
        __m512i pairs[U];  // the weights as bf16 pairs (positions 2t, 2t + 1 in word t)
        for (int u = 0; u < U; ++u) {
          pairs[u] = _mm512_setzero_si512();
          if (!seen[u]) continue;
          const int64_t ri = (r0 + u) * NQ + i;
          const __m512 m_vec = _mm512_set1_ps(m_new[u]);
          const __m512 p0v = _mm512_maskz_mov_ps(live0[u], exp512(_mm512_sub_ps(s0[u], m_vec)));
          const __m512 p1v = _mm512_maskz_mov_ps(live1[u], exp512(_mm512_sub_ps(s1[u], m_vec)));
          float* sv = sums + ri * 16;
          _mm512_store_ps(sv, _mm512_add_ps(_mm512_mul_ps(_mm512_load_ps(sv), _mm512_set1_ps(alpha[u])),
                                            _mm512_add_ps(p0v, p1v)));
          mx[ri] = m_new[u];
          pairs[u] = (__m512i)_mm512_cvtne2ps_pbh(p1v, p0v);
        }
        // p.v of the group's rows together: U * 2P independent accumulator chains (rows
        // past the end accumulate into scratch, so the loops need no branches)
        float* ap[U];
        for (int u = 0; u < U; ++u)
          ap[u] = u < n ? acc + ((r0 + u) * NQ + i) * D : scratch;
        __m512 a[U][2 * P];
        for (int u = 0; u < U; ++u) {
          const __m512 va = _mm512_set1_ps(seen[u] ? alpha[u] : 1.f);
          for (int c = 0; c < 2 * P; ++c) a[u][c] = _mm512_mul_ps(_mm512_load_ps(ap[u] + 16 * c), va);
        }
        for (int64_t t = t0; t < t1; ++t) {
          const __m512i sel = _mm512_set1_epi32(static_cast<int>(t));
          __m512bh v[2 * P];
          for (int c = 0; c < 2 * P; ++c) v[c] = (__m512bh)_mm512_load_si512(vh + t * 2 * P + c);
          for (int u = 0; u < U; ++u) {
            const __m512bh w = (__m512bh)_mm512_permutexvar_epi32(sel, pairs[u]);
            for (int c = 0; c < 2 * P; ++c) a[u][c] = _mm512_dpbf16_ps(a[u][c], w, v[c]);
          }
        }
        for (int u = 0; u < U; ++u)
          for (int c = 0; c < 2 * P; ++c) _mm512_store_ps(ap[u] + 16 * c, a[u][c]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    c10::BFloat16* o = rb.out + r * rb.o_stride + rb.h0 * G * D;
    for (int64_t i = 0; i < NQ; ++i) {
      const int64_t ri = r * NQ + i;
      const float total = _mm512_reduce_add_ps(_mm512_load_ps(sums + ri * 16));
      store_head_bf16<D>(acc + ri * D, _mm512_set1_ps(1.f / total), o + i * D);
    }
  }
}

// Every sequence of a step through attend_bf16: query/out [T, Hq, D] bf16 (token stride
// free, heads contiguous), kv_cache [2, blocks, block_size, Hk, D], block_tables int32
// [S, max_blocks], seq_lens int32 [S] (context incl. the step's tokens), query_start_loc
// int32 [S + 1]. Work items are blocks of up to 32 query rows times all kv heads when there
// are enough of them to feed every thread four times over, else times one kv head; they
// are dealt to the threads longest first (causal prefill rows cost more the later they
// sit, and at::parallel_for would split an ordered list unevenly).
void paged_attention_bf16(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                          torch::Tensor seq_lens, torch::Tensor query_start_loc, int64_t window,
                          double scale, torch::Tensor out) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [tokens, heads, head_size] with contiguous heads");
  TORCH_CHECK(out.dim() == 3 && out.stride(2) == 1 && out.stride(1) == out.size(2) &&
                  out.sizes() == query.sizes(),
              "out must be query's shape with contiguous heads");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.stride(4) == 1 && kv_cache.stride(3) == kv_cache.size(4),
              "kv_cache must be [2, blocks, block_size, kv_heads, head_size], heads contiguous");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && kv_cache.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "paged_attention_bf16 takes bfloat16 query, cache and out");
  const int64_t D = query.size(2), Hk = kv_cache.size(3), Hq = query.size(1);
  TORCH_CHECK(D == 64 || D == 128, "paged_attention_bf16 supports head sizes 64 and 128, not ", D);
  TORCH_CHECK(Hq % Hk == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block_tables, seq_lens and query_start_loc must be int32");
  auto tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  auto lens_t = seq_lens.contiguous();
  auto starts_t = query_start_loc.contiguous();
  const int64_t S = lens_t.size(0), G = Hq / Hk;
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  const int32_t* starts = starts_t.data_ptr<int32_t>();
  const auto* qp = reinterpret_cast<const c10::BFloat16*>(query.data_ptr());
  auto* op = reinterpret_cast<c10::BFloat16*>(out.data_ptr());
  const auto* cache = reinterpret_cast<const c10::BFloat16*>(kv_cache.data_ptr());
  constexpr int64_t kRows = 32;
  const int64_t threads = at::get_num_threads();
  int64_t num_blocks = 0;
  for (int64_t s = 0; s < S; ++s) num_blocks += (starts[s + 1] - starts[s] + kRows - 1) / kRows;
  const int64_t H = num_blocks >= 4 * threads ? Hk : 1;
  // Few items (a handful of decodes, batch 1 above all) cannot feed every thread: a
  // decode row with a long context is split by keys into `splits` parts, each read by one
  // item, and the parts are merged after (flash-decoding). kMinSplitKeys keeps each part
  // long enough to be worth its merge.
  constexpr int64_t kMinSplitKeys = 128;
  const int64_t splits = num_blocks >= 2 * threads ? 1 : 2 * threads;
  std::vector<RowBlock> items;
  std::vector<int64_t> cost;
  struct Merge {
    c10::BFloat16* out;  // the row's output, at the item's first query head
    int64_t first_item, parts, heads;
  };
  std::vector<Merge> merges;
  int64_t partial_floats = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s], len = lens[s];
    TORCH_CHECK(q_len <= len, "sequence ", s, " has more new tokens than context");
    for (int64_t r0 = 0; r0 < q_len; r0 += kRows) {
      const int64_t rows = std::min(kRows, q_len - r0), pos0 = len - q_len + r0;
      const int64_t first = window > 0 ? std::max<int64_t>(0, pos0 + 1 - window) : 0;
      const int64_t keys = pos0 + rows - first;  // the block's visible keys
      const int64_t parts =
          rows == 1 ? std::min(splits, std::max<int64_t>(1, keys / kMinSplitKeys)) : 1;
      // a split row's parts take every kv head: one contiguous read per position
      const int64_t heads = parts > 1 ? Hk : H;
      for (int64_t h0 = 0; h0 < Hk; h0 += heads) {
        const RowBlock rb{qp + (starts[s] + r0) * query.stride(0),
                          op + (starts[s] + r0) * out.stride(0),
                          query.stride(0), out.stride(0), rows, pos0,
                          tables.data_ptr<int32_t>() + s * tables.stride(0), h0, h0 + heads};
        if (parts == 1) {
          items.push_back(rb);
          cost.push_back(rows * keys * heads + 64);
          continue;
        }
        merges.push_back({rb.out + h0 * G * D, static_cast<int64_t>(items.size()), parts, heads * G});
        const int64_t per = (keys + parts - 1) / parts;
        for (int64_t part = 0; part < parts; ++part) {
          RowBlock piece = rb;
          piece.k0 = first + part * per;
          piece.k1 = std::min(pos0 + 1, piece.k0 + per);
          piece.partial = partial_floats;
          partial_floats += heads * G * (D + 2);
          items.push_back(piece);
          cost.push_back(per * heads + 64);
        }
      }
    }
  }
  std::vector<float> partials(partial_floats);
  std::vector<int64_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::vector<std::vector<int64_t>> bins(threads);
  std::vector<int64_t> load(threads, 0);
  for (const int64_t i : order) {
    const int64_t b = std::min_element(load.begin(), load.end()) - load.begin();
    bins[b].push_back(i);
    load[b] += cost[i];
  }
  const int64_t block_size = kv_cache.size(2), block_stride = kv_cache.stride(1);
  const int64_t slot_stride = kv_cache.stride(2), kv_half = kv_cache.stride(0);
  auto run = D == 64 ? attend_bf16<64> : attend_bf16<128>;
  auto run_rows = D == 64 ? attend_rows_bf16<64> : attend_rows_bf16<128>;
  at::parallel_for(0, threads, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> work(std::max(attend_bf16_work(kRows, Hk, G, D),
                                     attend_rows_bf16_work(kRows, Hk, G, D)) + 16);
    float* w = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(work.data()) + 63) & ~uintptr_t{63});
    for (int64_t b = b0; b < b1; ++b)
      for (const int64_t i : bins[b]) {
        if (items[i].rows >= kRowsMinRows)
          run_rows(items[i], cache, cache + kv_half, window, block_size, block_stride,
                   slot_stride, G, static_cast<float>(scale), w);
        else
          run(items[i], cache, cache + kv_half, window, block_size, block_stride, slot_stride, G,
              static_cast<float>(scale), w, partials.data());
      }
  });
  // Split rows: out = sum_p acc_p e^(m_p - m) / sum_p l_p e^(m_p - m), m = max_p m_p.
  for (const Merge& mg : merges) {
    const int64_t NQ = mg.heads;
    for (int64_t i = 0; i < NQ; ++i) {
      float m = -INFINITY;
      for (int64_t part = 0; part < mg.parts; ++part)
        m = std::max(m, partials[items[mg.first_item + part].partial + i]);
      float l = 0.f;
      __m512 a[8];  // D <= 128
      for (int64_t c = 0; c < D / 16; ++c) a[c] = _mm512_setzero_ps();
      for (int64_t part = 0; part < mg.parts; ++part) {
        const float* pm = partials.data() + items[mg.first_item + part].partial;
        if (pm[NQ + i] == 0.f) continue;  // a part with no visible key
        const float f = std::exp(pm[i] - m);
        l += pm[NQ + i] * f;
        const __m512 vf = _mm512_set1_ps(f);
        for (int64_t c = 0; c < D / 16; ++c)
          a[c] = _mm512_fmadd_ps(_mm512_loadu_ps(pm + 2 * NQ + i * D + 16 * c), vf, a[c]);
      }
      const __m512 inv = _mm512_set1_ps(1.f / l);
      for (int64_t c = 0; c < D / 16; ++c)
        store_bf16(mg.out + i * D + 16 * c, _mm512_mul_ps(a[c], inv));
    }
  }
}
#endif

// ---------------------------------------------------------------------------------------
// The step's keys and values into their cache slots (the core's write_kv in one call):
// key/value [T, Hk, D] (token stride free, heads contiguous), slot_mapping int64 [T].

void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() &&
                  value.scalar_type() == kv_cache.scalar_type(),
              "key, value and kv_cache must share a dtype");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.stride(4) == 1 &&
                  kv_cache.stride(3) == kv_cache.size(4),
              "kv_cache must be [2, blocks, block_size, kv_heads, head_size], heads contiguous");
  const int64_t T = key.size(0), row = kv_cache.size(3) * kv_cache.size(4);
  const int64_t block_size = kv_cache.size(2), num_slots = kv_cache.size(1) * block_size;
  TORCH_CHECK(key.numel() == T * row && value.numel() == T * row,
              "key and value must be [tokens, kv_heads, head_size] of the cache's shape");
  TORCH_CHECK(key.stride(-1) == 1 && key.stride(-2) == key.size(-1) && value.stride(-1) == 1 &&
                  value.stride(-2) == value.size(-1),
              "key and value need contiguous heads");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t elem = kv_cache.element_size();
  char* k_dst = static_cast<char*>(kv_cache.data_ptr());
  char* v_dst = k_dst + kv_cache.stride(0) * elem;
  const int64_t block_bytes = kv_cache.stride(1) * elem, slot_bytes = kv_cache.stride(2) * elem;
  const char* k_src = static_cast<const char*>(key.data_ptr());
  const char* v_src = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * elem, v_stride = value.stride(0) * elem;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = sp[t];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "slot ", slot, " is outside the cache");
    const int64_t at = (slot / block_size) * block_bytes + (slot % block_size) * slot_bytes;
    std::memcpy(k_dst + at, k_src + t * k_stride, row * elem);
    std::memcpy(v_dst + at, v_src + t * v_stride, row * elem);
  }
}

// Mamba2 decode: one token of each of S sequences, the SSM state updated in place in one
// pass (read and write each state element once, accumulating the output on the way):
//   state[s,h,p,:] = exp(dt[s,h] A[h]) state[s,h,p,:] + dt[s,h] x[s,h,p] B[s,g(h),:]
//   y[s,h,p] = state[s,h,p,:] . C[s,g(h),:] + D[h] x[s,h,p]
// All float32 and contiguous; dt already discretized (softplus, clamp). Returns y [S, H, P].
torch::Tensor mamba2_state_update(torch::Tensor state, torch::Tensor x, torch::Tensor dt,
                                  torch::Tensor A, torch::Tensor B, torch::Tensor C,
                                  torch::Tensor D) {
  for (const auto* t : {&state, &x, &dt, &A, &B, &C, &D}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous(),
                "mamba2_state_update takes contiguous float32 tensors");
  }
  TORCH_CHECK(state.dim() == 4 && x.dim() == 3 && B.dim() == 3, "bad mamba2 shapes");
  const int64_t S = state.size(0), H = state.size(1), P = state.size(2), N = state.size(3);
  const int64_t G = B.size(1);
  TORCH_CHECK(H % G == 0 && B.size(2) == N && C.sizes() == B.sizes() && x.size(2) == P,
              "bad mamba2 shapes");
  auto y = torch::empty({S, H, P}, x.options());
  float* st = state.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *ap = A.data_ptr<float>();
  const float *bp = B.data_ptr<float>(), *cp = C.data_ptr<float>(), *dp = D.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t per = H / G;
  at::parallel_for(0, S * H, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t sh = lo; sh < hi; ++sh) {
      const int64_t s = sh / H, h = sh % H;
      const float step = dtp[sh];
      const float decay = std::exp(step * ap[h]);
      const float* b = bp + (s * G + h / per) * N;
      const float* c = cp + (s * G + h / per) * N;
      for (int64_t p = 0; p < P; ++p) {
        const float xv = xp[sh * P + p];
        const float dx = step * xv;
        float* row = st + (sh * P + p) * N;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t n = 0; n < N; ++n) {
          const float v = row[n] * decay + dx * b[n];
          row[n] = v;
          acc += v * c[n];
        }
        yp[sh * P + p] = acc + dp[h] * xv;
      }
    }
  });
  return y;
}

// ---------------------------------------------------------------------------------------
// y[M, N] = x[M, K] @ W[N, K]^T (+ b) for 6/8-bit weights as the quantized-linear contract
// stores them (platforms/ops/quant.py): uint8 codes [N, K], float32 scales and offsets
// [N, K / G], w = q * scale + offset per group of G input columns. Per output row and
// group, acc_q = sum q * x and y += scale * acc_q + offset * sum x; the group sums of x are
// shared by every output row, so they are computed once per call. Activations float32 or
// bf16 (converted to float32 once), float32 accumulation, output in x's dtype.
// Output rows are split over threads; inside a band each weight row is read once per tile
// of kQTile x rows (from L1: a row is K bytes), so small batches stream the codes once.
// AVX2 + FMA where compiled with them (-march=native), a scalar loop otherwise.

constexpr int64_t kQTile = 4;

// One weight row against a tile of `mt` (<= kQTile) x rows: out[m] = sum_g s_g * acc_q(m, g)
// (the offset term is added by the caller from the x group sums).
// `MT` is a template parameter so the accumulators stay in registers (a runtime count
// indexes them through the stack).
template <int64_t MT>
inline void qrow_dot_t(const uint8_t* q, const float* sc, const float* x, int64_t x_stride,
                       int64_t K, int64_t G, float* out) {
  constexpr int64_t mt = MT;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[MT];
  for (int64_t m = 0; m < mt; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g0 = 0, gi = 0; g0 < K; g0 += G, ++gi) {
    __m256 part[MT];
    for (int64_t m = 0; m < mt; ++m) part[m] = _mm256_setzero_ps();
    for (int64_t k = g0; k < g0 + G; k += 8) {
      const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k))));
      for (int64_t m = 0; m < mt; ++m)
        part[m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * x_stride + k), part[m]);
    }
    const __m256 s = _mm256_set1_ps(sc[gi]);
    for (int64_t m = 0; m < mt; ++m) acc[m] = _mm256_fmadd_ps(s, part[m], acc[m]);
  }
  for (int64_t m = 0; m < mt; ++m) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    out[m] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
  }
#else
  for (int64_t m = 0; m < mt; ++m) {
    const float* xr = x + m * x_stride;
    float acc = 0.f;
    for (int64_t g0 = 0, gi = 0; g0 < K; g0 += G, ++gi) {
      float part = 0.f;
      for (int64_t k = g0; k < g0 + G; ++k) part += static_cast<float>(q[k]) * xr[k];
      acc += sc[gi] * part;
    }
    out[m] = acc;
  }
#endif
}

inline void qrow_dot(const uint8_t* q, const float* sc, const float* x, int64_t x_stride,
                     int64_t mt, int64_t K, int64_t G, float* out) {
  static_assert(kQTile == 4, "qrow_dot dispatches tiles of 1-4 rows");
  switch (mt) {
    case 1: return qrow_dot_t<1>(q, sc, x, x_stride, K, G, out);
    case 2: return qrow_dot_t<2>(q, sc, x, x_stride, K, G, out);
    case 3: return qrow_dot_t<3>(q, sc, x, x_stride, K, G, out);
    default: return qrow_dot_t<4>(q, sc, x, x_stride, K, G, out);
  }
}

bool quantized_linear_simd() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

torch::Tensor quantized_linear_u8(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                  c10::optional<torch::Tensor> offsets,
                                  c10::optional<torch::Tensor> bias, int64_t group) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quantized_linear_u8 takes float32 or bfloat16 x, got ", x.scalar_type());
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous(),
              "quantized_linear_u8 needs contiguous uint8 codes [out, in]");
  const int64_t N = codes.size(0), K = codes.size(1), G = group;
  TORCH_CHECK(G > 0 && G % 8 == 0 && K % G == 0, "quantized_linear_u8 needs group % 8 == 0 and "
              "in_features % group == 0; got group=", G, ", in_features=", K);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  const int64_t NG = K / G;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
              scales.size(0) == N && scales.size(1) == NG,
              "quantized_linear_u8 needs contiguous float32 scales [out, in / group]");
  const float* op = nullptr;
  if (offsets.has_value() && offsets->defined()) {
    TORCH_CHECK(offsets->scalar_type() == at::kFloat && offsets->is_contiguous() &&
                offsets->sizes() == scales.sizes(),
                "quantized_linear_u8 needs contiguous float32 offsets shaped as the scales");
    op = offsets->data_ptr<float>();
  }
  auto xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  auto y = torch::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* qp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  torch::Tensor bias_f;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_f.numel() == N, "bias has ", bias_f.numel(), " elements, the weight ", N, " rows");
    bp = bias_f.data_ptr<float>();
  }
  std::vector<float> xsum;  // [M, NG]: sum of x over each group, shared by all rows
  if (op != nullptr) {
    xsum.assign(M * NG, 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < NG; ++g) {
        float s = 0.f;
        for (int64_t k = g * G; k < (g + 1) * G; ++k) s += xp[m * K + k];
        xsum[m * NG + g] = s;
      }
  }
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float out[kQTile];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* q = qp + n * K;
      const float* sc = sp + n * NG;
      const float* oc = op == nullptr ? nullptr : op + n * NG;
      for (int64_t m0 = 0; m0 < M; m0 += kQTile) {
        const int64_t mt = std::min(kQTile, M - m0);
        qrow_dot(q, sc, xp + m0 * K, K, mt, K, G, out);
        for (int64_t m = 0; m < mt; ++m) {
          float v = out[m] + (bp == nullptr ? 0.f : bp[n]);
          if (oc != nullptr) {
            const float* xs = xsum.data() + (m0 + m) * NG;
            for (int64_t g = 0; g < NG; ++g) v += oc[g] * xs[g];
          }
          yp[(m0 + m) * N + n] = v;
        }
      }
    }
  });
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  return y.to(x.scalar_type()).view(out_sizes);
}


// ---------------------------------------------------------------------------------------
// y[M, N] = x[M, K] @ W[N, K]^T (+ b) for 4-bit weights (GGUF Q4_0 / Q4_1, AWQ / GPTQ
// int4): codes as nibbles, float32 scales and offsets [N, K / G], G a multiple of 32,
// w = q * scale + offset per group. The codes come in the plugin's own layout
// (`repack_q4` in ops.py, once at prepack): per block of 32 input columns 16 bytes,
// byte i = column i (low nibble) | column i + 16 (high nibble), as llama.cpp stores Q4_0,
// so one 16-byte load and a shift give the block's 32 codes in column order. Float32
// FMAs like quantized_linear_u8 (exact up to float32 rounding; half its weight bytes),
// the same tiles of kQTile x rows and x group sums for the offsets.

template <int64_t MT>
inline void q4row_dot_t(const uint8_t* q, const float* sc, const float* x, int64_t x_stride,
                        int64_t K, int64_t G, float* out) {
  constexpr int64_t mt = MT;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[MT];
  for (int64_t m = 0; m < mt; ++m) acc[m] = _mm256_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t g0 = 0, gi = 0; g0 < K; g0 += G, ++gi) {
    __m256 part[MT];
    for (int64_t m = 0; m < mt; ++m) part[m] = _mm256_setzero_ps();
    for (int64_t k = g0; k < g0 + G; k += 32) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k / 2));
      const __m128i lo = _mm_and_si128(b, mask);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
      const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
      const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
      for (int64_t m = 0; m < mt; ++m) {
        const float* xr = x + m * x_stride + k;
        part[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), part[m]);
        part[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), part[m]);
        part[m] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), part[m]);
        part[m] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), part[m]);
      }
    }
    const __m256 s = _mm256_set1_ps(sc[gi]);
    for (int64_t m = 0; m < mt; ++m) acc[m] = _mm256_fmadd_ps(s, part[m], acc[m]);
  }
  for (int64_t m = 0; m < mt; ++m) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    out[m] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
  }
#else
  for (int64_t m = 0; m < mt; ++m) {
    const float* xr = x + m * x_stride;
    float acc = 0.f;
    for (int64_t g0 = 0, gi = 0; g0 < K; g0 += G, ++gi) {
      float part = 0.f;
      for (int64_t k = g0; k < g0 + G; k += 32)
        for (int64_t i = 0; i < 16; ++i) {
          const uint8_t b = q[k / 2 + i];
          part += static_cast<float>(b & 0x0F) * xr[k + i] +
                  static_cast<float>(b >> 4) * xr[k + 16 + i];
        }
      acc += sc[gi] * part;
    }
    out[m] = acc;
  }
#endif
}

inline void q4row_dot(const uint8_t* q, const float* sc, const float* x, int64_t x_stride,
                      int64_t mt, int64_t K, int64_t G, float* out) {
  static_assert(kQTile == 4, "q4row_dot dispatches tiles of 1-4 rows");
  switch (mt) {
    case 1: return q4row_dot_t<1>(q, sc, x, x_stride, K, G, out);
    case 2: return q4row_dot_t<2>(q, sc, x, x_stride, K, G, out);
    case 3: return q4row_dot_t<3>(q, sc, x, x_stride, K, G, out);
    default: return q4row_dot_t<4>(q, sc, x, x_stride, K, G, out);
  }
}

torch::Tensor quantized_linear_q4(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                  c10::optional<torch::Tensor> offsets,
                                  c10::optional<torch::Tensor> bias, int64_t group) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quantized_linear_q4 takes float32 or bfloat16 x, got ", x.scalar_type());
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous(),
              "quantized_linear_q4 needs contiguous uint8 codes [out, in / 2]");
  const int64_t N = codes.size(0), K = codes.size(1) * 2, G = group;
  TORCH_CHECK(G > 0 && G % 32 == 0 && K % G == 0, "quantized_linear_q4 needs group % 32 == 0 "
              "and in_features % group == 0; got group=", G, ", in_features=", K);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  const int64_t NG = K / G;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
              scales.size(0) == N && scales.size(1) == NG,
              "quantized_linear_q4 needs contiguous float32 scales [out, in / group]");
  const float* op = nullptr;
  if (offsets.has_value() && offsets->defined()) {
    TORCH_CHECK(offsets->scalar_type() == at::kFloat && offsets->is_contiguous() &&
                offsets->sizes() == scales.sizes(),
                "quantized_linear_q4 needs contiguous float32 offsets shaped as the scales");
    op = offsets->data_ptr<float>();
  }
  auto xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  auto y = torch::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* qp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  torch::Tensor bias_f;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_f.numel() == N, "bias has ", bias_f.numel(), " elements, the weight ", N, " rows");
    bp = bias_f.data_ptr<float>();
  }
  std::vector<float> xsum;  // [M, NG]: sum of x over each group, shared by all rows
  if (op != nullptr) {
    xsum.assign(M * NG, 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < NG; ++g) {
        float s = 0.f;
        for (int64_t k = g * G; k < (g + 1) * G; ++k) s += xp[m * K + k];
        xsum[m * NG + g] = s;
      }
  }
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float out[kQTile];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* q = qp + n * (K / 2);
      const float* sc = sp + n * NG;
      const float* oc = op == nullptr ? nullptr : op + n * NG;
      for (int64_t m0 = 0; m0 < M; m0 += kQTile) {
        const int64_t mt = std::min(kQTile, M - m0);
        q4row_dot(q, sc, xp + m0 * K, K, mt, K, G, out);
        for (int64_t m = 0; m < mt; ++m) {
          float v = out[m] + (bp == nullptr ? 0.f : bp[n]);
          if (oc != nullptr) {
            const float* xs = xsum.data() + (m0 + m) * NG;
            for (int64_t g = 0; g < NG; ++g) v += oc[g] * xs[g];
          }
          yp[(m0 + m) * N + n] = v;
        }
      }
    }
  });
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  return y.to(x.scalar_type()).view(out_sizes);
}

// out[N, K] = q * scale + offset (float32 or bf16), for many rows of x (a prompt chunk, a
// large decode batch): one dequantization per call and a dense GEMM beat the row-dot
// kernels, whose float32 FMAs per weight grow with the rows. One row at a time in float32
// (`q4_row`: quantized_linear_q4's nibble layout; `u8_row`: one code a byte), then stored.
inline void q4_row(const uint8_t* q, const float* sc, const float* oc, int64_t K, int64_t G,
                   float* v) {
  for (int64_t k = 0; k < K; k += 32) {
    const float s = sc[k / G], o = oc == nullptr ? 0.f : oc[k / G];
    const uint8_t* b = q + k / 2;
    for (int64_t i = 0; i < 16; ++i) {
      v[k + i] = static_cast<float>(b[i] & 0x0F) * s + o;
      v[k + 16 + i] = static_cast<float>(b[i] >> 4) * s + o;
    }
  }
}

inline void u8_row(const uint8_t* q, const float* sc, const float* oc, int64_t K, int64_t G,
                   float* v) {
  for (int64_t k = 0; k < K; k += 8) {
    const float s = sc[k / G], o = oc == nullptr ? 0.f : oc[k / G];
    for (int64_t i = 0; i < 8; ++i) v[k + i] = static_cast<float>(q[k + i]) * s + o;
  }
}

inline void store_row(const float* v, float* out, int64_t K) {
  std::memcpy(out, v, K * sizeof(float));
}

inline void store_row(const float* v, c10::BFloat16* out, int64_t K) {
  int64_t k = 0;
#if TM_HAS_BF16_DOT
  for (; k + 16 <= K; k += 16) store_bf16(out + k, _mm512_loadu_ps(v + k));
#endif
  for (; k < K; ++k) out[k] = c10::BFloat16(v[k]);  // nearest even, as the vector store
}

// `row(q, scales, offsets, K, G, v)` per weight row, `row_bytes` of codes each
template <typename T, typename RowFn>
void dequantize_rows(RowFn row, const uint8_t* qp, int64_t row_bytes, const float* sp,
                     const float* op, T* outp, int64_t N, int64_t K, int64_t G) {
  const int64_t NG = K / G;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> v(K);
    for (int64_t n = n0; n < n1; ++n) {
      row(qp + n * row_bytes, sp + n * NG, op == nullptr ? nullptr : op + n * NG, K, G, v.data());
      store_row(v.data(), outp + n * K, K);
    }
  });
}

template <typename RowFn>
void dequantize_into(const char* name, RowFn row, torch::Tensor out, torch::Tensor codes,
                     torch::Tensor scales, c10::optional<torch::Tensor> offsets, int64_t group,
                     int64_t codes_per_byte, int64_t group_multiple) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous(),
              name, " needs contiguous uint8 codes [out, in / ", codes_per_byte, "]");
  const int64_t N = codes.size(0), K = codes.size(1) * codes_per_byte, G = group;
  TORCH_CHECK(G > 0 && G % group_multiple == 0 && K % G == 0, name, " needs group % ",
              group_multiple, " == 0 and in_features % group == 0; got group=", G,
              ", in_features=", K);
  TORCH_CHECK((out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) &&
              out.is_contiguous() && out.dim() == 2 && out.size(0) == N && out.size(1) == K,
              name, " writes a contiguous float32 or bfloat16 [", N, ", ", K, "] tensor, got ",
              out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
              scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / G,
              name, " needs contiguous float32 scales [out, in / group]");
  const float* op = nullptr;
  if (offsets.has_value() && offsets->defined()) {
    TORCH_CHECK(offsets->scalar_type() == at::kFloat && offsets->is_contiguous() &&
                offsets->sizes() == scales.sizes(),
                name, " needs contiguous float32 offsets shaped as the scales");
    op = offsets->data_ptr<float>();
  }
  const uint8_t* qp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  if (out.scalar_type() == at::kFloat)
    dequantize_rows(row, qp, codes.size(1), sp, op, out.data_ptr<float>(), N, K, G);
  else
    dequantize_rows(row, qp, codes.size(1), sp, op, out.data_ptr<c10::BFloat16>(), N, K, G);
}

void dequantize_q4_into(torch::Tensor out, torch::Tensor codes, torch::Tensor scales,
                        c10::optional<torch::Tensor> offsets, int64_t group) {
  dequantize_into("dequantize_q4_into", q4_row, out, codes, scales, offsets, group, 2, 32);
}

void dequantize_u8_into(torch::Tensor out, torch::Tensor codes, torch::Tensor scales,
                        c10::optional<torch::Tensor> offsets, int64_t group) {
  dequantize_into("dequantize_u8_into", u8_row, out, codes, scales, offsets, group, 1, 8);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("fused_add_rms_norm", &fused_add_rms_norm);
  m.def("rotary_embedding", &rotary_embedding);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("has_bf16_dot", &has_bf16_dot);
  m.def("dequantize_q4_into", &dequantize_q4_into);
  m.def("dequantize_u8_into", &dequantize_u8_into);
  m.def("linear_bf16", &linear_bf16);
  m.def("decode_attention", &decode_attention);
  m.def("decode_attention_fp8", &decode_attention_fp8);
#if TM_HAS_BF16_DOT
  m.def("paged_attention_bf16", &paged_attention_bf16);
#endif
  m.def("write_kv", &write_kv);
  m.def("mamba2_state_update", &mamba2_state_update);
  m.def("quantized_linear_u8", &quantized_linear_u8);
  m.def("quantized_linear_simd", &quantized_linear_simd);
  m.def("quantized_linear_q4", &quantized_linear_q4);
}
