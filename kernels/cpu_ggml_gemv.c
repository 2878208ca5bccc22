/* y = x · Wᵀ with W in one of llama.cpp's block types, read packed: the CPU's decode GEMV.
 *
 * A decode step multiplies one activation row (or a few) by every weight matrix once, so its time is
 * the time to read the weights. float32 weights are 4 bytes each; Q8_0 is 34 bytes per 32 weights
 * (1.06 bytes each), Q4_0 18 bytes per 32 (0.56). Dequantizing a whole matrix to float32 first, as
 * the torch fallback does, reads the packed bytes *and* writes and reads a float32 copy: slower than
 * never quantizing. This kernel reads each block once and multiplies it where it lands, in vector
 * registers:
 *
 *     y[m][n] = Σ_b d[n][b] · Σ_j q[n][b][j] · x[m][32 b + j]          (Q4_0: q − 8)
 *
 * The inner sum is four 8-wide fused multiply-adds per block: bytes widened to int32, converted to
 * float, multiplied with x. Activations stay float32 (llama.cpp quantizes them to 8 bits too, and
 * multiplies integers; that is faster still and changes the result: not done here), so y differs
 * from the dequantize-then-multiply reference only by the order of the float additions.
 *
 * Work is split over output rows n, one OpenMP thread each at a time; the m rows of x (a decode
 * batch) are looped inside, while row n's blocks are in the L1 cache. With AVX2 (x86-64-v3 and every
 * later x86 CPU) the inner sums use the intrinsics below; elsewhere the same sums in plain C.
 * kernels/cpu_ggml_gemv.py builds this file on first use and calls it with ctypes.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define GGML_GEMV_AVX2 1
#endif

#define QK 32

/* IEEE half → float, every case (subnormals, infinities, NaN) */
static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef GGML_GEMV_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    float out;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else {
        out = (float)man * (1.0f / 16777216.0f); /* subnormal: man · 2^-24 */
        return sign ? -out : out;
    }
    memcpy(&out, &bits, 4);
    return out;
#endif
}

#ifdef GGML_GEMV_AVX2
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* 8 signed bytes → 8 floats */
static inline __m256 widen_i8(__m128i bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

/* 8 unsigned bytes → 8 floats */
static inline __m256 widen_u8(__m128i bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

/* Σ_j q[j] · x[j] over one Q8_0 block, as 8 partial sums */
static inline __m256 q8_0_block(const uint8_t *codes, const float *x) {
    __m256i q = _mm256_loadu_si256((const __m256i *)codes);
    __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
    __m256 s = _mm256_mul_ps(widen_i8(q0), _mm256_loadu_ps(x));
    s = _mm256_fmadd_ps(widen_i8(_mm_srli_si128(q0, 8)), _mm256_loadu_ps(x + 8), s);
    s = _mm256_fmadd_ps(widen_i8(q1), _mm256_loadu_ps(x + 16), s);
    return _mm256_fmadd_ps(widen_i8(_mm_srli_si128(q1, 8)), _mm256_loadu_ps(x + 24), s);
}

/* Σ_j (q[j] − 8) · x[j] over one Q4_0 block: weight j in the low nibble of byte j, 16 + j in its
 * high nibble */
static inline __m256 q4_0_block(const uint8_t *codes, const float *x) {
    const __m128i nibble = _mm_set1_epi8(15);
    const __m256 eight = _mm256_set1_ps(8.0f);
    __m128i raw = _mm_loadu_si128((const __m128i *)codes);
    __m128i lo = _mm_and_si128(raw, nibble), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
    __m256 s = _mm256_mul_ps(_mm256_sub_ps(widen_u8(lo), eight), _mm256_loadu_ps(x));
    s = _mm256_fmadd_ps(_mm256_sub_ps(widen_u8(_mm_srli_si128(lo, 8)), eight),
                        _mm256_loadu_ps(x + 8), s);
    s = _mm256_fmadd_ps(_mm256_sub_ps(widen_u8(hi), eight), _mm256_loadu_ps(x + 16), s);
    return _mm256_fmadd_ps(_mm256_sub_ps(widen_u8(_mm_srli_si128(hi, 8)), eight),
                           _mm256_loadu_ps(x + 24), s);
}
#endif

static float q8_0_row(const uint8_t *row, const float *x, int64_t num_blocks) {
#ifdef GGML_GEMV_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *block = row + b * 34;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(block)),
                              q8_0_block(block + 2, x + b * QK), acc);
    }
    return sum8(acc);
#else
    float acc = 0.0f;
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *block = row + b * 34;
        const int8_t *q = (const int8_t *)(block + 2);
        float s = 0.0f;
        for (int j = 0; j < QK; j++) s += (float)q[j] * x[b * QK + j];
        acc += half_to_float(block) * s;
    }
    return acc;
#endif
}

static float q4_0_row(const uint8_t *row, const float *x, int64_t num_blocks) {
#ifdef GGML_GEMV_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *block = row + b * 18;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(block)),
                              q4_0_block(block + 2, x + b * QK), acc);
    }
    return sum8(acc);
#else
    float acc = 0.0f;
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *block = row + b * 18, *q = block + 2;
        const float *xb = x + b * QK;
        float s = 0.0f;
        for (int j = 0; j < QK / 2; j++)
            s += (float)((q[j] & 15) - 8) * xb[j] + (float)((q[j] >> 4) - 8) * xb[QK / 2 + j];
        acc += half_to_float(block) * s;
    }
    return acc;
#endif
}

/* w: [N, K / 32 blocks], x: [M, K], y: [M, N]; kind 8: Q8_0, 4: Q4_0. K is a multiple of 32 (checked
 * by the caller). */
void ggml_gemv(int kind, const uint8_t *w, const float *x, float *y, int64_t M, int64_t N,
               int64_t K, int num_threads) {
    const int64_t num_blocks = K / QK, row_bytes = num_blocks * (kind == 8 ? 34 : 18);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t m = 0; m < M; m++)
            y[m * N + n] = kind == 8 ? q8_0_row(row, x + m * K, num_blocks)
                                     : q4_0_row(row, x + m * K, num_blocks);
    }
}
