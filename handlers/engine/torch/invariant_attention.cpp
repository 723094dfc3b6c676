// lmi::slot_attention: attention over the slot KV cache whose result for a query depends on that
// query, its head and the keys it sees, and on nothing else: not the batch's size or padded
// length, not the query's place in its chunk, not the slot, not the thread count
// (invariant_attention.py says why). Every (query, head) goes through the same steps in the
// same order over exactly its own keys; a task computes several queries of one row to share the
// loads, never the arithmetic. The vector code is written out (GCC vector extensions), so no
// compiler-chosen remainder or alignment peeling depends on where a row sits in memory. Where
// the CPU has AVX512-BF16, a bf16 model's scores come from its paired dot products over the
// cache's bf16 keys as they are (no widening pass): 1.75x the kernel's speed over cached keys
// at 32 rows (AMD EPYC Zen 4), and a 32-row SmolLM2 decode step ~6% shorter. A float16 or
// float8 cache (option.kv_cache_dtype) is widened to float32 as it is read, exactly: the
// arithmetic after is the float32 cache's.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <array>
#include <memory>
#include <type_traits>
#if defined(__AVX512BF16__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
const int64_t TILE = 16;   // keys one score vector holds
const int64_t BLOCK = 16;  // queries of a row one task computes
const int64_t AHEAD = 2;   // tiles of keys asked for ahead of the one scored
// A vector register's floats, and how many registers of sums per pair weighted_alike holds over
// all the keys: 4 x 16 fill half of AVX-512's 32 registers, 2 x 8 under half of AVX2's 16. GCC
// builds 64-byte vectors from two 32-byte registers on AVX2 but moves them through memory in
// loops like that one, several times slower.
#ifdef __AVX512F__
typedef float vreg __attribute__((vector_size(64)));
const int SPAN = 4;
#elif defined(__AVX2__)
typedef float vreg __attribute__((vector_size(32)));
const int SPAN = 2;
#else
typedef float vreg __attribute__((vector_size(16)));
const int SPAN = 2;
#endif
const int64_t REG = sizeof(vreg) / sizeof(float);

inline vreg load_reg(const float *p) {
    vreg v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

inline v16 load(const float *p) {
    v16 v;
    std::memcpy(&v, p, 64);
    return v;
}

typedef uint16_t u16 __attribute__((vector_size(32)));
const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};  // a key's place in its tile

inline v16 load16(const float *p) { return load(p); }

inline v16 load16(const at::BFloat16 *p) {  // bfloat16 is the upper half of a float32
    u16 h;
    std::memcpy(&h, p, 32);
    i16 bits = __builtin_convertvector(h, i16) << 16;
    v16 v;
    std::memcpy(&v, &bits, 64);
    return v;
}

// float16: the CPU's conversion where it has one (F16C; AVX-512's 16 lanes at once), else c10's.
inline v16 load16(const at::Half *p) {
    v16 v;
#if defined(__AVX512F__)
    __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
    std::memcpy(&v, &wide, 64);
#elif defined(__F16C__)
    __m256 low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
    __m256 high = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p + 8)));
    std::memcpy(&v, &low, 32);
    std::memcpy(reinterpret_cast<char *>(&v) + 32, &high, 32);
#else
    for (int i = 0; i < 16; i++) v[i] = static_cast<float>(p[i]);
#endif
    return v;
}

// float8: each of the 256 bytes' float32 value, looked up.
template <typename F8>
const std::array<float, 256> &float8_values() {
    static const std::array<float, 256> values = [] {
        std::array<float, 256> table{};
        for (int b = 0; b < 256; b++)
            table[b] = static_cast<float>(F8(static_cast<uint8_t>(b), F8::from_bits()));
        return table;
    }();
    return values;
}

template <typename F8>
inline v16 load_float8(const F8 *p) {
    const std::array<float, 256> &values = float8_values<F8>();
    v16 v;
    for (int i = 0; i < 16; i++) v[i] = values[p[i].x];
    return v;
}

inline v16 load16(const at::Float8_e4m3fn *p) { return load_float8(p); }

inline v16 load16(const at::Float8_e5m2 *p) { return load_float8(p); }

// Two vectors' lanes folded in half, in 16/(2*width) groups: a group's first half holds
// a[l] + a[l + width] for a's lanes l of the group, its second half the same for c.
#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2 holds a vector of 16 floats in two registers, where GCC builds the folds' shuffles from
// single elements and passes the vectors through memory: dot products keep their 16 lanes as
// the two registers, folded register by register. Each lane's sum is the same (hadd's
// a[l] + a[l + 1] too: float addition commutes), so the bits are every other build's.
struct Lanes16 {
    __m256 low, high;  // lanes 0-7, 8-15
};

inline Lanes16 load_lanes(const float *p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }

inline Lanes16 multiply_add(Lanes16 q, Lanes16 k, Lanes16 acc) {
    return {_mm256_fmadd_ps(q.low, k.low, acc.low), _mm256_fmadd_ps(q.high, k.high, acc.high)};
}

inline v16 as_v16(Lanes16 x) {
    v16 v;
    std::memcpy(&v, &x.low, 32);
    std::memcpy(reinterpret_cast<char *>(&v) + 32, &x.high, 32);
    return v;
}

template <int width>  // one register of fold<width>(a, c) from the same register of a and of c
inline __m256 fold_register(__m256 a, __m256 c) {
    if constexpr (width == 4)
        return _mm256_add_ps(_mm256_permute2f128_ps(a, c, 0x20),
                             _mm256_permute2f128_ps(a, c, 0x31));
    if constexpr (width == 2) {
        __m256d a2 = _mm256_castps_pd(a), c2 = _mm256_castps_pd(c);
        return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a2, c2)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(a2, c2)));
    }
    return _mm256_permute_ps(_mm256_hadd_ps(a, c), 0xD8);  // width 1: lanes 0, 2, 1, 3
}

template <int width>
inline Lanes16 fold(Lanes16 a, Lanes16 c) {
    if constexpr (width == 8)
        return {_mm256_add_ps(a.low, a.high), _mm256_add_ps(c.low, c.high)};
    else
        return {fold_register<width>(a.low, c.low), fold_register<width>(a.high, c.high)};
}
#else
template <int width>
inline v16 fold(v16 a, v16 c) {
    static const int round = width == 8 ? 0 : width == 4 ? 1 : width == 2 ? 2 : 3;
    static const i16 first[4] = {
        {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
        {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
        {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
        {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
    static const i16 second[4] = {
        {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
        {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
        {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
        {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};
    return __builtin_shuffle(a, c, first[round]) + __builtin_shuffle(a, c, second[round]);
}

typedef v16 Lanes16;

inline v16 load_lanes(const float *p) { return load(p); }

inline v16 multiply_add(v16 q, v16 k, v16 acc) { return acc + q * k; }  // contracted: an FMA

inline v16 as_v16(v16 x) { return x; }
#endif

inline float widen(float x) { return x; }

inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

inline float widen(at::Half x) { return static_cast<float>(x); }

inline float widen(at::Float8_e4m3fn x) { return float8_values<at::Float8_e4m3fn>()[x.x]; }

inline float widen(at::Float8_e5m2 x) { return float8_values<at::Float8_e5m2>()[x.x]; }

inline void narrow(float x, float *to) { *to = x; }

inline void narrow(float x, at::BFloat16 *to) { *to = at::BFloat16(x); }  // nearest even

inline float tree_sum(v16 v) {
    for (int width = 8; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) v[i] += v[i + width];
    return v[0];
}

// exp(x) for x <= 0: 2^i * p(f) with t = x * log2(e) = i + f, |f| <= 1/2, p a degree-6
// polynomial (relative error ~1e-7); below -87 it is taken at -87 (~1e-38, nothing to a sum).
inline v16 exp_nonpositive(v16 x) {
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

struct Shape {
    int64_t queries, heads, kv_heads, size;  // per row: T, H, H_kv, D
    int64_t q_row, q_head, q_step;           // query strides
    int64_t kv_row, kv_head;                 // key/value strides (positions `size` apart)
    float scale;
};

struct Room {  // one thread's scratch, left uninitialised: every use writes before it reads
    std::unique_ptr<float[]> queries, tile, sums, scores, inverse;
    std::unique_ptr<at::BFloat16[]> queries16, tile16;  // bf16 queries and keys as they are
    Room(int64_t pairs, int64_t size, int64_t keys)
        : queries(new float[pairs * size]), tile(new float[size * TILE]),  // keys or values
          sums(new float[pairs * size]), scores(new float[pairs * keys]),
          inverse(new float[pairs]), queries16(new at::BFloat16[pairs * size]),
          tile16(new at::BFloat16[size * TILE]) {}
};

// Keys j0.. as float32 rows of d (rows past `count` zero): the cache's own rows where it
// holds float32 and the tile is whole, else widened into `tile`.
inline const float *key_rows(const float *k, int64_t j0, int64_t count, int64_t d, float *tile) {
    if (count == TILE) return k + j0 * d;
    std::memcpy(tile, k + j0 * d, count * d * sizeof(float));
    std::fill(tile + count * d, tile + TILE * d, 0.0f);
    return tile;
}

template <typename C>  // a 16-bit or 8-bit cache
inline const float *key_rows(const C *k, int64_t j0, int64_t count, int64_t d, float *tile) {
    for (int64_t j = 0; j < TILE; j++) {
        int64_t i = 0;
        for (; j < count && i + 16 <= d; i += 16) {
            v16 row = load16(k + (j0 + j) * d + i);
            std::memcpy(tile + j * d + i, &row, 64);
        }
        for (; i < d; i++) tile[j * d + i] = j < count ? widen(k[(j0 + j) * d + i]) : 0.0f;
    }
    return tile;
}

// lane i % 16 of a (query, key) dot product: its elements i, i + 16, ... in order.
inline Lanes16 lanes(const Lanes16 *q, const float *key, int64_t chunks) {
    Lanes16 acc = {};
    for (int64_t c = 0; c < chunks; c++) acc = multiply_add(q[c], load_lanes(key + 16 * c), acc);
    return acc;
}

// The node of fold_keys' tree over the keys in places first..first + 16 / width - 1 of its
// bit-reversed order, its two halves folded first.
template <int width, typename Lanes>
inline auto folded(Lanes &lanes_of, int first) {
    static const int reversed[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    if constexpr (width == 8)
        return fold<8>(lanes_of(reversed[first]), lanes_of(reversed[first + 1]));
    else
        return fold<width>(folded<width * 2>(lanes_of, first),
                           folded<width * 2>(lanes_of, first + 8 / width));
}

// 16 keys' dot products from their lane vectors (`lanes_of(j)`: key j's partial sums): each
// key's 16 lanes summed in one tree (l with l + 8, then + 4, + 2, + 1), the keys taken in
// bit-reversed order so that the folds leave key j in lane j. Depth first, so that few partial
// folds wait at a time (AVX2's 16 registers hold them).
template <typename Lanes>
inline v16 fold_keys(Lanes lanes_of) {
    return as_v16(folded<1>(lanes_of, 0));
}

// One query's dot products with 16 float32 key rows (fold_keys); elements past the last whole
// 16 added after, in order.
inline v16 dots(const float *q, const float *rows, int64_t d) {
    int64_t chunks = d / 16;
    Lanes16 qv[16];  // d <= 256
    for (int64_t c = 0; c < chunks; c++) qv[c] = load_lanes(q + 16 * c);
    v16 sum = fold_keys([&](int j) { return lanes(qv, rows + j * d, chunks); });
    for (int64_t i = chunks * 16; i < d; i++)  // std::fma: GCC fused `+= *` here in some builds
        for (int64_t j = 0; j < TILE; j++) sum[j] = std::fma(q[i], rows[j * d + i], sum[j]);
    return sum;
}

#ifdef __AVX512BF16__
const bool PAIRED = true;

// The same for a bf16 query and bf16 keys, d a multiple of 32, read as they are: lane l of a
// key's partial sums adds the products of elements 2l and 2l + 1 of every 32, in order
// (AVX512-BF16's dot product of pairs; the products of two bf16 are exact in float32).
inline v16 dots(const at::BFloat16 *q, const at::BFloat16 *rows, int64_t d) {
    int64_t chunks = d / 32;
    __m512bh qv[8];  // d <= 256
    for (int64_t c = 0; c < chunks; c++) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
    return fold_keys([&](int j) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c++) {
            __m512bh key = (__m512bh)_mm512_loadu_si512(rows + j * d + 32 * c);
            acc = _mm512_dpbf16_ps(acc, qv[c], key);
        }
        return (v16)acc;
    });
}
#else
const bool PAIRED = false;

inline v16 dots(const at::BFloat16 *, const at::BFloat16 *, int64_t) { return v16{}; }  // unused
#endif

// Whether a pass over bf16 queries and keys with heads of `d` takes the paired path: by the
// model's shape and the CPU only, so the same for every query of a model on a machine.
template <typename Q, typename C>
inline bool paired(int64_t d) {
    return PAIRED && std::is_same_v<Q, at::BFloat16> && std::is_same_v<C, at::BFloat16> &&
           d % 32 == 0;
}

// Keys j0.. as bf16 rows of d where the tile is whole, else copied into `tile` with the rows
// past `count` zero: what lies past the view is not read.
inline const at::BFloat16 *raw_rows(const at::BFloat16 *k, int64_t j0, int64_t count, int64_t d,
                                    at::BFloat16 *tile) {
    if (count == TILE) return k + j0 * d;
    std::memcpy(tile, k + j0 * d, count * d * sizeof(at::BFloat16));
    std::fill(tile + count * d, tile + TILE * d, at::BFloat16(0.0f));
    return tile;
}

// Asks for a tile's rows (keys from..from + TILE) to be brought into the cache: the cache's
// rows of a (row, head) are read from memory once a pass, too few for the prefetchers to
// ramp up before the reads catch up with them.
template <typename C>
inline void prefetch(const C *rows, int64_t from, int64_t most, int64_t d) {
    const char *at = reinterpret_cast<const char *>(rows + from * d);
    int64_t bytes = (std::min(from + TILE, most) - from) * d * sizeof(C);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(at + b, 0, 3);
}

// Scores of one task's (query, head) pairs, 16 keys at a time; a pair's score for a key is its
// dot product (dots) times the scale, whatever the other pairs are. The values are asked for
// as their keys are scored, to be in the cache for `weighted`.
template <typename Q, typename C>
void scores(const C *k, const C *v, const int64_t *counts, int64_t pairs, int64_t group,
            int64_t most, int64_t d, float scale, int64_t keys, Room &room) {
    for (int64_t j0 = 0; j0 < most; j0 += TILE) {
        int64_t count = std::min(TILE, most - j0);
        prefetch(k, j0 + AHEAD * TILE, most, d);
        prefetch(v, j0, most, d);
        const float *rows = nullptr;
        const at::BFloat16 *raw = nullptr;
        if constexpr (std::is_same_v<C, at::BFloat16>)
            if (paired<Q, C>(d)) raw = raw_rows(k, j0, count, d, room.tile16.get());
        if (raw == nullptr) rows = key_rows(k, j0, count, d, room.tile.get());
        for (int64_t p = 0; p < pairs; p++) {
            int64_t n = counts[p / group];
            if (j0 >= n) continue;
            v16 sum = raw ? dots(room.queries16.get() + p * d, raw, d)
                          : dots(room.queries.get() + p * d, rows, d);
            sum *= scale;
            if (j0 + TILE > n)  // the keys past the query's own score -inf
                sum = lane + static_cast<float>(j0) < static_cast<float>(n) ? sum : (v16){} - INFINITY;
            std::memcpy(room.scores.get() + p * keys + j0, &sum, 64);
        }
    }
}

// Softmax weights in place, each pair over its own keys (rounded up to 16 with exp(-inf) = 0).
void softmax(const int64_t *counts, int64_t pairs, int64_t group, int64_t keys, Room &room) {
    for (int64_t p = 0; p < pairs; p++) {
        int64_t n = counts[p / group], padded = (n + TILE - 1) / TILE * TILE;
        float *row = room.scores.get() + p * keys, top = -INFINITY;
        v16 most = (v16){} - INFINITY;  // past n the scores are -inf: the padded max is the max
        for (int64_t j = 0; j < padded; j += TILE) {
            v16 x = load(row + j);
            most = x > most ? x : most;
        }
        for (int64_t j = 0; j < TILE; j++) top = most[j] > top ? most[j] : top;
        v16 total = {};
        for (int64_t j = 0; j < padded; j += TILE) {
            v16 e = exp_nonpositive(load(row + j) - top);
            std::memcpy(row + j, &e, 64);
            total += e;
        }
        room.inverse[p] = n > 0 ? 1.0f / tree_sum(total) : 0.0f;
    }
}

// The weighted sums of values, in key order for every pair: 16 values at a time (widened once
// for the task's pairs), each pair's sums held in registers across them.
template <typename C>
void weighted(const C *v, const int64_t *counts, int64_t pairs, int64_t group, int64_t most,
              int64_t d, int64_t keys, Room &room) {
    std::fill(room.sums.get(), room.sums.get() + pairs * d, 0.0f);
    float *values = room.tile.get();  // [TILE, d]
    for (int64_t j0 = 0; j0 < most; j0 += TILE) {
        int64_t count = std::min(TILE, most - j0);
        for (int64_t j = 0; j < count; j++) {
            int64_t i = 0;
            for (; i + 16 <= d; i += 16) {
                v16 row = load16(v + (j0 + j) * d + i);
                std::memcpy(values + j * d + i, &row, 64);
            }
            for (; i < d; i++) values[j * d + i] = widen(v[(j0 + j) * d + i]);
        }
        for (int64_t p = 0; p < pairs; p++) {
            int64_t upto = std::min(count, counts[p / group] - j0);
            const float *weights = room.scores.get() + p * keys + j0;
            float *sum = room.sums.get() + p * d;
            int64_t i = 0;
            for (; i + 64 <= d; i += 64) {  // 64 sums in registers
                vreg acc[64 / REG];
                for (int c = 0; c < 64 / REG; c++) acc[c] = load_reg(sum + i + REG * c);
                for (int64_t j = 0; j < upto; j++)
                    for (int c = 0; c < 64 / REG; c++)
                        acc[c] += weights[j] * load_reg(values + j * d + i + REG * c);
                for (int c = 0; c < 64 / REG; c++)
                    std::memcpy(sum + i + REG * c, &acc[c], sizeof(vreg));
            }
            for (; i + REG <= d; i += REG) {
                vreg acc = load_reg(sum + i);
                for (int64_t j = 0; j < upto; j++) acc += weights[j] * load_reg(values + j * d + i);
                std::memcpy(sum + i, &acc, sizeof(vreg));
            }
            for (; i < d; i++)  // std::fma: as the vectors above, in every build
                for (int64_t j = 0; j < upto; j++)
                    sum[i] = std::fma(weights[j], values[j * d + i], sum[i]);
        }
    }
}

// The weighted sums of `pairs` pairs (at most 4) that see the same n keys, for d a multiple of
// 64: REG * SPAN elements at a time, held in registers over all the keys, each value row
// widened once for all the pairs. The same arithmetic, key by key, as `weighted` (decoding's
// case: one query a task).
template <int pairs>
void weighted_alike(const float *v, int64_t n, int64_t d, int64_t keys, const float *weights,
                    float *sums) {
    for (int64_t i = 0; i < d; i += REG * SPAN) {
        vreg acc[pairs][SPAN] = {};
        for (int64_t j = 0; j < n; j++) {
            vreg row[SPAN];
            for (int c = 0; c < SPAN; c++) row[c] = load_reg(v + j * d + i + REG * c);
            for (int p = 0; p < pairs; p++)
                for (int c = 0; c < SPAN; c++) acc[p][c] += weights[p * keys + j] * row[c];
        }
        for (int p = 0; p < pairs; p++)
            for (int c = 0; c < SPAN; c++)
                std::memcpy(sums + p * d + i + REG * c, &acc[p][c], sizeof(vreg));
    }
}

// bf16 values: a vector of 32 read at once, its even elements widened by a shift and its odd
// ones by a mask, so acc[p][2h] holds elements 32h + 2l in lane l and acc[p][2h + 1] elements
// 32h + 2l + 1; interleaved back at the end. Each element's sum is the one above.
template <int pairs>
void weighted_alike(const at::BFloat16 *v, int64_t n, int64_t d, int64_t keys,
                    const float *weights, float *sums) {
    static const i16 high = (i16){} - 65536, low_half = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5,
                                                         21, 6, 22, 7, 23};
    static const i16 high_half = low_half + 8;
    for (int64_t i = 0; i < d; i += 64) {
        v16 acc[pairs][4] = {};
        for (int64_t j = 0; j < n; j++) {
            v16 row[4];
            for (int h = 0; h < 2; h++) {
                i16 bits;
                std::memcpy(&bits, v + j * d + i + 32 * h, 64);
                i16 even = bits << 16, odd = bits & high;
                std::memcpy(&row[2 * h], &even, 64);
                std::memcpy(&row[2 * h + 1], &odd, 64);
            }
            for (int p = 0; p < pairs; p++)
                for (int c = 0; c < 4; c++) acc[p][c] += weights[p * keys + j] * row[c];
        }
        for (int p = 0; p < pairs; p++)
            for (int h = 0; h < 2; h++) {
                v16 first = __builtin_shuffle(acc[p][2 * h], acc[p][2 * h + 1], low_half);
                v16 second = __builtin_shuffle(acc[p][2 * h], acc[p][2 * h + 1], high_half);
                std::memcpy(sums + p * d + i + 32 * h, &first, 64);
                std::memcpy(sums + p * d + i + 32 * h + 16, &second, 64);
            }
    }
}

template <typename C>
void weighted_alike(const C *v, int64_t n, int64_t pairs, int64_t d, int64_t keys, Room &room) {
    for (int64_t p = 0; p < pairs; p += 4) {
        const float *weights = room.scores.get() + p * keys;
        float *sums = room.sums.get() + p * d;
        switch (std::min<int64_t>(4, pairs - p)) {
            case 1: weighted_alike<1>(v, n, d, keys, weights, sums); break;
            case 2: weighted_alike<2>(v, n, d, keys, weights, sums); break;
            case 3: weighted_alike<3>(v, n, d, keys, weights, sums); break;
            default: weighted_alike<4>(v, n, d, keys, weights, sums);
        }
    }
}

// One task: queries t0..t0+width-1 of row b, with the query heads of KV head h.
template <typename Q, typename C>
void task(const Q *q, const C *k, const C *v, const int64_t *counts, Q *out, const Shape &s,
          int64_t b, int64_t h, int64_t t0, int64_t width, int64_t keys, Room &room) {
    int64_t group = s.heads / s.kv_heads, pairs = width * group, d = s.size, most = 0;
    counts += b * s.queries + t0;
    for (int64_t t = 0; t < width; t++) most = counts[t] > most ? counts[t] : most;
    const Q *first = q + b * s.q_row + h * group * s.q_head + t0 * s.q_step;
    bool raw = paired<Q, C>(d);
    for (int64_t t = 0; t < width; t++)
        for (int64_t g = 0; g < group; g++) {
            const Q *from = first + t * s.q_step + g * s.q_head;
            int64_t to = (t * group + g) * d;
            if constexpr (std::is_same_v<Q, at::BFloat16>)
                if (raw) {
                    std::memcpy(room.queries16.get() + to, from, d * sizeof(Q));
                    continue;
                }
            for (int64_t i = 0; i < d; i++) room.queries[to + i] = widen(from[i]);
        }
    int64_t at = b * s.kv_row + h * s.kv_head;
    scores<Q>(k + at, v + at, counts, pairs, group, most, d, s.scale, keys, room);
    softmax(counts, pairs, group, keys, room);
    bool alike = false;  // weighted_alike reads float32 and bf16 values as they are
    if constexpr (std::is_same_v<C, float> || std::is_same_v<C, at::BFloat16>)
        if (width == 1 && d % 64 == 0) {
            weighted_alike(v + at, counts[0], pairs, d, keys, room);
            alike = true;
        }
    if (!alike) weighted(v + at, counts, pairs, group, most, d, keys, room);
    Q *o = out + ((b * s.queries + t0) * s.heads + h * group) * d;
    for (int64_t t = 0; t < width; t++)
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < d; i++)
                narrow(room.sums[(t * group + g) * d + i] * room.inverse[t * group + g],
                       o + t * s.heads * d + g * d + i);
}

template <typename Q, typename C>
void attend(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,
            const at::Tensor &counts, at::Tensor &out, const Shape &s) {
    int64_t rows = query.size(0), blocks = (s.queries + BLOCK - 1) / BLOCK;
    const int64_t *seen = counts.data_ptr<int64_t>();
    int64_t most = 0;
    for (int64_t i = 0; i < rows * s.queries; i++) most = seen[i] > most ? seen[i] : most;
    int64_t keys = (most + TILE - 1) / TILE * TILE, group = s.heads / s.kv_heads;
    int64_t tasks = rows * s.kv_heads * blocks;
    const Q *q = query.data_ptr<Q>();
    const C *k = key.data_ptr<C>(), *v = value.data_ptr<C>();
    Q *o = out.data_ptr<Q>();
#pragma omp parallel num_threads(at::get_num_threads())
    {
        Room room(std::min(BLOCK, s.queries) * group, s.size, keys);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            int64_t b = t / (s.kv_heads * blocks), h = t / blocks % s.kv_heads;
            int64_t t0 = t % blocks * BLOCK, width = std::min(BLOCK, s.queries - t0);
            task(q, k, v, seen, o, s, b, h, t0, width, keys, room);
        }
    }
}

template <typename Q>
void with_cache(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,
                const at::Tensor &counts, at::Tensor &out, const Shape &s) {
    switch (key.scalar_type()) {
        case at::kFloat: attend<Q, float>(query, key, value, counts, out, s); break;
        case at::kBFloat16: attend<Q, at::BFloat16>(query, key, value, counts, out, s); break;
        case at::kHalf: attend<Q, at::Half>(query, key, value, counts, out, s); break;
        case at::kFloat8_e4m3fn:
            attend<Q, at::Float8_e4m3fn>(query, key, value, counts, out, s);
            break;
        case at::kFloat8_e5m2: attend<Q, at::Float8_e5m2>(query, key, value, counts, out, s); break;
        default:
            TORCH_CHECK(false, "slot_attention: a float32, bfloat16, float16 or float8 cache only");
    }
}

// query: [B, H, T, D] (D contiguous); key, value: [B, H_kv, S, D] (each head's positions one
// after another); counts: [B, T] int64, how many keys (a prefix) each query sees, 0: none.
// Returns [B, T, H, D] in the query's dtype; float32 or bfloat16 queries, a float32, bfloat16,
// float16 or float8 (e4m3fn, e5m2) cache.
at::Tensor slot_attention(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,
                          const at::Tensor &counts, double scale) {
    TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.sizes() == key.sizes(),
                "slot_attention: query [B, H, T, D], key and value [B, H_kv, S, D]");
    int64_t d = query.size(3);
    TORCH_CHECK(key.size(0) == query.size(0) && key.size(3) == d &&
                    query.size(1) % key.size(1) == 0, "slot_attention: mismatched shapes");
    TORCH_CHECK(d <= 256, "slot_attention: head size over 256");  // dots' query registers
    TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && key.stride(2) == d &&
                    value.strides() == key.strides(), "slot_attention: unsupported strides");
    TORCH_CHECK(counts.scalar_type() == at::kLong && counts.is_contiguous() &&
                    counts.size(0) == query.size(0) && counts.size(1) == query.size(2),
                "slot_attention: counts must be contiguous int64 [B, T]");
    TORCH_CHECK(value.scalar_type() == key.scalar_type(), "slot_attention: key/value dtypes");
    Shape s{query.size(2), query.size(1), key.size(1), d, query.stride(0), query.stride(1),
            query.stride(2), key.stride(0), key.stride(1), static_cast<float>(scale)};
    at::Tensor out = at::empty({query.size(0), query.size(2), query.size(1), d}, query.options());
    bool q16 = query.scalar_type() == at::kBFloat16;
    TORCH_CHECK(q16 || query.scalar_type() == at::kFloat,
                "slot_attention: float32 or bfloat16 queries only");
    if (q16) with_cache<at::BFloat16>(query, key, value, counts, out, s);
    else with_cache<float>(query, key, value, counts, out, s);
    return out;
}

}  // namespace

TORCH_LIBRARY(lmi, m) {
    m.def("slot_attention(Tensor query, Tensor key, Tensor value, Tensor counts, float scale) "
          "-> Tensor");
}

TORCH_LIBRARY_IMPL(lmi, CPU, m) { m.impl("slot_attention", &slot_attention); }
