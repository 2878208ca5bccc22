/* y = x · Wᵀ with W read packed, in one of llama.cpp's block types or GPTQ's grids: the CPU's
 * decode GEMV for quantized weights.
 *
 * A decode step multiplies one activation row (or a few) by every weight matrix once, so its time
 * is the time to read the weights. float32 weights are 4 bytes each; Q8_0 is 34 bytes per 32
 * weights (1.06 bytes each), Q4_0 18 bytes per 32 (0.56). Dequantizing a whole matrix to float32
 * first, as the torch fallback does, reads the packed bytes *and* writes and reads a float32 copy:
 * slower than never quantizing. This kernel reads each block once and multiplies it where it lands,
 * in vector registers:
 *
 *     y[m][n] = Σ_b d[n][b] · Σ_j q[n][b][j] · x[m][32 b + j]          (Q4_0: q − 8)
 *
 * and for the K-quants (super-blocks of 256 weights, quant/ggml_blocks.py), per sub-block s with
 * its scale and min: Q4_K adds d·sc_s·Σ q·x − dmin·m_s·Σ x (the min multiplies the sub-block's sum
 * of x, so it costs three additions, not a subtraction per weight); Q6_K adds d·sc_s·Σ (q − 32)·x.
 *
 * An inner sum is a few 8-wide fused multiply-adds per 32 weights: codes unpacked with byte shifts
 * and masks, widened to int32, converted to float, multiplied with x. Activations stay float32
 * (llama.cpp quantizes them to 8 bits too, and multiplies integers; that is faster still and
 * changes the result: not done here), so y differs from the dequantize-then-multiply reference only
 * by the order of the float additions.
 *
 * Work is split over output rows n, one OpenMP thread each at a time. Under DECODE_MIN_ROWS rows of
 * x each block is multiplied where it lands, with the AVX2 intrinsics below (x86-64-v3 and every
 * later x86 CPU; elsewhere the same sums in plain C); from DECODE_MIN_ROWS rows on, weight row n is
 * decoded once into a float buffer and every x row takes its dot product with it (`gemv`, near the
 * end). GPTQ's grids (QuantLinear's 4- and 8-bit codes with a scale and zero point per group) take
 * the same two paths, after the llama.cpp types. kernels/cpu_packed_gemv.py builds this file on
 * first use and calls it with ctypes.
 */
#include <stdint.h>
#include <stdlib.h>
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

/* Σ_j code_j · x[j] and Σ_j x[j] over 32 weights whose 4-bit codes are the nibbles at `shift` (0:
 * low, 4: high) of 32 bytes: one Q4_K sub-block */
static inline __m256 nibbles32(const uint8_t *bytes, int shift, const float *x, __m256 *x_sum) {
    const __m256i nibble = _mm256_set1_epi8(15);
    __m256i raw = _mm256_loadu_si256((const __m256i *)bytes);
    __m256i c = _mm256_and_si256(_mm256_srli_epi16(raw, shift), nibble);
    __m128i c0 = _mm256_castsi256_si128(c), c1 = _mm256_extracti128_si256(c, 1);
    __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8);
    __m256 x2 = _mm256_loadu_ps(x + 16), x3 = _mm256_loadu_ps(x + 24);
    *x_sum = _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3));
    __m256 s = _mm256_mul_ps(widen_u8(c0), x0);
    s = _mm256_fmadd_ps(widen_u8(_mm_srli_si128(c0, 8)), x1, s);
    s = _mm256_fmadd_ps(widen_u8(c1), x2, s);
    return _mm256_fmadd_ps(widen_u8(_mm_srli_si128(c1, 8)), x3, s);
}
#endif

/* Q4_K's and Q5_K's 6-bit scales and mins of sub-blocks 0-7 from their 12 packed bytes */
static inline void k4_scales(const uint8_t *p, float *scale, float *min) {
    for (int j = 0; j < 4; j++) {
        scale[j] = (float)(p[j] & 63);
        min[j] = (float)(p[j + 4] & 63);
        scale[j + 4] = (float)((p[j + 8] & 15) | ((p[j] >> 6) << 4));
        min[j + 4] = (float)((p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4));
    }
}

/* one row of Q4_K super-blocks (144 bytes: d, dmin, 12 bytes of scales, 128 of codes); sub-block
 * 2i is the low nibbles of codes[32i .. 32i + 31], sub-block 2i + 1 their high nibbles */
static float q4_k_row(const uint8_t *row, const float *x, int64_t num_blocks) {
#ifdef GGML_GEMV_AVX2
    __m256 acc = _mm256_setzero_ps();
#else
    float acc = 0.0f;
#endif
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *block = row + b * 144, *codes = block + 16;
        const float d = half_to_float(block), dmin = half_to_float(block + 2);
        const float *xb = x + b * 256;
        float scale[8], min[8];
        k4_scales(block + 4, scale, min);
        for (int sub = 0; sub < 8; sub++) {
            const uint8_t *bytes = codes + 32 * (sub / 2);
            const int shift = 4 * (sub % 2);
            const float *xs = xb + 32 * sub;
#ifdef GGML_GEMV_AVX2
            __m256 x_sum, s = nibbles32(bytes, shift, xs, &x_sum);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * scale[sub]), s, acc);
            acc = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * min[sub]), x_sum, acc);
#else
            float s = 0.0f, x_sum = 0.0f;
            for (int l = 0; l < 32; l++) {
                s += (float)((bytes[l] >> shift) & 15) * xs[l];
                x_sum += xs[l];
            }
            acc += d * scale[sub] * s - dmin * min[sub] * x_sum;
#endif
        }
    }
#ifdef GGML_GEMV_AVX2
    return sum8(acc);
#else
    return acc;
#endif
}

/* one row of Q6_K super-blocks (210 bytes: 128 of low nibbles ql, 64 of bit pairs qh, 16 int8
 * scales, d). Weight 128 h + 32 g + l (half h, group g = 0..3, l = 0..31) is the nibble g / 2 of
 * ql[64 h + 32 (g % 2) + l] with the bit pair g of qh[32 h + l] on top, minus 32; its scale is
 * scales[8 h + 2 g + l / 16] */
static float q6_k_row(const uint8_t *row, const float *x, int64_t num_blocks) {
#ifdef GGML_GEMV_AVX2
    __m256 acc = _mm256_setzero_ps();
    const __m256i nibble = _mm256_set1_epi8(15), pair = _mm256_set1_epi8(3);
    const __m256i bias = _mm256_set1_epi8(32);
#else
    float acc = 0.0f;
#endif
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *block = row + b * 210;
        const int8_t *scales = (const int8_t *)(block + 192);
        const float d = half_to_float(block + 208);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = block + 64 * h, *qh = block + 128 + 32 * h;
            for (int g = 0; g < 4; g++) {
                const uint8_t *low = ql + 32 * (g % 2);
                const float *xs = x + b * 256 + 128 * h + 32 * g;
                const float s0 = d * (float)scales[8 * h + 2 * g];
                const float s1 = d * (float)scales[8 * h + 2 * g + 1];
#ifdef GGML_GEMV_AVX2
                __m256i low_bytes = _mm256_loadu_si256((const __m256i *)low);
                __m256i lo = _mm256_and_si256(_mm256_srli_epi16(low_bytes, 4 * (g / 2)), nibble);
                __m256i hi = _mm256_and_si256(
                    _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)qh), 2 * g), pair);
                /* codes 0..63 minus 32: signed bytes */
                __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), bias);
                __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
                __m256 first = _mm256_mul_ps(widen_i8(q0), _mm256_loadu_ps(xs));
                first = _mm256_fmadd_ps(widen_i8(_mm_srli_si128(q0, 8)), _mm256_loadu_ps(xs + 8),
                                        first);
                __m256 second = _mm256_mul_ps(widen_i8(q1), _mm256_loadu_ps(xs + 16));
                second = _mm256_fmadd_ps(widen_i8(_mm_srli_si128(q1, 8)),
                                         _mm256_loadu_ps(xs + 24), second);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(s0), first, acc);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(s1), second, acc);
#else
                float first = 0.0f, second = 0.0f;
                for (int l = 0; l < 32; l++) {
                    int code = ((low[l] >> (4 * (g / 2))) & 15) | (((qh[l] >> (2 * g)) & 3) << 4);
                    float term = (float)(code - 32) * xs[l];
                    if (l < 16) first += term; else second += term;
                }
                acc += s0 * first + s1 * second;
#endif
            }
        }
    }
#ifdef GGML_GEMV_AVX2
    return sum8(acc);
#else
    return acc;
#endif
}

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

/* ---------------------------------------------------------------- decoding a row to floats
 * For several x rows (the end of this file) each weight row is decoded once. The decoding is plain
 * C, written as the formulas of quant/ggml_blocks.py; the compiler vectorizes it. */
static void decode_q8_0(const uint8_t *row, float *w, int64_t K) {
    for (int64_t b = 0; b < K / QK; b++) {
        const uint8_t *block = row + b * 34;
        const int8_t *q = (const int8_t *)(block + 2);
        const float d = half_to_float(block);
        for (int j = 0; j < QK; j++) w[b * QK + j] = d * (float)q[j];
    }
}

static void decode_q4_0(const uint8_t *row, float *w, int64_t K) {
    for (int64_t b = 0; b < K / QK; b++) {
        const uint8_t *block = row + b * 18, *q = block + 2;
        const float d = half_to_float(block);
        for (int j = 0; j < QK / 2; j++) {
            w[b * QK + j] = d * (float)((q[j] & 15) - 8);
            w[b * QK + QK / 2 + j] = d * (float)((q[j] >> 4) - 8);
        }
    }
}

static void decode_q4_k(const uint8_t *row, float *w, int64_t K) {
    for (int64_t b = 0; b < K / 256; b++) {
        const uint8_t *block = row + b * 144, *codes = block + 16;
        const float d = half_to_float(block), dmin = half_to_float(block + 2);
        float scale[8], min[8];
        k4_scales(block + 4, scale, min);
        for (int sub = 0; sub < 8; sub++) {
            const uint8_t *bytes = codes + 32 * (sub / 2);
            const int shift = 4 * (sub % 2);
            const float a = d * scale[sub], m = dmin * min[sub];
            for (int l = 0; l < 32; l++)
                w[b * 256 + 32 * sub + l] = a * (float)((bytes[l] >> shift) & 15) - m;
        }
    }
}

static void decode_q6_k(const uint8_t *row, float *w, int64_t K) {
    for (int64_t b = 0; b < K / 256; b++) {
        const uint8_t *block = row + b * 210;
        const int8_t *scales = (const int8_t *)(block + 192);
        const float d = half_to_float(block + 208);
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 4; g++) {
                const uint8_t *low = block + 64 * h + 32 * (g % 2), *qh = block + 128 + 32 * h;
                const int nibble_shift = 4 * (g / 2), pair_shift = 2 * g;
                float *out = w + b * 256 + 128 * h + 32 * g;
                for (int half = 0; half < 2; half++) { /* two sub-blocks of 16, a scale each */
                    const float a = d * (float)scales[8 * h + 2 * g + half];
                    for (int l = 16 * half; l < 16 * half + 16; l++) {
                        int code = ((low[l] >> nibble_shift) & 15)
                                   | (((qh[l] >> pair_shift) & 3) << 4);
                        out[l] = a * (float)(code - 32);
                    }
                }
            }
    }
}

/* ---------------------------------------------------------------- GPTQ's grids (QuantLinear)
 * nanoserve's own 4- and 8-bit weights (RTN, GPTQ, AWQ, compressed-tensors W4A16 / W8A16: every
 * QuantLinear) are a grid per group of `group` input columns: W[n][k] = (q[n][k] − z[g][n]) ·
 * s[g][n], g = k / group. They are read as GPTQ stores them, qweight int32 [K·bits/32, N]: word
 * (j, n) holds codes k = per·j .. per·j + per − 1 of output n (per = 32 / bits codes, the lowest
 * bits first), and a word's row j is `stride` words long (N, or more for a view). So the words of
 * 8 neighbouring outputs sit side by side: one 8-wide vector load, one shift and mask per code, and
 * every x value, broadcast, multiplies 8 outputs at once. Per group,
 *
 *     Σ_k (q − z) · s · x = s · (Σ_k q · x − z · Σ_k x)
 *
 * with Σ_k x over each group of an x row summed once per call (`x_sums`), shared by every output.
 * Scales and zero points come as float [G, N]. Groups are whole words (the caller checks). */
struct grid {
    int bits;                     /* 4 or 8 */
    const int32_t *words;         /* qweight; word (j, n) at words[j · stride + n] */
    int64_t stride;
    const float *scales, *zeros;  /* [G, N] */
    int64_t group;
};

/* Σ over word row j of its codes times x, added to dot[c] for outputs c = 0 .. width − 1 of the
 * chunk whose words start at `words`; `bits` is a constant at each call (4 or 8), so the loop over
 * a word's codes unrolls. `xs` is x pre-scaled (`scale_x_for_words`): code i is not shifted down
 * but masked where it lies, word & (mask << bits·i) = q · 2^(bits·i) (exact as a float), and meets
 * x · 2^−(bits·i), so the product is q · x exactly as before, one instruction fewer per code; the
 * top code is shifted down instead (masking it in place would set the sign bit). */
static inline __attribute__((always_inline)) void grid_word_row(
    const int32_t *words, const int bits, const float *xs, float *dot, int64_t width) {
    const int per = 32 / bits, mask = (1 << bits) - 1;
    int64_t c = 0;
#ifdef GGML_GEMV_AVX2
    for (; c + 8 <= width; c += 8) {
        const __m256i word = _mm256_loadu_si256((const __m256i *)(words + c));
        /* two sums in turn: one would wait on each multiply-add's latency */
        __m256 even = _mm256_loadu_ps(dot + c), odd = _mm256_setzero_ps();
        for (int i = 0; i < per; i += 2) {
            const __m256i c0 = _mm256_and_si256(word, _mm256_set1_epi32(mask << (bits * i)));
            __m256i c1 = _mm256_srli_epi32(word, bits * (i + 1));
            if (i + 1 < per - 1)
                c1 = _mm256_and_si256(word, _mm256_set1_epi32(mask << (bits * (i + 1))));
            even = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c0), _mm256_broadcast_ss(xs + i), even);
            odd = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c1), _mm256_broadcast_ss(xs + i + 1), odd);
        }
        _mm256_storeu_ps(dot + c, _mm256_add_ps(even, odd));
    }
#endif
    for (; c < width; c++) {
        const uint32_t word = (uint32_t)words[c];
        for (int i = 0; i < per - 1; i++)
            dot[c] += (float)(int32_t)(word & ((uint32_t)mask << (bits * i))) * xs[i];
        dot[c] += (float)(word >> (bits * (per - 1))) * xs[per - 1];
    }
}

/* x [M][K] scaled for grid_word_row: x[k] · 2^−(bits·i) for code i = k mod per of its word, but
 * the top one (shifted down, not masked in place) */
static void scale_x_for_words(const float *x, float *xs, int64_t count, int bits) {
    const int per = 32 / bits;
    float factor[8];  /* powers of two: multiplying by one is exact */
    for (int i = 0; i < per - 1; i++) factor[i] = 1.0f / (float)(1u << (bits * i));
    factor[per - 1] = 1.0f;
    for (int64_t k = 0; k < count; k += per)  /* count is whole words of codes */
        for (int i = 0; i < per; i++) xs[k + i] = x[k + i] * factor[i];
}

/* outputs n0 .. n1 − 1 of M x rows (M < DECODE_MIN_ROWS), summed over groups g0 .. g1 − 1 into
 * `out` [M][N] (overwritten). The words are read row by row of qweight, each row's stretch in
 * order, and every x row's sums for one group are gathered in `dot` [M][n1 − n0], then scaled.
 * `x` comes scaled by scale_x_for_words; `x_sums` are the plain x's sums. */
static void grid_part(const struct grid *grid, const float *x, const float *x_sums, int64_t M,
                      int64_t n0, int64_t n1, int64_t g0, int64_t g1, int64_t N, int64_t K,
                      float *dot, float *out) {
    const int per = 32 / grid->bits;
    const int64_t width = n1 - n0, G = K / grid->group;
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < width; c++) out[m * N + n0 + c] = 0.0f;
    for (int64_t g = g0; g < g1; g++) {
        memset(dot, 0, (size_t)(M * width) * sizeof(float));
        for (int64_t j = g * grid->group / per; j < (g + 1) * grid->group / per; j++) {
            const int32_t *words = grid->words + j * grid->stride + n0;
            for (int64_t m = 0; m < M; m++) {
                const float *xs = x + m * K + j * per;
                if (grid->bits == 4) {
                    grid_word_row(words, 4, xs, dot + m * width, width);
                } else {
                    grid_word_row(words, 8, xs, dot + m * width, width);
                }
            }
        }
        const float *s = grid->scales + g * N + n0, *z = grid->zeros + g * N + n0;
        for (int64_t m = 0; m < M; m++)
            for (int64_t c = 0; c < width; c++)
                out[m * N + n0 + c] += s[c] * (dot[m * width + c] - z[c] * x_sums[m * G + g]);
    }
}

/* y [M][N] for M < DECODE_MIN_ROWS x rows. Threads split the groups (each then streams one
 * contiguous block of qweight, the fastest way to read memory; splitting the outputs instead
 * makes each thread read 4 KB and skip 4 KB, and the prefetcher stalls at every page), summing
 * into their own copy of y, added up at the end; with fewer groups than threads (one scale per
 * output row), they split the outputs. */
static int grid_few_rows(const struct grid *grid, const float *x, float *y, int64_t M, int64_t N,
                         int64_t K, int num_threads) {
    const int64_t G = K / grid->group;
    const int split_groups = G >= num_threads && num_threads > 1;
    const int parts = num_threads;
    float *x_sums = malloc((size_t)(M * G) * sizeof(float));                 /* [M][G] */
    float *x_scaled = malloc((size_t)(M * K) * sizeof(float));               /* [M][K] */
    float *partial = split_groups ? malloc((size_t)(parts * M * N) * sizeof(float)) : NULL;
    int failed = x_sums == NULL || x_scaled == NULL || (split_groups && partial == NULL);
    if (failed) {
        free(x_sums);
        free(x_scaled);
        free(partial);
        return 1;
    }
    scale_x_for_words(x, x_scaled, M * K, grid->bits);
    for (int64_t i = 0; i < M * G; i++) {
        float sum = 0.0f;
        for (int64_t k = i * grid->group; k < (i + 1) * grid->group; k++) sum += x[k];
        x_sums[i] = sum;
    }
    const int64_t width = split_groups ? N : ((N + parts - 1) / parts + 7) / 8 * 8;
#pragma omp parallel num_threads(num_threads)
    {
        float *dot = malloc((size_t)(M * width) * sizeof(float));
        if (dot == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int t = 0; t < parts; t++) {
            if (dot == NULL) continue;
            if (split_groups) {
                grid_part(grid, x_scaled, x_sums, M, 0, N, t * G / parts, (t + 1) * G / parts, N,
                          K, dot, partial + t * M * N);
            } else if (t * width < N) {
                const int64_t n1 = (t + 1) * width < N ? (t + 1) * width : N;
                grid_part(grid, x_scaled, x_sums, M, t * width, n1, 0, G, N, K, dot, y);
            }
        }
        free(dot);
    }
    if (split_groups && !failed) {
        for (int64_t i = 0; i < M * N; i++) {
            float sum = 0.0f;
            for (int t = 0; t < parts; t++) sum += partial[t * M * N + i];
            y[i] = sum;
        }
    }
    free(x_sums);
    free(x_scaled);
    free(partial);
    return failed;
}

/* outputs n0 .. n0 + width − 1 (width ≤ 16) as floats into a panel [K][16], each weight exactly
 * as the reference computes it, (q − z) · s; columns past `width` are 0 */
static void decode_grid_panel(const struct grid *grid, int64_t n0, int width, int64_t N,
                              float *panel, int64_t K) {
    const int per = 32 / grid->bits, mask = (1 << grid->bits) - 1;
    for (int64_t j = 0; j < K / per; j++) {
        const int64_t g = j * per / grid->group;
        const int32_t *words = grid->words + j * grid->stride + n0;
        const float *s = grid->scales + g * N + n0, *z = grid->zeros + g * N + n0;
        for (int i = 0; i < per; i++) {
            float *out = panel + (j * per + i) * 16;
            const int shift = grid->bits * i;
            for (int c = 0; c < width; c++)
                out[c] = ((float)(((uint32_t)words[c] >> shift) & mask) - z[c]) * s[c];
            for (int c = width; c < 16; c++) out[c] = 0.0f;
        }
    }
}

/* ---------------------------------------------------------------- the weights, either kind
 * `kind` is a llama.cpp block type's code (kernels/cpu_packed_gemv.py's KINDS) or GRID. */
#define GRID 1
struct weights {
    int kind;
    const uint8_t *data; /* llama.cpp types: row n at data + n · row_bytes */
    int64_t row_bytes;
    struct grid grid; /* GRID only */
};

static void decode_row(const struct weights *w, int64_t n, float *out, int64_t K) {
    const uint8_t *row = w->data + n * w->row_bytes;
    switch (w->kind) {
    case 8: decode_q8_0(row, out, K); break;
    case 4: decode_q4_0(row, out, K); break;
    case 14: decode_q4_k(row, out, K); break;
    default: decode_q6_k(row, out, K); /* 16 */
    }
}

static float dot_row(const struct weights *w, int64_t n, const float *x, int64_t K) {
    const uint8_t *row = w->data + n * w->row_bytes;
    switch (w->kind) {
    case 8: return q8_0_row(row, x, K / QK);
    case 4: return q4_0_row(row, x, K / QK);
    case 14: return q4_k_row(row, x, K / 256);
    default: return q6_k_row(row, x, K / 256); /* 16 */
    }
}

/* ---------------------------------------------------------------- many rows: decode once, reuse
 * With several x rows, unpacking a block again for each row would cost more than the bytes saved,
 * so each weight is decoded to float once per call, in the order its packing makes cheap:
 *
 * - llama.cpp's rows are contiguous per output: a thread decodes weight row n into a buffer of K
 *   floats (in L1 or L2) and takes the dot products of all x rows with it, four at a time;
 * - GPTQ's words interleave the outputs: a thread decodes 16 outputs at once into a panel laid out
 *   [K][16] (K · 64 bytes, in L2) and multiplies every x row with it as a small GEMM does: TILE_M x
 *   rows at a time, 2 · TILE_M vector accumulators held in registers for the whole of K, each x
 *   value broadcast once per 16 outputs, each panel vector loaded once per TILE_M rows. */
#define TILE_N 16
#define TILE_M 6

/* y[m][n] for m = m0 .. m0 + 3: four dot products with one pass over w */
static void dot4(const float *w, const float *x, float *y, int64_t K, int64_t N, int64_t n) {
    const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        s0 += w[k] * x0[k];
        s1 += w[k] * x1[k];
        s2 += w[k] * x2[k];
        s3 += w[k] * x3[k];
    }
    y[n] = s0;
    y[N + n] = s1;
    y[2 * N + n] = s2;
    y[3 * N + n] = s3;
}

static float dot1(const float *w, const float *x, int64_t K) {
    float s = 0.0f;
    for (int64_t k = 0; k < K; k++) s += w[k] * x[k];
    return s;
}


/* out[r][c] = Σ_k x[r][k] · panel[k][c] for `rows` x rows (rows ≤ TILE_M, a constant at each call:
 * the loops over rows unroll and the 2 · rows accumulators stay in registers) */
static inline __attribute__((always_inline)) void panel_rows(const float *panel, const float *x,
                                                             int64_t K, const int rows,
                                                             float out[TILE_M][TILE_N]) {
#ifdef GGML_GEMV_AVX2
    __m256 acc[TILE_M][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 w0 = _mm256_loadu_ps(panel + k * TILE_N);
        const __m256 w1 = _mm256_loadu_ps(panel + k * TILE_N + 8);
        for (int r = 0; r < rows; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * K + k);
            acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(out[r], acc[r][0]);
        _mm256_storeu_ps(out[r] + 8, acc[r][1]);
    }
#else
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < TILE_N; c++) out[r][c] = 0.0f;
        for (int64_t k = 0; k < K; k++)
            for (int c = 0; c < TILE_N; c++) out[r][c] += x[r * K + k] * panel[k * TILE_N + c];
    }
#endif
}

/* y[m][n0 ..] for rows m0 .. m0 + rows − 1 (rows ≤ TILE_M) against the panel */
static void panel_product(const float *panel, const float *x, float *y, int64_t m0, int rows,
                          int64_t n0, int width, int64_t N, int64_t K) {
    float out[TILE_M][TILE_N];
    const float *xs = x + m0 * K;
    switch (rows) {
    case 6: panel_rows(panel, xs, K, 6, out); break;
    case 5: panel_rows(panel, xs, K, 5, out); break;
    case 4: panel_rows(panel, xs, K, 4, out); break;
    case 3: panel_rows(panel, xs, K, 3, out); break;
    case 2: panel_rows(panel, xs, K, 2, out); break;
    default: panel_rows(panel, xs, K, 1, out);
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < width; c++) y[(m0 + r) * N + n0 + c] = out[r][c];
}

/* ---------------------------------------------------------------- the product
 * x: [M, K], y: [M, N]. Fewer than DECODE_MIN_ROWS rows: each block is multiplied where it lands;
 * more: each weight decoded once per call. Returns 0, or 1 when a buffer could not be
 * allocated. */
#define DECODE_MIN_ROWS 4

static int few_rows(const struct weights *w, const float *x, float *y, int64_t M, int64_t N,
                    int64_t K, int num_threads) {
    if (w->kind != GRID) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t n = 0; n < N; n++)
            for (int64_t m = 0; m < M; m++) y[m * N + n] = dot_row(w, n, x + m * K, K);
        return 0;
    }
    return grid_few_rows(&w->grid, x, y, M, N, K, num_threads);
}

/* llama.cpp rows: each decoded once, dotted with every x row */
static int many_rows(const struct weights *w, const float *x, float *y, int64_t M, int64_t N,
                     int64_t K, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *buffer = malloc((size_t)K * sizeof(float));
        if (buffer == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (buffer == NULL) continue;
            decode_row(w, n, buffer, K);
            int64_t m = 0;
            for (; m + 4 <= M; m += 4) dot4(buffer, x + m * K, y + m * N, K, N, n);
            for (; m < M; m++) y[m * N + n] = dot1(buffer, x + m * K, K);
        }
        free(buffer);
    }
    return failed;
}

/* GPTQ's grids: panels of TILE_N outputs, each decoded once, multiplied by every x row */
static int many_rows_grid(const struct grid *grid, const float *x, float *y, int64_t M,
                          int64_t N, int64_t K, int num_threads) {
    int failed = 0;
    const int64_t tiles = (N + TILE_N - 1) / TILE_N;
#pragma omp parallel num_threads(num_threads)
    {
        float *panel = malloc((size_t)K * TILE_N * sizeof(float));
        if (panel == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (panel == NULL) continue;
            const int64_t n0 = t * TILE_N;
            const int width = (int)(N - n0 < TILE_N ? N - n0 : TILE_N);
            decode_grid_panel(grid, n0, width, N, panel, K);
            for (int64_t m = 0; m < M; m += TILE_M)
                panel_product(panel, x, y, m, (int)(M - m < TILE_M ? M - m : TILE_M), n0, width,
                              N, K);
        }
        free(panel);
    }
    return failed;
}

static int gemv(const struct weights *w, const float *x, float *y, int64_t M, int64_t N,
                int64_t K, int num_threads) {
    if (M < DECODE_MIN_ROWS) return few_rows(w, x, y, M, N, K, num_threads);
    if (w->kind == GRID) return many_rows_grid(&w->grid, x, y, M, N, K, num_threads);
    return many_rows(w, x, y, M, N, K, num_threads);
}

/* llama.cpp blocks: w [N, row_bytes]; K a whole number of the type's blocks and row_bytes its
 * packed row (both checked by the caller) */
int ggml_gemv(int kind, const uint8_t *w, const float *x, float *y, int64_t M, int64_t N,
              int64_t K, int64_t row_bytes, int num_threads) {
    struct weights weights = {kind, w, row_bytes, {0, NULL, 0, NULL, NULL, 0}};
    return gemv(&weights, x, y, M, N, K, num_threads);
}

/* llama.cpp blocks decoded whole, out [N, K] float: for a prefill's many rows, which a BLAS GEMM
 * multiplies faster than the products above (the layer chooses) */
void ggml_dequantize(int kind, const uint8_t *w, float *out, int64_t N, int64_t K,
                     int64_t row_bytes, int num_threads) {
    struct weights weights = {kind, w, row_bytes, {0, NULL, 0, NULL, NULL, 0}};
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) decode_row(&weights, n, out + n * K, K);
}

/* GPTQ's grids decoded whole, out [N, K] float, each weight (q − z) · s: for a prefill's many rows.
 * Threads take 16 outputs at a time, whose words share cache lines. */
void grid_dequantize(int bits, const int32_t *qweight, int64_t stride, const float *scales,
                     const float *zeros, int64_t group, float *out, int64_t N, int64_t K,
                     int num_threads) {
    const int per = 32 / bits, mask = (1 << bits) - 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
        const int64_t n1 = n0 + 16 < N ? n0 + 16 : N;
        for (int64_t j = 0; j < K / per; j++) {
            const int64_t g = j * per / group;
            for (int64_t n = n0; n < n1; n++) {
                const uint32_t word = (uint32_t)qweight[j * stride + n];
                const float s = scales[g * N + n], z = zeros[g * N + n];
                float *row = out + n * K + j * per;
                for (int i = 0; i < per; i++)
                    row[i] = ((float)((word >> (bits * i)) & mask) - z) * s;
            }
        }
    }
}

/* GPTQ's grids: qweight int32 [K · bits / 32, N] with rows `stride` words apart, scales and zeros
 * float [K / group, N]; group a multiple of 32 / bits dividing K (checked by the caller) */
int grid_gemv(int bits, const int32_t *qweight, int64_t stride, const float *scales,
              const float *zeros, int64_t group, const float *x, float *y, int64_t M, int64_t N,
              int64_t K, int num_threads) {
    struct weights weights = {GRID, NULL, 0, {bits, qweight, stride, scales, zeros, group}};
    return gemv(&weights, x, y, M, N, K, num_threads);
}
