// lmi_quant::quant_linear: a linear layer over 4- or 8-bit weights in groups of 32 (GGUF's blocks),
// computed as llama.cpp computes its quantized dot products: each input row quantized to int8 in
// groups of 32, each group's products summed in int32 (exact), the groups' sums scaled and
// added in float32 in one fixed order. Integer sums are exact whatever unit computes them
// (AMX, AVX-512 VNNI, AVX2, plain C++), so a row's output depends on that row alone: not the
// batch, the thread count or the path the CPU takes (quant_linear.py says more).
//
// Weights: values u (0..15, or 0..255) with, per output and group, a scale d and a min m:
// w = d * u + m. Laid out for the vector units in tiles of 16 outputs: a group of a tile is
// 8 chunks of 4 inputs, chunk c holding u[n][4c..4c+3] for n = 0..15 (64 bytes); 4-bit
// weights hold chunks 2p and 2p+1 in the low and high nibbles of pair p's 64 bytes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t GROUP = 32;  // inputs of a group
constexpr int64_t TILE = 16;   // outputs of a tile
constexpr int64_t CHUNKS = GROUP / 4;
constexpr int64_t ROWS = 4;  // input rows computed together, sharing a tile's loaded weights

// An input's rows quantized: q (int8, [rows, k]); per (row, group) its scale, the scale times
// the sum of its q (the min's weight) and that sum itself.
struct Rows {
    std::vector<int8_t> q;
    std::vector<float> scale, offset;
    std::vector<int32_t> sum;
    int64_t k, groups;
};

// A group of 32 inputs v as int8: q = v * inv rounded to the nearest integer (ties to even), a
// NaN 0, clamped to +-127, where inv = 127 / max|v| (0 where that is 0 or infinite; NaN inputs
// do not count towards the max). Each build's quantize_group computes exactly this, in vectors
// where it has them (a scalar pass took ~2.5 ms of a 32-row step).
inline float inverse(float amax) {
    return amax > 0.0f && std::isfinite(amax) ? 127.0f / amax : 0.0f;
}

struct Quantized {
    float amax;
    int32_t sum;  // of the group's q
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline Quantized quantize_group(const float *v, int8_t *q) {
    const __m512 a[2] = {_mm512_loadu_ps(v), _mm512_loadu_ps(v + 16)};
    __m512 most = _mm512_setzero_ps();
    for (const __m512 x : a)  // max's second operand is kept where the first is NaN
        most = _mm512_max_ps(_mm512_abs_ps(x), most);
    const float amax = _mm512_reduce_max_ps(most);
    const __m512 inv = _mm512_set1_ps(inverse(amax));
    __m512i sum = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
        __m512 t = _mm512_mul_ps(a[h], inv);
        t = _mm512_mask_mov_ps(t, _mm512_cmp_ps_mask(t, t, _CMP_UNORD_Q), _mm512_setzero_ps());
        t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
        const __m512i i = _mm512_cvtps_epi32(t);  // nearest, ties to even (MXCSR's default)
        _mm_storeu_si128((__m128i *)(q + 16 * h), _mm512_cvtepi32_epi8(i));
        sum = _mm512_add_epi32(sum, i);
    }
    return {amax, _mm512_reduce_add_epi32(sum)};
}
#elif defined(__AVX2__)
inline float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline Quantized quantize_group(const float *v, int8_t *q) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a[4], most = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {  // max's second operand is kept where the first is NaN
        a[c] = _mm256_loadu_ps(v + 8 * c);
        most = _mm256_max_ps(_mm256_andnot_ps(sign, a[c]), most);
    }
    const float amax = max8(most);
    const __m256 inv = _mm256_set1_ps(inverse(amax));
    __m256i i[4];
    for (int c = 0; c < 4; ++c) {
        __m256 t = _mm256_mul_ps(a[c], inv);
        t = _mm256_blendv_ps(t, _mm256_setzero_ps(), _mm256_cmp_ps(t, t, _CMP_UNORD_Q));
        t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
        i[c] = _mm256_cvtps_epi32(t);  // nearest, ties to even (MXCSR's default)
    }
    // Packed per 128-bit lane, then the 4-byte pieces put back in order.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]),
                                             _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(
                                          bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    return {amax, _mm_cvtsi128_si32(h)};
}
#else
inline Quantized quantize_group(const float *v, int8_t *q) {
    float amax = 0.0f;
    for (int64_t i = 0; i < GROUP; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float inv = inverse(amax);
    int32_t sum = 0;
    for (int64_t i = 0; i < GROUP; ++i) {
        float t = std::nearbyint(v[i] * inv);
        t = t != t ? 0.0f : std::clamp(t, -127.0f, 127.0f);
        q[i] = static_cast<int8_t>(t);
        sum += q[i];
    }
    return {amax, sum};
}
#endif

Rows quantize(const float *x, int64_t rows, int64_t k) {
    Rows r{std::vector<int8_t>(rows * k), std::vector<float>(rows * (k / GROUP)),
           std::vector<float>(rows * (k / GROUP)), std::vector<int32_t>(rows * (k / GROUP)), k,
           k / GROUP};
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row)
            for (int64_t g = 0; g < r.groups; ++g) {
                const int64_t at = row * r.groups + g;
                const Quantized group = quantize_group(x + at * GROUP, r.q.data() + at * GROUP);
                r.scale[at] = group.amax / 127.0f;
                r.offset[at] = r.scale[at] * static_cast<float>(group.sum);
                r.sum[at] = group.sum;
            }
    });
    return r;
}

int32_t four_bytes(const int8_t *p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// A group's 16 float16 scales or mins, as float32.
inline __m512 sixteen(const c10::Half *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

// One row's group added to its 16 outputs: the int32 sums `s` scaled by the weights' scales
// `dv` times the row's, then the mins `mv` times the row's offset. Every AVX-512 path (VNNI,
// AMX) takes these steps, in this order, so they give the same bits.
inline __m512 add_group(__m512 acc, __m512 dv, __m512 mv, __m512i s, const Rows &x, int64_t at) {
    const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(x.scale[at]));
    acc = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(s), acc);
    return _mm512_fmadd_ps(mv, _mm512_set1_ps(x.offset[at]), acc);
}

// 16 outputs per vector; u8 x s8 products summed by vpdpbusd.
template <int R, int BITS>
void tile(const uint8_t *w, const c10::Half *d, const c10::Half *m, const Rows &x, int64_t row0,
          float *y, int64_t n_total) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int64_t bytes = BITS == 4 ? 256 : 512;
    for (int64_t g = 0; g < x.groups; ++g) {
        const uint8_t *wg = w + g * bytes;
        __m512i u[CHUNKS];
        for (int c = 0; c < CHUNKS; ++c) {
            if constexpr (BITS == 4) {
                const __m512i pair = _mm512_loadu_si512(wg + 64 * (c / 2));
                u[c] = c % 2 == 0 ? _mm512_and_si512(pair, low)
                                  : _mm512_and_si512(_mm512_srli_epi16(pair, 4), low);
            } else {
                u[c] = _mm512_loadu_si512(wg + 64 * c);
            }
        }
        const __m512 dv = sixteen(d + g * TILE), mv = sixteen(m + g * TILE);
        for (int r = 0; r < R; ++r) {
            const int64_t row = row0 + r;
            const int8_t *q = x.q.data() + row * x.k + g * GROUP;
            __m512i s = _mm512_setzero_si512();
            for (int c = 0; c < CHUNKS; ++c)
                s = _mm512_dpbusd_epi32(s, u[c], _mm512_set1_epi32(four_bytes(q + 4 * c)));
            acc[r] = add_group(acc[r], dv, mv, s, x, row * x.groups + g);
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (row0 + r) * n_total, acc[r]);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// 8 outputs per vector, a tile in two halves; u8 x s8 pairs by vpmaddubsw (16-bit, saturating:
// 8-bit weights go signed, their sign moved onto the input, and come back as u = w + 128).
template <int BITS>
__m256i dot(__m256i u, __m256i q) {
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (BITS == 4) return _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), ones);
    const __m256i w = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
    return _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(q, w)), ones);
}

// A group's sums for 8 outputs. 4-bit products add up in 16 bits over all 8 chunks before
// widening (at most 8 x 2 x 15 x 127 = 30,480: no lane saturates), a third fewer operations.
template <int BITS>
__m256i group_sum(const __m256i *u, const int8_t *q, int32_t q_sum) {
    if constexpr (BITS == 4) {
        __m256i s16 = _mm256_setzero_si256();
        for (int c = 0; c < CHUNKS; ++c)
            s16 = _mm256_add_epi16(
                s16, _mm256_maddubs_epi16(u[c], _mm256_set1_epi32(four_bytes(q + 4 * c))));
        return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
    }
    __m256i s = _mm256_setzero_si256();
    for (int c = 0; c < CHUNKS; ++c)
        s = _mm256_add_epi32(s, dot<BITS>(u[c], _mm256_set1_epi32(four_bytes(q + 4 * c))));
    return _mm256_add_epi32(s, _mm256_set1_epi32(q_sum * 128));  // the 8-bit weights' shift
}

template <int R, int BITS>
void tile(const uint8_t *w, const c10::Half *d, const c10::Half *m, const Rows &x, int64_t row0,
          float *y, int64_t n_total) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    const int64_t bytes = BITS == 4 ? 256 : 512;
    for (int64_t g = 0; g < x.groups; ++g) {
        for (int h = 0; h < 2; ++h) {
            const uint8_t *wg = w + g * bytes + 32 * h;
            __m256i u[CHUNKS];
            for (int c = 0; c < CHUNKS; ++c) {
                if constexpr (BITS == 4) {
                    const __m256i pair = _mm256_loadu_si256((const __m256i *)(wg + 64 * (c / 2)));
                    u[c] = c % 2 == 0 ? _mm256_and_si256(pair, low)
                                      : _mm256_and_si256(_mm256_srli_epi16(pair, 4), low);
                } else {
                    u[c] = _mm256_loadu_si256((const __m256i *)(wg + 64 * c));
                }
            }
            const __m256 dv =
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + g * TILE + 8 * h)));
            const __m256 mv =
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + g * TILE + 8 * h)));
            for (int r = 0; r < R; ++r) {
                const int64_t row = row0 + r;
                const int8_t *q = x.q.data() + row * x.k + g * GROUP;
                const int64_t at = row * x.groups + g;
                const __m256i s = group_sum<BITS>(u, q, x.sum[at]);
                const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(x.scale[at]));
                acc[r][h] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s), acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(x.offset[at]), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (row0 + r) * n_total + 8 * h, acc[r][h]);
}
#else
// Plain C++: the same integer sums and the same float operations in the same order.
template <int R, int BITS>
void tile(const uint8_t *w, const c10::Half *d, const c10::Half *m, const Rows &x, int64_t row0,
          float *y, int64_t n_total) {
    const int64_t bytes = BITS == 4 ? 256 : 512;
    for (int r = 0; r < R; ++r) {
        const int64_t row = row0 + r;
        for (int64_t n = 0; n < TILE; ++n) {
            float acc = 0.0f;
            for (int64_t g = 0; g < x.groups; ++g) {
                const uint8_t *wg = w + g * bytes;
                const int8_t *q = x.q.data() + row * x.k + g * GROUP;
                int32_t s = 0;
                for (int64_t c = 0; c < CHUNKS; ++c)
                    for (int64_t j = 0; j < 4; ++j) {
                        const uint8_t byte = wg[64 * (BITS == 4 ? c / 2 : c) + 4 * n + j];
                        const int32_t u = BITS == 8 ? byte : c % 2 == 0 ? byte & 15 : byte >> 4;
                        s += u * q[4 * c + j];
                    }
                const int64_t at = row * x.groups + g;
                const float scale = static_cast<float>(d[g * TILE + n]) * x.scale[at];
                acc = std::fma(scale, static_cast<float>(s), acc);
                acc = std::fma(static_cast<float>(m[g * TILE + n]), x.offset[at], acc);
            }
            y[row * n_total + n] = acc;
        }
    }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__GNUC__)
#define LMI_QUANT_AMX 1
// AMX: blocks of 16 rows, a group at a time: TDPBSUD multiplies the block's int8 inputs (signed)
// by the tile's weights (unsigned) into int32 sums, as exact as vpdpbusd's; a tile's packed
// chunks are the B operand's layout as they are (4-bit ones unpacked once per tile). The sums of
// four groups go through memory together, then take `tile`'s float steps (add_group): the
// same bits. The float steps, not the multiplies, then bound the speed. Compiled into every
// VNNI build (an image's prebuilt ones too) and taken where the CPU has AMX-INT8.
#define LMI_AMX __attribute__((target("amx-tile,amx-int8")))
constexpr int64_t AMX_ROWS = 16, AMX_GROUPS = 4;

struct alignas(64) TileConfig {
    uint8_t palette = 1, start = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

bool amx_allowed() {
    // Linux gives a process AMX's tile state only once asked (ARCH_REQ_XCOMP_PERM, XTILEDATA).
    static const bool allowed = __builtin_cpu_supports("amx-tile") &&
                                __builtin_cpu_supports("amx-int8") &&
                                syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return allowed;
}

LMI_AMX void amx_configure() {
    TileConfig config;  // tiles 0-3: sums, 4-5: inputs, 6-7: weights
    for (int i = 0; i < 4; ++i) config.rows[i] = AMX_ROWS, config.colsb[i] = TILE * 4;
    for (int i = 4; i < 6; ++i) config.rows[i] = AMX_ROWS, config.colsb[i] = GROUP;
    for (int i = 6; i < 8; ++i) config.rows[i] = CHUNKS, config.colsb[i] = 64;
    _tile_loadconfig(&config);
}

using GroupSums = int32_t[AMX_GROUPS][AMX_ROWS][TILE];

// The sums of groups g0.. (up to four) of rows row0.. by the 8-bit weights `w`, into `sums`.
LMI_AMX void amx_sums(const uint8_t *w, const Rows &x, int64_t row0, int64_t g0, GroupSums &sums) {
    const int64_t count = std::min(AMX_GROUPS, x.groups - g0);
    const int8_t *q = x.q.data() + row0 * x.k + g0 * GROUP;
    // Tile numbers are immediates: one macro per group, inputs and weights in turns.
#define LMI_AMX_GROUP(i, in, wt)                            \
    if (i < count) {                                        \
        _tile_loadd(in, q + i * GROUP, x.k);                \
        _tile_loadd(wt, w + (g0 + i) * 512, 64);            \
        _tile_zero(i);                                      \
        _tile_dpbsud(i, in, wt);                            \
        _tile_stored(i, sums[i], TILE * 4);                 \
    }
    LMI_AMX_GROUP(0, 4, 6) LMI_AMX_GROUP(1, 5, 7) LMI_AMX_GROUP(2, 4, 6) LMI_AMX_GROUP(3, 5, 7)
#undef LMI_AMX_GROUP
}

LMI_AMX void amx_block(const uint8_t *w, const c10::Half *d, const c10::Half *m, const Rows &x,
                       int64_t row0, float *y, int64_t n_total, GroupSums &sums) {
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < x.groups; g0 += AMX_GROUPS) {
        amx_sums(w, x, row0, g0, sums);
        for (int64_t g = g0; g < std::min(g0 + AMX_GROUPS, x.groups); ++g) {
            const __m512 dv = sixteen(d + g * TILE), mv = sixteen(m + g * TILE);
            for (int r = 0; r < AMX_ROWS; ++r)
                acc[r] = add_group(acc[r], dv, mv, _mm512_loadu_si512(sums[g - g0][r]), x,
                                   (row0 + r) * x.groups + g);
        }
    }
    for (int r = 0; r < AMX_ROWS; ++r) _mm512_storeu_ps(y + (row0 + r) * n_total, acc[r]);
}

// A tile's 4-bit weights as 8-bit ones, in the same chunk order.
void unpack_tile(const uint8_t *w, int64_t groups, uint8_t *out) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t pair = 0; pair < groups * CHUNKS / 2; ++pair) {
        const __m512i both = _mm512_loadu_si512(w + 64 * pair);
        _mm512_storeu_si512(out + 128 * pair, _mm512_and_si512(both, low));
        _mm512_storeu_si512(out + 128 * pair + 64,
                            _mm512_and_si512(_mm512_srli_epi16(both, 4), low));
    }
}

// Tiles begin..end of the first `blocks` x 16 rows, on one thread (tile state is per thread).
template <int BITS>
LMI_AMX void amx_tiles(const Rows &x, int64_t blocks, const uint8_t *w, const c10::Half *d,
                       const c10::Half *m, int64_t tiles, float *y, int64_t begin, int64_t end) {
    amx_configure();
    alignas(64) GroupSums sums;
    std::vector<uint8_t> unpacked(BITS == 4 ? x.groups * 512 : 0);
    const int64_t tile_bytes = x.groups * (BITS == 4 ? 256 : 512);
    for (int64_t t = begin; t < end; ++t) {
        const uint8_t *wt = w + t * tile_bytes;
        if constexpr (BITS == 4) unpack_tile(wt, x.groups, unpacked.data());
        for (int64_t b = 0; b < blocks; ++b)
            amx_block(BITS == 4 ? unpacked.data() : wt, d + t * x.groups * TILE,
                      m + t * x.groups * TILE, x, b * AMX_ROWS, y + t * TILE, tiles * TILE, sums);
    }
    _tile_release();
}

// The first `blocks` x 16 rows by AMX; false where this CPU or process may not use it.
template <int BITS>
bool amx_run(const Rows &x, int64_t blocks, const uint8_t *w, const c10::Half *d,
             const c10::Half *m, int64_t tiles, float *y) {
    if (!amx_allowed()) return false;
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        amx_tiles<BITS>(x, blocks, w, d, m, tiles, y, begin, end);
    });
    return true;
}
#endif

// RMSNorm of a row of k: x * (1 / sqrt(mean(x^2) + eps)) * w, in float32. The squares add up
// in 16 lanes (element i in lane i % 16, in order, fused multiply-adds), the lanes then in one
// tree (l with l + 8, then + 4, + 2, + 1): a row's norm depends on that row alone and has the
// same bits in every build, eager pass or compiled step (the inputs' int8 rounding turns norms
// ~1e-7 apart into different logits). torch's kernel, five ops, took ~28 us a call: a fifth of
// a one-row step.
void norm_row(const float *x, const float *w, float eps, int64_t k, float *y) {
    alignas(64) float lanes[16] = {};
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    _mm512_store_ps(lanes, acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
    for (; i + 16 <= k; i += 16) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        low = _mm256_fmadd_ps(a, a, low);
        high = _mm256_fmadd_ps(b, b, high);
    }
    _mm256_store_ps(lanes, low);
    _mm256_store_ps(lanes + 8, high);
#endif
    for (; i < k; ++i) lanes[i % 16] = std::fma(x[i], x[i], lanes[i % 16]);
    for (int width = 8; width >= 1; width /= 2)
        for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
    const float r = 1.0f / std::sqrt(lanes[0] / static_cast<float>(k) + eps);
    for (int64_t j = 0; j < k; ++j) y[j] = x[j] * r * w[j];
}

// `input` [..., k] by norm_row with `weight` [k], as float32.
at::Tensor norm_rows(const at::Tensor &input, const at::Tensor &weight, double eps) {
    const at::Tensor x = input.contiguous().to(at::kFloat), w = weight.contiguous().to(at::kFloat);
    const int64_t k = x.size(-1), rows = x.numel() / std::max<int64_t>(k, 1);
    TORCH_CHECK(w.numel() == k, "rms_norm: the weight has ", w.numel(), " elements, rows ", k);
    at::Tensor out = at::empty(x.sizes(), x.options());
    const float *from = x.data_ptr<float>(), *scale = w.data_ptr<float>();
    float *to = out.data_ptr<float>();
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {  // a decode step's: one thread
        for (int64_t row = begin; row < end; ++row)
            norm_row(from + row * k, scale, static_cast<float>(eps), k, to + row * k);
    });
    return out;
}

// The norm alone (a layer's output before the LM head), in the input's dtype.
at::Tensor rms_norm(const at::Tensor &input, const at::Tensor &weight, double eps) {
    return norm_rows(input, weight, eps).to(input.scalar_type());
}

template <int BITS>
void run(const Rows &x, int64_t rows, const uint8_t *w, const c10::Half *d, const c10::Half *m,
         int64_t tiles, float *y) {
    const int64_t n_total = tiles * TILE;
    const int64_t tile_bytes = x.groups * (BITS == 4 ? 256 : 512);
    int64_t first = 0;  // the rows AMX computed
#ifdef LMI_QUANT_AMX
    if (rows >= AMX_ROWS && amx_run<BITS>(x, rows / AMX_ROWS, w, d, m, tiles, y))
        first = rows / AMX_ROWS * AMX_ROWS;
#endif
    if (first == rows) return;
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            const uint8_t *wt = w + t * tile_bytes;
            const c10::Half *dt = d + t * x.groups * TILE, *mt = m + t * x.groups * TILE;
            float *yt = y + t * TILE;
            int64_t row = first;
            for (; row + ROWS <= rows; row += ROWS) tile<ROWS, BITS>(wt, dt, mt, x, row, yt, n_total);
            for (; row < rows; ++row) tile<1, BITS>(wt, dt, mt, x, row, yt, n_total);
        }
    });
}

// `norm` (optional): the layer's input is RMSNorm(input) by that weight and `eps` (norm_rows),
// computed here where a compiled step would generate its own reduction.
at::Tensor quant_linear(const at::Tensor &input, const at::Tensor &weights,
                        const at::Tensor &scales, const at::Tensor &mins, int64_t bits,
                        const std::optional<at::Tensor> &norm, double eps) {
    TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8");
    TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16,
                "quant_linear: the input must be float32 or bfloat16");
    TORCH_CHECK(weights.scalar_type() == at::kByte && weights.dim() == 3 && weights.is_contiguous(),
                "quant_linear: weights must be uint8 [tiles, groups, bytes], contiguous");
    const int64_t tiles = weights.size(0), groups = weights.size(1), k = groups * GROUP;
    TORCH_CHECK(weights.size(2) == (bits == 4 ? 256 : 512), "quant_linear: bad tile size");
    TORCH_CHECK(input.size(-1) == k, "quant_linear: the input has ", input.size(-1),
                " features, the weights ", k);
    for (const at::Tensor *t : {&scales, &mins})
        TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->numel() == tiles * groups * TILE,
                    "quant_linear: scales and mins must be float16 [tiles, groups, 16], contiguous");
    // bf16 comes in as it is and goes out rounded to bf16, as an op of that dtype would: a
    // compiled graph then cannot skip the roundings an eager pass makes around the op.
    const at::Tensor x = norm ? norm_rows(input, *norm, eps) : input.contiguous().to(at::kFloat);
    const int64_t rows = x.numel() / k;
    std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
    shape.back() = tiles * TILE;
    at::Tensor out = at::empty(shape, x.options());
    if (rows == 0) return out.to(input.scalar_type());
    const Rows quantized = quantize(x.data_ptr<float>(), rows, k);
    const auto *d = scales.data_ptr<c10::Half>(), *m = mins.data_ptr<c10::Half>();
    if (bits == 4)
        run<4>(quantized, rows, weights.data_ptr<uint8_t>(), d, m, tiles, out.data_ptr<float>());
    else
        run<8>(quantized, rows, weights.data_ptr<uint8_t>(), d, m, tiles, out.data_ptr<float>());
    return out.to(input.scalar_type());
}

}  // namespace

TORCH_LIBRARY(lmi_quant, m) {
    m.def("quant_linear(Tensor input, Tensor weights, Tensor scales, Tensor mins, int bits, "
          "Tensor? norm=None, float eps=0.0) -> Tensor");
    m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(lmi_quant, CPU, m) {
    m.impl("quant_linear", &quant_linear);
    m.impl("rms_norm", &rms_norm);
}
