// Fused CPU kernels for the native engine's step: each replaces a run of small torch ops
// (one pass over memory instead of several, one call instead of many). Built per machine
// by gpu_workers/kernels/__init__.py with the vector flags of its ISA; plain loops written
// so that g++ vectorizes them at that width.
//
// Rounding follows the torch path op for op: a value the torch path rounds to the dtype
// (bf16, fp16) is rounded here at the same point, so both paths agree to the last bit
// wherever the order of a sum does not differ.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// Element access in float for the two cache dtypes: float as is, bf16 as raw 16-bit words
// (uint16_t) with the conversions written out, so that g++ vectorizes the loops around
// them. Rounding to bf16 is round-to-nearest-even with NaN kept, as torch rounds.
inline float f32(float x) { return x; }
inline float f32(uint16_t x) {
  return std::bit_cast<float>(static_cast<uint32_t>(x) << 16);
}

template <typename T>
inline T to(float x);
template <>
inline float to<float>(float x) {
  return x;
}
template <>
inline uint16_t to<uint16_t>(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return x != x ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(r);
}

// x rounded to T and read back (identity for float)
template <typename T>
inline float rnd(float x) {
  return f32(to<T>(x));
}

// Runs fn.template operator()<T>() with T the element type of `dtype` (float or bf16).
template <typename F>
void dispatch(at::ScalarType dtype, const char* what, F&& fn) {
  if (dtype == at::kFloat) {
    fn.template operator()<float>();
  } else if (dtype == at::kBFloat16) {
    fn.template operator()<uint16_t>();
  } else {
    TORCH_CHECK(false, what, ": only float32 and bfloat16 are supported, got ", dtype);
  }
}

template <typename T>
T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// exp(x) = 2^n * e^r with r in [-ln2/2, ln2/2] and a degree-6 polynomial for e^r
// (relative error < 2e-7): plain arithmetic, so it vectorizes where std::exp does not.
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float y = x * 1.44269504088896341f;
  const int32_t k = static_cast<int32_t>(y < 0.0f ? y - 0.5f : y + 0.5f);  // nearest
  const float n = static_cast<float>(k);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((k + 127) << 23);
}

int64_t grain(int64_t row_elems) {
  // rows per task: small steps (a few decode rows) stay on one thread
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1));
}

template <typename T>
void rms_norm_rows(const T* x, T* res, const T* w, T* out, int64_t rows, int64_t n,
                   float eps) {
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      T* o = out + r * n;
      const T* src = xr;
      float ss = 0.0f;
      if (res != nullptr) {  // the residual stream gains x: rounded as `x + residual` is
        T* rr = res + r * n;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) {
          const float v = rnd<T>(f32(xr[i]) + f32(rr[i]));
          rr[i] = to<T>(v);
          ss += v * v;
        }
        src = rr;
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) {
          const float v = f32(xr[i]);
          ss += v * v;
        }
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        o[i] = to<T>(f32(w[i]) * rnd<T>(f32(src[i]) * inv));
      }
    }
  });
}

// weight * rms_norm(x) over the last dim; with `residual`, first residual += x (in place)
// and the norm is of that sum.
torch::Tensor rms_norm(torch::Tensor x, std::optional<torch::Tensor> residual,
                       torch::Tensor weight, double eps) {
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "rms_norm: weight must be [", n, "]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight dtype differs from x");
  x = x.contiguous();
  auto out = torch::empty_like(x);
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                    residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must be a contiguous tensor shaped and typed as x");
  }
  dispatch(x.scalar_type(), "rms_norm", [&]<typename T>() {
    rms_norm_rows<T>(ptr<T>(x), residual ? ptr<T>(*residual) : nullptr, ptr<T>(weight),
                     ptr<T>(out), x.numel() / std::max<int64_t>(n, 1), n,
                     static_cast<float>(eps));
  });
  return out;
}

template <typename T>
void silu_mul_rows(const T* in, T* o, int64_t rows, int64_t half) {
  at::parallel_for(0, rows, grain(half), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = in + r * 2 * half;
      const T* u = g + half;
      T* orow = o + r * half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = f32(g[i]);
        orow[i] = to<T>(rnd<T>(a / (1.0f + exp_approx(-a))) * f32(u[i]));
      }
    }
  });
}

// silu(gate) * up for x = [gate | up] along the last dim: [T, 2I] -> [T, I]
torch::Tensor silu_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_mul: x must be [T, 2I]");
  x = x.contiguous();
  const int64_t rows = x.size(0), half = x.size(1) / 2;
  auto out = torch::empty({rows, half}, x.options());
  dispatch(x.scalar_type(), "silu_mul", [&]<typename T>() {
    silu_mul_rows<T>(ptr<T>(x), ptr<T>(out), rows, half);
  });
  return out;
}

template <typename T>
inline void rotate(T* x, const T* c, const T* s, int64_t d, float* tmp) {
  // x * cos + [x2, x1] * signed_sin, each product rounded as the torch path rounds it
  const int64_t h = d / 2;
  for (int64_t i = 0; i < d; ++i) tmp[i] = f32(x[i]);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) {
    x[i] = to<T>(rnd<T>(tmp[i] * f32(c[i])) + rnd<T>(tmp[i + h] * f32(s[i])));
  }
#pragma omp simd
  for (int64_t i = h; i < d; ++i) {
    x[i] = to<T>(rnd<T>(tmp[i] * f32(c[i])) + rnd<T>(tmp[i - h] * f32(s[i])));
  }
}

void check_cache(const torch::Tensor& cache, const torch::Tensor& like, const char* what) {
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous(), what,
              ": cache must be a contiguous [kv_heads, blocks, block_size, head_dim] tensor");
  TORCH_CHECK(cache.scalar_type() == like.scalar_type(), what, ": cache dtype differs");
}

// Rotates q [T, H, D] and k [T, Hkv, D] in place (rows may be strided, e.g. views into
// the qkv projection's output), then writes k and v [T, Hkv, D] to the caches
// [Hkv, blocks, block_size, D] at `slots` [T] (block * block_size + offset).
void rotary_cache(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos,
                  torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor slots) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "rotary_cache: q, k, v must be 3-D");
  const int64_t t = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2);
  TORCH_CHECK(d % 2 == 0 && k.size(2) == d && v.size(2) == d && k.size(0) == t &&
                  v.size(0) == t && v.size(1) == hk,
              "rotary_cache: q, k, v shapes disagree");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "rotary_cache: head_dim must be contiguous");
  cos = cos.reshape({t, d}).contiguous();
  sin = sin.reshape({t, d}).contiguous();
  check_cache(k_cache, k, "rotary_cache");
  check_cache(v_cache, k, "rotary_cache");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == hk &&
                  k_cache.size(3) == d,
              "rotary_cache: cache shape does not fit k");
  slots = slots.to(torch::kLong).contiguous();
  TORCH_CHECK(slots.numel() == t, "rotary_cache: one slot per token");
  const int64_t capacity = k_cache.size(1) * k_cache.size(2);
  const int64_t* sl = slots.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(sl[i] >= 0 && sl[i] < capacity, "rotary_cache: slot ", sl[i], " out of range");
  }
  dispatch(q.scalar_type(), "rotary_cache", [&]<typename T>() {
    T* qp = ptr<T>(q);
    T* kp = ptr<T>(k);
    const T* vp = ptr<T>(v);
    const T* cp = ptr<T>(cos);
    const T* sp = ptr<T>(sin);
    T* kc = ptr<T>(k_cache);
    T* vc = ptr<T>(v_cache);
    at::parallel_for(0, t, grain((hq + 2 * hk) * d), [&](int64_t begin, int64_t end) {
      std::vector<float> tmp(d);
      for (int64_t i = begin; i < end; ++i) {
        const T* c = cp + i * d;
        const T* s = sp + i * d;
        for (int64_t h = 0; h < hq; ++h) rotate(qp + i * q.stride(0) + h * q.stride(1), c, s, d, tmp.data());
        for (int64_t h = 0; h < hk; ++h) {
          T* kr = kp + i * k.stride(0) + h * k.stride(1);
          rotate(kr, c, s, d, tmp.data());
          const int64_t dst = (h * capacity + sl[i]) * d;
          std::memcpy(kc + dst, kr, d * sizeof(T));
          std::memcpy(vc + dst, vp + i * v.stride(0) + h * v.stride(1), d * sizeof(T));
        }
      }
    });
  });
}

// Vectors of kLanes floats, the build's widest (16 with AVX-512, 8 with AVX2, else 4), in
// g++'s vector extension: one code for every ISA, lowered to that width's instructions.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef float vec_u __attribute__((vector_size(kLanes * sizeof(float)), aligned(4), may_alias));
typedef int32_t ivec __attribute__((vector_size(kLanes * sizeof(int32_t))));
constexpr auto kLaneSeq = std::make_index_sequence<kLanes>{};

inline vec load(const float* p) { return *reinterpret_cast<const vec_u*>(p); }
inline void store(float* p, vec v) { *reinterpret_cast<vec_u*>(p) = v; }

// v with each lane i swapped for lane i ^ S
template <int S, size_t... I>
inline vec swap_lanes(vec v, std::index_sequence<I...>) {
  return __builtin_shufflevector(v, v, (I ^ S)...);
}

// op over all lanes of v as a tree: log2(kLanes) steps instead of a chain of kLanes
template <typename Op>
inline float reduce(vec v, Op op) {
  if constexpr (kLanes >= 16) v = op(v, swap_lanes<8>(v, kLaneSeq));
  if constexpr (kLanes >= 8) v = op(v, swap_lanes<4>(v, kLaneSeq));
  v = op(v, swap_lanes<2>(v, kLaneSeq));
  v = op(v, swap_lanes<1>(v, kLaneSeq));
  return v[0];
}

// lane i: a[2i] + a[2i + 1] in the first half, b[2i - kLanes] + b[2i - kLanes + 1] after
template <size_t... I>
inline vec pair_sums(vec a, vec b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, (2 * I)...) + __builtin_shufflevector(a, b, (2 * I + 1)...);
}

// Lane j of the result: the sum of a[j]'s lanes, for kLanes vectors at once. Adjacent lanes
// are summed pairwise, halving the number of vectors each round (each key's lanes stay
// together and in order): kLanes - 1 pair sums instead of kLanes full horizontal sums.
inline vec sum_lanes(vec* a) {
  for (int n = kLanes; n > 1; n /= 2) {
    for (int j = 0; j < n / 2; ++j) a[j] = pair_sums(a[2 * j], a[2 * j + 1], kLaneSeq);
  }
  return a[0];
}

// Scores of one query against kLanes rows of k: s[j] = q . k[j]. Each row's products are
// summed in its own vector (independent chains), then all rows' sums at once.
template <int64_t D>
inline vec chunk_dots(const float* __restrict__ q, const float* __restrict__ k, int64_t dim) {
  const int64_t d = D ? D : dim, full = d / kLanes * kLanes;
  vec acc[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    vec a = {};
    for (int64_t i = 0; i < full; i += kLanes) a += load(q + i) * load(k + j * d + i);
    acc[j] = a;
  }
  vec s = sum_lanes(acc);
  for (int j = 0; j < kLanes; ++j) {
    for (int64_t i = full; i < d; ++i) s[j] += q[i] * k[j * d + i];
  }
  return s;
}

#if defined(__AVX512BF16__)
// The AVX512-BF16 path for bf16 caches: q . k[j] for 16 rows with the CPU's bf16 dot product
// (vdpbf16ps: 32 products per instruction, each exact in fp32, summed in fp32), K read as
// stored, never converted.
template <int64_t D>
inline vec chunk_dots_bf16(const __m512bh* q, const uint16_t* k) {
  static_assert(D % 32 == 0 && kLanes == 16, "whole 512-bit vectors of bf16");
  vec acc[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t i = 0; i < D / 32; ++i) {
      a = _mm512_dpbf16_ps(a, q[i], (__m512bh)_mm512_loadu_si512(k + j * D + 32 * i));
    }
    acc[j] = (vec)a;
  }
  return sum_lanes(acc);
}
#endif

// acc = acc * alpha + sum over j < cnt of p[j] * v[j], one vector of acc at a time (D: the
// head dim when known at compile time, which unrolls the loops fully; 0: any)
template <int64_t D>
inline void chunk_sum(const float* __restrict__ p, const float* __restrict__ v, int64_t cnt,
                      int64_t dim, float alpha, float* __restrict__ acc) {
  const int64_t d = D ? D : dim, full = d / kLanes * kLanes;
  for (int64_t i = 0; i < full; i += kLanes) {
    vec a = load(acc + i) * alpha;
    for (int64_t j = 0; j < cnt; ++j) a += p[j] * load(v + j * d + i);
    store(acc + i, a);
  }
  for (int64_t i = full; i < d; ++i) {
    float a = acc[i] * alpha;
    for (int64_t j = 0; j < cnt; ++j) a += p[j] * v[j * d + i];
    acc[i] = a;
  }
}

// A block's rows as float: fp32 caches are read in place; bf16 ones are converted once into
// `buf`, shared by every query head of the group.
inline const float* as_f32(const float* rows, int64_t, float*) { return rows; }
inline const float* as_f32(const uint16_t* rows, int64_t count, float* buf) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) buf[i] = f32(rows[i]);
  return buf;
}

// Blocks are scattered over the cache, so the hardware prefetcher loses the stream at each
// block boundary, and the task's arithmetic leaves too few reads in flight to cover the
// memory's latency: the K and V blocks kAhead blocks on are asked for into L2 while this one
// is worked on (measured: 1.4-1.5x the reads per second of no prefetch; into L1, or one
// block ahead, gained little).
constexpr int64_t kAhead = 2;
template <typename T>
inline void prefetch(const T* block, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(block);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

template <typename T, int64_t D>
void decode_tasks(const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, torch::Tensor& out, const int64_t* tab,
                  const int64_t* len, int64_t width, int64_t group, float scale) {
  const int64_t hq = q.size(1), d = q.size(2);
  const int64_t hk = k_cache.size(0), nblocks = k_cache.size(1), bs = k_cache.size(2);
  const int64_t b = q.size(0);
  const int64_t block_bytes = bs * d * static_cast<int64_t>(sizeof(T));
  // rows are read kLanes at a time: a block whose size is not a multiple reads a padded copy
  const int64_t padded = (bs + kLanes - 1) / kLanes * kLanes;
  const T* qp = ptr<T>(q);
  const T* kc = ptr<T>(k_cache);
  const T* vc = ptr<T>(v_cache);
  T* op = ptr<T>(out);
  ivec lane;
  for (int j = 0; j < kLanes; ++j) lane[j] = j;
#if defined(__AVX512BF16__)
  constexpr bool native_bf16 = std::is_same_v<T, uint16_t> && D > 0 && D % 32 == 0;
#else
  constexpr bool native_bf16 = false;
#endif
  // tasks handed out as threads free up: sequences differ in length, so equal shares of
  // tasks are not equal shares of work
#pragma omp parallel num_threads(std::max(1, at::get_num_threads()))
  {
    std::vector<float> qf(group * d), acc(group * d), kbuf(padded * d), vbuf(bs * d);
    std::vector<float> top(group), total(group);
    std::vector<T> kpad(padded * d);
    alignas(64) float p[kLanes];
#if defined(__AVX512BF16__)
    std::vector<__m512bh> qv(native_bf16 ? group * D / 32 : 0);  // the group's queries as stored
#endif
#pragma omp for schedule(dynamic, 2)
    for (int64_t task = 0; task < b * hk; ++task) {
      const int64_t s = task / hk, h = task % hk, n = len[s];
      const int64_t* row_blocks = tab + s * width;
      const int64_t nblk = (n + bs - 1) / bs;
      const T* kbase = kc + h * nblocks * bs * d;
      const T* vbase = vc + h * nblocks * bs * d;
      const T* qrow = qp + s * q.stride(0) + h * group * q.stride(1);
      for (int64_t g = 0; g < group && !native_bf16; ++g) {
        for (int64_t i = 0; i < d; ++i) qf[g * d + i] = f32(qrow[g * q.stride(1) + i]) * scale;
      }
#if defined(__AVX512BF16__)
      if constexpr (native_bf16) {
        for (int64_t g = 0; g < group; ++g) {
          for (int64_t i = 0; i < D / 32; ++i) {
            qv[g * D / 32 + i] = (__m512bh)_mm512_loadu_si512(qrow + g * q.stride(1) + 32 * i);
          }
        }
      }
#endif
      for (int64_t blk = 0; blk < std::min(kAhead, nblk); ++blk) {
        prefetch(kbase + row_blocks[blk] * bs * d, block_bytes);
        prefetch(vbase + row_blocks[blk] * bs * d, block_bytes);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(top.begin(), top.end(), -INFINITY);
      std::fill(total.begin(), total.end(), 0.0f);
      // one pass: each block's scores, then its values, the softmax kept online (a running
      // max, and the sums so far rescaled when it grows)
      for (int64_t blk = 0; blk < nblk; ++blk) {
        if (blk + kAhead < nblk) {
          prefetch(kbase + row_blocks[blk + kAhead] * bs * d, block_bytes);
          prefetch(vbase + row_blocks[blk + kAhead] * bs * d, block_bytes);
        }
        const int64_t cnt = std::min(bs, n - blk * bs);
        const T* kb = kbase + row_blocks[blk] * bs * d;
        if (padded != bs) {
          std::copy(kb, kb + cnt * d, kpad.begin());
          kb = kpad.data();
        }
        const float* kf = native_bf16 ? nullptr : as_f32(kb, cnt * d, kbuf.data());
        const float* vf = as_f32(vbase + row_blocks[blk] * bs * d, cnt * d, vbuf.data());
        for (int64_t t0 = 0; t0 < cnt; t0 += kLanes) {
          const int64_t c = std::min<int64_t>(kLanes, cnt - t0);
          for (int64_t g = 0; g < group; ++g) {
            vec sc;
#if defined(__AVX512BF16__)
            if constexpr (native_bf16) {
              sc = chunk_dots_bf16<D>(qv.data() + g * D / 32, kb + t0 * d) * scale;
            } else {
              sc = chunk_dots<D>(qf.data() + g * d, kf + t0 * d, d);
            }
#else
            sc = chunk_dots<D>(qf.data() + g * d, kf + t0 * d, d);
#endif
            sc = lane < static_cast<int32_t>(c) ? sc : -INFINITY;
            const float m = std::max(top[g], reduce(sc, [](vec a, vec b) -> vec {
                                       return a > b ? a : b;
                                     }));
            const float alpha = m > top[g] ? std::exp(top[g] - m) : 1.0f;
            top[g] = m;
            store(p, sc - m);
#pragma omp simd
            for (int j = 0; j < kLanes; ++j) p[j] = j < c ? exp_approx(p[j]) : 0.0f;
            total[g] = total[g] * alpha + reduce(load(p), [](vec a, vec b) -> vec { return a + b; });
            chunk_sum<D>(p, vf + t0 * d, c, d, alpha, acc.data() + g * d);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* orow = op + (s * hq + h * group + g) * d;
        const float inv = 1.0f / total[g];
        for (int64_t i = 0; i < d; ++i) orow[i] = to<T>(acc[g * d + i] * inv);
      }
    }
  }
}

// Decode attention straight from the paged cache: one query token per sequence.
// q [B, H, D] (rows may be strided); caches [Hkv, blocks, block_size, D]; tables [B, W]
// block ids; lens [B] tokens each sequence attends. Each (sequence, kv head) is one task,
// one pass over its blocks: its group of query heads scores each block's keys, then adds
// up the block's values weighted by an online softmax in fp32. Nothing is gathered.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_decode: q must be [B, H, D]");
  check_cache(k_cache, q, "paged_decode");
  check_cache(v_cache, q, "paged_decode");
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hk = k_cache.size(0), nblocks = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(3) == d && hq % hk == 0,
              "paged_decode: cache shape does not fit q");
  tables = tables.to(torch::kLong).contiguous();
  lens = lens.to(torch::kLong).contiguous();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == b && lens.numel() == b,
              "paged_decode: tables must be [B, W] and lens [B]");
  const int64_t width = tables.size(1);
  const int64_t* tab = tables.const_data_ptr<int64_t>();
  const int64_t* len = lens.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(len[i] >= 1 && len[i] <= width * bs, "paged_decode: length ", len[i],
                " does not fit the block table");
    for (int64_t j = 0; j < (len[i] + bs - 1) / bs; ++j) {
      TORCH_CHECK(tab[i * width + j] >= 0 && tab[i * width + j] < nblocks,
                  "paged_decode: block id out of range");
    }
  }
  const int64_t group = hq / hk;
  auto out = torch::empty({b, hq, d}, q.options());
  dispatch(q.scalar_type(), "paged_decode", [&]<typename T>() {
    switch (d) {  // the common head dims get fully unrolled loops
      case 64:
        decode_tasks<T, 64>(q, k_cache, v_cache, out, tab, len, width, group, static_cast<float>(scale));
        break;
      case 128:
        decode_tasks<T, 128>(q, k_cache, v_cache, out, tab, len, width, group, static_cast<float>(scale));
        break;
      default:
        decode_tasks<T, 0>(q, k_cache, v_cache, out, tab, len, width, group, static_cast<float>(scale));
    }
  });
  return out;
}

// Top-p (nucleus) over rows of probabilities, in place: the same cutoff as the sampler's
// numpy path (gpu_workers/engine/sampler.py, _nucleus): each row's probabilities are
// bucketed by their top float bits (exponent and 4 mantissa bits; everything below 2^-40
// in the lowest bucket) with the bucket masses summed in float64 in index order; the
// highest bucket whose mass with all above it reaches `want` holds the cutoff; only its
// tokens are sorted (value descending, index ascending on ties), and each is kept while
// the mass above it is under `want` (the first at least). Values under the cutoff become
// 0. One pass to bucket, one to gather, one to mask, per row, rows in parallel.
constexpr int kShift = 19;
constexpr int kLow = (127 - 40) << 4;
constexpr int kBuckets = (128 << 4) - kLow;

inline int bucket_of(float v) {
  const int k = static_cast<int>((std::bit_cast<uint32_t>(v) & 0x7FFFFFFFu) >> kShift) - kLow;
  return std::clamp(k, 0, kBuckets - 1);  // NaN or > 2 land in the top bucket: never out of bounds
}

void top_p_(torch::Tensor probs, torch::Tensor want) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == torch::kFloat && probs.is_contiguous() &&
                  probs.device().is_cpu(),
              "top_p_: probs must be a contiguous CPU float32 [rows, vocab]");
  TORCH_CHECK(want.dim() == 1 && want.scalar_type() == torch::kDouble && want.is_contiguous() &&
                  want.size(0) == probs.size(0),
              "top_p_: want must be float64 [rows]");
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  float* all = probs.data_ptr<float>();
  const double* wants = want.const_data_ptr<double>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<double> mass(kBuckets), below(kBuckets);
    std::vector<std::pair<float, int64_t>> tied;
    for (int64_t r = r0; r < r1; ++r) {
      float* p = all + r * vocab;
      const double w = wants[r];
      std::fill(mass.begin(), mass.end(), 0.0);
      for (int64_t j = 0; j < vocab; ++j) mass[bucket_of(p[j])] += static_cast<double>(p[j]);
      double acc = 0.0;
      for (int b = 0; b < kBuckets; ++b) below[b] = acc += mass[b];
      const double total = below[kBuckets - 1];
      int reach = 0;
      for (int b = 0; b < kBuckets; ++b) reach += (total - below[b] + mass[b]) >= w;
      const int bucket = reach - 1;
      if (bucket < 0) continue;  // rounding left no bucket reaching it: the row is kept whole
      const double before = total - below[bucket];
      tied.clear();
      for (int64_t j = 0; j < vocab; ++j) {
        if (bucket_of(p[j]) == bucket) tied.emplace_back(p[j], j);
      }
      if (tied.empty()) continue;
      std::sort(tied.begin(), tied.end(), [](const auto& a, const auto& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      });
      size_t count = 0;
      double run = 0.0;  // the bucket's mass ranked above the token
      while (count < tied.size() && before + run < w) run += static_cast<double>(tied[count++].first);
      const float cutoff = tied[std::max<size_t>(count, 1) - 1].first;
      for (int64_t j = 0; j < vocab; ++j) p[j] = p[j] < cutoff ? 0.0f : p[j];
    }
  });
}


#if defined(__AVX512BF16__)
// y = x @ w.T for bf16 x and int8 or int4 weights (quant_linear.py packs them): one block
// of 16 output rows at a time, its codes dequantized once per call into bf16 pairs
// ((code * scale + offset) rounded to bf16: the scale and zero point of each group folded
// in), then every row of x multiplied with vdpbf16ps, up to 16 rows held in registers.
// Decode reads each weight once a step: int8 codes are half the bytes of bf16, int4 a
// quarter, and the dequantization is paid once for all rows of the step.
inline __m512bh xpair(const uint16_t* x) {
  uint32_t v;
  std::memcpy(&v, x, sizeof v);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(v));
}

template <int MT, int NB>
void qtile(const uint16_t* x, int64_t ldx, const __m512bh* w, int64_t pairs, uint16_t* y,
           int64_t ldy) {
  // NB blocks of 16 outputs (their weights one after another in w): each broadcast of a
  // pair of x feeds NB products
  __m512 acc[NB][MT];
  for (int b = 0; b < NB; ++b)
    for (int i = 0; i < MT; ++i) acc[b][i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = w[b * pairs + p];
    for (int i = 0; i < MT; ++i) {
      const __m512bh xb = xpair(x + i * ldx + 2 * p);
      for (int b = 0; b < NB; ++b) acc[b][i] = _mm512_dpbf16_ps(acc[b][i], wv[b], xb);
    }
  }
  for (int b = 0; b < NB; ++b) {
    for (int i = 0; i < MT; ++i) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * ldy + b * 16),
                          (__m256i)_mm512_cvtneps_pbh(acc[b][i]));
    }
  }
}

template <int NB, int... I>
constexpr auto qtiles(std::integer_sequence<int, I...>) {
  return std::array{qtile<I + 1, NB>...};
}
constexpr auto kQTiles2 = qtiles<2>(std::make_integer_sequence<int, 12>{});
constexpr auto kQTiles1 = qtiles<1>(std::make_integer_sequence<int, 16>{});

// 32 weights (16 output rows x a pair of input columns) dequantized to bf16 pairs.
template <int Bits>
inline __m512bh qpair(const uint8_t* c, __m512 s_lo, __m512 s_hi, __m512 o_lo, __m512 o_hi) {
  __m512i lo, hi;
  if constexpr (Bits == 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
    lo = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(v));
    hi = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1));
  } else {  // byte j: code 2j in its low nibble, code 2j + 1 in its high one
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    const __m128i l = _mm_and_si128(v, low);
    const __m128i h = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    lo = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(l, h));
    hi = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(l, h));
  }
  return _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), s_hi, o_hi),
                             _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), s_lo, o_lo));
}

// A few rows (decode of a few sequences): each pair of weights dequantized in registers
// and used at once, so the codes stream from memory once and nothing else is written.
template <int Bits, int MT>
void qrows(const uint16_t* x, int64_t k, const uint8_t* c, const float* a, int64_t groups,
           int64_t group, uint16_t* y, int64_t ldy) {
  constexpr int64_t per = Bits == 8 ? 32 : 16;
  __m512 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, a += 64) {
    const __m512 s_lo = _mm512_loadu_ps(a), s_hi = _mm512_loadu_ps(a + 16);
    const __m512 o_lo = _mm512_loadu_ps(a + 32), o_hi = _mm512_loadu_ps(a + 48);
    for (int64_t p = g * group / 2; p < (g + 1) * group / 2; ++p) {
      const __m512bh w = qpair<Bits>(c + p * per, s_lo, s_hi, o_lo, o_hi);
      for (int i = 0; i < MT; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], w, xpair(x + i * k + 2 * p));
    }
  }
  for (int i = 0; i < MT; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * ldy),
                        (__m256i)_mm512_cvtneps_pbh(acc[i]));
  }
}

// codes: [N/16, K/2, 32] int8 (bits 8) or [N/16, K/2, 16] bytes of two 4-bit codes each
// (bits 4); affine: [N/16, groups, 2, 32] float, the scale and offset of each value of a
// pair row, per group of `group` input columns.
template <int Bits>
void qlinear_bits(const uint16_t* xp, int64_t m, int64_t k, const uint8_t* cp, const float* ap,
                  int64_t blocks, int64_t groups, int64_t group, uint16_t* yp) {
  constexpr int64_t per = Bits == 8 ? 32 : 16;
  const int64_t pairs = k / 2, n = blocks * 16;
  // work items: pairs of blocks (the last one alone when their count is odd)
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    std::vector<__m512bh> w;
    for (int64_t item = p0; item < p1; ++item) {
      const int64_t first = 2 * item, nb = std::min<int64_t>(2, blocks - first);
      if (m <= 4) {  // a few rows: each block's weights dequantized in registers, used at once
        constexpr void (*rows[])(const uint16_t*, int64_t, const uint8_t*, const float*, int64_t,
                                 int64_t, uint16_t*, int64_t) = {
            qrows<Bits, 1>, qrows<Bits, 2>, qrows<Bits, 3>, qrows<Bits, 4>};
        for (int64_t b = first; b < first + nb; ++b) {
          rows[m - 1](xp, k, cp + b * pairs * per, ap + b * groups * 64, groups, group,
                      yp + b * 16, n);
        }
        continue;
      }
      // more rows: the blocks' weights dequantized once, then up to 12 rows (16 for a
      // block alone) at a time
      w.resize(nb * pairs);
      for (int64_t j = 0; j < nb; ++j) {
        const uint8_t* c = cp + (first + j) * pairs * per;
        const float* a = ap + (first + j) * groups * 64;
        for (int64_t g = 0; g < groups; ++g) {
          const float* ag = a + g * 64;
          const __m512 s_lo = _mm512_loadu_ps(ag), s_hi = _mm512_loadu_ps(ag + 16);
          const __m512 o_lo = _mm512_loadu_ps(ag + 32), o_hi = _mm512_loadu_ps(ag + 48);
          for (int64_t p = g * group / 2; p < (g + 1) * group / 2; ++p) {
            w[j * pairs + p] = qpair<Bits>(c + p * per, s_lo, s_hi, o_lo, o_hi);
          }
        }
      }
      const int64_t step = nb == 2 ? 12 : 16;
      for (int64_t r = 0; r < m; r += step) {
        const int64_t rows = std::min<int64_t>(step, m - r);
        const auto tile = nb == 2 ? kQTiles2[rows - 1] : kQTiles1[rows - 1];
        tile(xp + r * k, k, w.data(), pairs, yp + r * n + first * 16, n);
      }
    }
  });
}

// 16 values of a row as floats (bf16 widened)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// W8A8: y = x @ w.T with x quantized to int8 per row at run time (its absolute max to 127)
// and int8 weights per output channel, multiplied with vpdpbusd (64 products a
// instruction, twice vdpbf16ps's): the row's codes are stored shifted by 128 as unsigned,
// and 128 times each weight row's sum of codes taken off after. codes: [N/16, K/4, 64]
// int8 (16 rows x 4 columns, as the instruction reads them); wsum: int32 [N]; wscale:
// float [N].
template <typename T, int MT, int NB>
void i8tile(const uint8_t* xq, int64_t ldx, const int8_t* w, int64_t quads, const float* xs,
            const int32_t* wsum, const float* wscale, T* y, int64_t ldy) {
  // NB blocks of 16 outputs at once: each broadcast of x feeds NB products
  __m512i acc[NB][MT];
  for (int b = 0; b < NB; ++b)
    for (int i = 0; i < MT; ++i) acc[b][i] = _mm512_setzero_si512();
  const int64_t bstride = quads * 64;
  for (int64_t q = 0; q < quads; ++q) {
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_si512(w + b * bstride + q * 64);
    for (int i = 0; i < MT; ++i) {
      uint32_t xv;
      std::memcpy(&xv, xq + i * ldx + 4 * q, sizeof xv);
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(xv));
      for (int b = 0; b < NB; ++b) acc[b][i] = _mm512_dpbusd_epi32(acc[b][i], xb, wv[b]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512(wsum + b * 16), 7);
    const __m512 ws = _mm512_loadu_ps(wscale + b * 16);
    for (int i = 0; i < MT; ++i) {
      const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[b][i], off)),
                                     _mm512_mul_ps(ws, _mm512_set1_ps(xs[i])));
      if constexpr (std::is_same_v<T, float>) {
        _mm512_storeu_ps(y + i * ldy + b * 16, v);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * ldy + b * 16),
                            (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}

// tiles of up to 12 rows x 2 blocks (24 accumulators), or 16 rows x 1 block
template <typename T, int NB, int... I>
constexpr auto i8tiles(std::integer_sequence<int, I...>) {
  return std::array{i8tile<T, I + 1, NB>...};
}

torch::Tensor qlinear_i8(const torch::Tensor& x, const torch::Tensor& codes,
                         const torch::Tensor& wsum, const torch::Tensor& wscale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "qlinear_i8: x must be contiguous 2-D");
  const int64_t m = x.size(0), k = x.size(1), blocks = codes.size(0), n = blocks * 16;
  TORCH_CHECK(k % 16 == 0 && codes.is_contiguous() && codes.scalar_type() == at::kChar &&
                  codes.dim() == 3 && codes.size(1) == k / 4 && codes.size(2) == 64,
              "qlinear_i8: codes do not match x");
  TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.numel() == n && wsum.is_contiguous() &&
                  wscale.scalar_type() == at::kFloat && wscale.numel() == n &&
                  wscale.is_contiguous(),
              "qlinear_i8: sums or scales do not match the codes");
  auto y = torch::empty({m, n}, x.options());
  if (m == 0) return y;
  std::vector<uint8_t> xq(m * k);
  std::vector<float> xs(m);
  dispatch(x.scalar_type(), "qlinear_i8", [&]<typename T>() {
    const T* xp = ptr<T>(x);
    at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* row = xp + r * k;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t j = 0; j < k; j += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(row + j)));
        const float scale = std::max(_mm512_reduce_max_ps(amax), 1e-8f) / 127.0f;
        const __m512 inv = _mm512_set1_ps(1.0f / scale);
        const __m512i shift = _mm512_set1_epi32(128);
        xs[r] = scale;
        for (int64_t j = 0; j < k; j += 16) {  // round half to even, as torch.round
          __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(row + j), inv));
          q = _mm512_add_epi32(_mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)),
                                                _mm512_set1_epi32(-128)), shift);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(xq.data() + r * k + j),
                           _mm512_cvtepi32_epi8(q));
        }
      }
    });
    T* yp = ptr<T>(y);
    static constexpr auto pairs = i8tiles<T, 2>(std::make_integer_sequence<int, 12>{});
    static constexpr auto singles = i8tiles<T, 1>(std::make_integer_sequence<int, 16>{});
    const int8_t* cp = ptr<int8_t>(codes);
    const int64_t quads = k / 4;
    // work items: pairs of blocks (the last one alone when their count is odd)
    at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t b = 2 * p;
        const bool two = b + 1 < blocks;
        const int64_t step = two ? 12 : 16;
        for (int64_t r = 0; r < m; r += step) {
          const int64_t rows = std::min<int64_t>(step, m - r);
          const auto tile = two ? pairs[rows - 1] : singles[rows - 1];
          tile(xq.data() + r * k, k, cp + b * quads * 64, quads, xs.data() + r,
               ptr<int32_t>(wsum) + b * 16, ptr<float>(wscale) + b * 16, yp + r * n + b * 16, n);
        }
      }
    });
  });
  return y;
}

torch::Tensor qlinear(const torch::Tensor& x, const torch::Tensor& codes,
                      const torch::Tensor& affine, int64_t bits, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "qlinear: x must be a contiguous 2-D bf16 tensor");
  TORCH_CHECK(bits == 8 || bits == 4, "qlinear: bits must be 8 or 4");
  const int64_t m = x.size(0), k = x.size(1), blocks = codes.size(0);
  const int64_t groups = affine.size(1);
  TORCH_CHECK(codes.is_contiguous() && codes.dim() == 3 && codes.size(1) == k / 2 &&
                  codes.size(2) == (bits == 8 ? 32 : 16) && k % 2 == 0,
              "qlinear: codes do not match x");
  TORCH_CHECK(affine.is_contiguous() && affine.scalar_type() == at::kFloat &&
                  affine.dim() == 4 && affine.size(0) == blocks && affine.size(2) == 2 &&
                  affine.size(3) == 32 && group % 2 == 0 && groups * group == k,
              "qlinear: scales do not match the codes");
  auto y = torch::empty({m, blocks * 16}, x.options());
  if (m == 0) return y;
  auto run = bits == 8 ? qlinear_bits<8> : qlinear_bits<4>;
  run(ptr<uint16_t>(x), m, k, ptr<uint8_t>(codes), ptr<float>(affine), blocks, groups, group,
      ptr<uint16_t>(y));
  return y;
}
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "weight * rms_norm(x (+ residual, in place))");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("rotary_cache", &rotary_cache, "rotary on q, k in place; k, v into the paged cache");
  m.def("paged_decode", &paged_decode, "decode attention read from the paged cache");
  m.def("top_p_", &top_p_, "top-p in place over rows of probabilities (the sampler's cutoff)");
#if defined(__AVX512BF16__)
  m.def("qlinear", &qlinear, "x @ w.T for bf16 x and int8/int4 weights (quant_linear.py)");
  m.def("qlinear_i8", &qlinear_i8, "x @ w.T with x quantized to int8 per row (W8A8)");
#endif
}
