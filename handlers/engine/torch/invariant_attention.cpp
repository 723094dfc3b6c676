// Attention over the slot KV cache whose result for a query depends on that query, its head and
// the keys it sees, and on nothing else: not the batch's size or padded length, not the query's
// place in its chunk, not the slot, not the thread count (invariant_attention.py says why).
// Each (row, query, head) is one task, computed in one fixed order over exactly its own keys;
// the vector code is written out (GCC vector extensions, no auto-vectorised remainders) and built
// with -ffp-contract=off, so every lane and every task does the same arithmetic.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 load(const float *p) { v16 v; std::memcpy(&v, p, 64); return v; }

static inline v16 load(const uint16_t *p) {  // bfloat16: the upper half of a float32
    uint16_t h[16];
    std::memcpy(h, p, 32);
    i16 w;
    for (int i = 0; i < 16; i++) w[i] = (int32_t)h[i] << 16;
    v16 v;
    std::memcpy(&v, &w, 64);
    return v;
}

static inline float widen(float x) { return x; }

static inline float widen(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

static inline float tree_sum(v16 v) {
    for (int width = 8; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) v[i] += v[i + width];
    return v[0];
}

// exp(x) for x <= 0: 2^i * p(f) with t = x * log2(e) = i + f, |f| <= 1/2, p a degree-6
// polynomial (relative error ~1e-7); below -87 it is taken at -87 (~1e-38, nothing to a sum).
static inline v16 exp_nonpositive(v16 x) {
    x = x < -87.0f ? (v16){} - 87.0f : x;
    v16 t = x * 1.44269504088896341f;
    i16 i = __builtin_convertvector(t - 0.5f, i16);
    v16 f = t - __builtin_convertvector(i, v16);
    v16 p = (v16){} + 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    i16 bits = (i + 127) << 23;
    v16 scale;
    std::memcpy(&scale, &bits, 64);
    return p * scale;
}

template <typename C>
static float dot(const float *q, const C *k, int64_t d) {
    v16 acc = {};
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) acc += load(q + i) * load(k + i);
    float sum = tree_sum(acc);
    for (; i < d; i++) sum += q[i] * widen(k[i]);
    return sum;
}

// One query over keys/values k, v [n, d] (rows d apart): out = softmax(q.k * scale) @ v.
// `scores` has room for n rounded up to 16.
template <typename C>
static void one_query(const float *q, const C *k, const C *v, int64_t n, int64_t d, float scale,
                      float *scores, float *out) {
    int64_t padded = (n + 15) & ~int64_t(15);
    float top = -INFINITY;
    for (int64_t s = 0; s < n; s++) {
        scores[s] = dot(q, k + s * d, d) * scale;
        top = scores[s] > top ? scores[s] : top;
    }
    for (int64_t s = n; s < padded; s++) scores[s] = -INFINITY;  // exp: 0, whatever n is
    v16 total = {};
    for (int64_t s = 0; s < padded; s += 16) {
        v16 e = exp_nonpositive(load(scores + s) - top);
        std::memcpy(scores + s, &e, 64);
        total += e;
    }
    float inverse = 1.0f / tree_sum(total);
    for (int64_t i = 0; i < d; i++) out[i] = 0.0f;
    for (int64_t s = 0; s < n; s++) {
        const C *row = v + s * d;
        float weight = scores[s];
        int64_t i = 0;
        for (; i + 16 <= d; i += 16) {
            v16 o = load(out + i) + weight * load(row + i);
            std::memcpy(out + i, &o, 64);
        }
        for (; i < d; i++) out[i] += weight * widen(row[i]);
    }
    for (int64_t i = 0; i < d; i++) out[i] *= inverse;
}

// q, out: [B, T, H, D] float32, contiguous. k, v: [B, H_kv, S, D], row b at b * row_stride and
// KV head h at h * head_stride elements, positions D apart. counts: [B, T], how many keys (a
// prefix) each query sees; 0 gives zeros.
template <typename C>
static void attend(const float *q, const C *k, const C *v, int64_t row_stride,
                   int64_t head_stride, const int64_t *counts, float *out, int64_t B, int64_t T,
                   int64_t H, int64_t H_kv, int64_t D, float scale, int threads) {
    int64_t most = 0;
    for (int64_t i = 0; i < B * T; i++) most = counts[i] > most ? counts[i] : most;
    int64_t tasks = B * T * H, group = H / H_kv;
#pragma omp parallel num_threads(threads)
    {
        float *scores = (float *)std::malloc(sizeof(float) * ((most + 15) & ~int64_t(15)) + 64);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t b = task / (T * H), t = task / H % T, h = task % H;
            int64_t n = counts[b * T + t];
            float *o = out + task * D;
            if (n <= 0) {
                for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
                continue;
            }
            int64_t at = b * row_stride + (h / group) * head_stride;
            one_query(q + task * D, k + at, v + at, n, D, scale, scores, o);
        }
        std::free(scores);
    }
}

extern "C" {
void attend_f32(const float *q, const float *k, const float *v, int64_t row_stride,
                int64_t head_stride, const int64_t *counts, float *out, int64_t B, int64_t T,
                int64_t H, int64_t H_kv, int64_t D, float scale, int threads) {
    attend(q, k, v, row_stride, head_stride, counts, out, B, T, H, H_kv, D, scale, threads);
}

void attend_bf16(const float *q, const uint16_t *k, const uint16_t *v, int64_t row_stride,
                 int64_t head_stride, const int64_t *counts, float *out, int64_t B, int64_t T,
                 int64_t H, int64_t H_kv, int64_t D, float scale, int threads) {
    attend(q, k, v, row_stride, head_stride, counts, out, B, T, H, H_kv, D, scale, threads);
}
}
