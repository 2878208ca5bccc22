/* Paged decode attention on the CPU: the same computation as kernels/paged_attention.py, in C.
 *
 * One new query token per sequence attends to that sequence's keys and values where they lie, in
 * the block pool [num_blocks, block_size, Hkv, D]; token t of sequence b is block
 * block_tables[b][t / block_size], offset t % block_size. Nothing is gathered into a padded
 * [B, T] copy first, which is what the torch backend does and what costs it a copy of the whole
 * context per layer per step (benchmarks/RESULTS.md, "Where the time goes").
 *
 * Work is split over (sequence, kv head) pairs, one OpenMP thread each at a time; a pair's G query
 * heads (GQA: head h reads kv head h / G) share every key and value row it loads. Per head, three
 * passes over the context: scores s_t = scale · q · k_t (soft-capped: c · tanh(s_t / c)), then
 * p_t = exp(s_t − max s) and their sum l, then out = Σ p_t v_t / l. With attention sinks (gpt-oss:
 * one learned logit per head, not multiplied by the scale), the sink joins the max and adds
 * exp(sink − max) to l, but no value: the weights then sum to less than 1. The scores of one
 * sequence fit in a small buffer per thread (4 bytes per key and head), so unlike the GPU kernel
 * this one needs no online softmax: the CPU's caches hold a whole row.
 *
 * HEAD_DIM is fixed when the file is compiled (cc -DHEAD_DIM=64): with a constant trip count the
 * compiler turns the two inner loops into whole SIMD registers (AVX2 / AVX-512), like a constexpr in
 * Triton. kernels/cpu_paged_attention.py compiles one library per head dim and calls it with ctypes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<the model's head dim>"
#endif
#define D HEAD_DIM

/* q, out [B, H, D]; k_pool, v_pool [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks];
 * context_lens [B]: sequence b sees keys max(0, len − window) .. len − 1 (window 0: all of them).
 * sinks [H] or NULL (none). softcap 0: no cap. Returns 0, or 1 when a thread could not allocate its
 * score buffer. */
int paged_decode_attention(const float *q, const float *k_pool, const float *v_pool, const int64_t *block_tables,
                           const int64_t *context_lens, float *out, const float *sinks, int64_t num_seqs, int64_t max_blocks,
                           int64_t num_heads, int64_t num_kv_heads, int64_t block_size, float scale,
                           int64_t window, float softcap, int num_threads) {
    const int64_t G = num_heads / num_kv_heads;     /* query heads per kv head */
    const int64_t row = num_kv_heads * D;           /* floats from one token to the next in a block */
    const int64_t max_len = max_blocks * block_size;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(G * max_len)); /* G, max_len */
        float acc[D];
        if (scores == NULL) failed = 1;
#pragma omp for collapse(2) schedule(dynamic, 4)
        for (int64_t b = 0; b < num_seqs; b++) {
            for (int64_t kh = 0; kh < num_kv_heads; kh++) {
                if (scores == NULL) continue;
                const int64_t len = context_lens[b];
                const int64_t first = (window > 0 && len > window) ? len - window : 0;
                const int64_t *table = block_tables + b * max_blocks;
                for (int64_t g = 0; g < G; g++) {
                    const int64_t h = kh * G + g;
                    const float *qh = q + (b * num_heads + h) * D;
                    float *s = scores + g * max_len;
                    float m = sinks ? sinks[h] : -INFINITY, l = 0.0f;
                    for (int64_t t0 = first - first % block_size; t0 < len; t0 += block_size) { /* pass 1: scores, max */
                        const float *block = k_pool + table[t0 / block_size] * block_size * row + kh * D;
                        const int64_t lo = t0 > first ? t0 : first, hi = t0 + block_size < len ? t0 + block_size : len;
                        for (int64_t t = lo; t < hi; t++) {
                            const float *k = block + (t - t0) * row;
                            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                            for (int i = 0; i < D; i++) dot += qh[i] * k[i];
                            s[t] = dot * scale;
                        }
                    }
                    for (int64_t t = first; t < len; t++) {
                        if (softcap > 0.0f) s[t] = softcap * tanhf(s[t] / softcap);
                        m = s[t] > m ? s[t] : m;
                    }
                    for (int64_t t = first; t < len; t++) { /* pass 2: exp and sum */
                        s[t] = expf(s[t] - m);
                        l += s[t];
                    }
                    if (sinks) l += expf(sinks[h] - m); /* the sink's share: in l, with no value */
                    memset(acc, 0, sizeof acc);
                    for (int64_t t0 = first - first % block_size; t0 < len; t0 += block_size) { /* pass 3: Σ p·v */
                        const float *block = v_pool + table[t0 / block_size] * block_size * row + kh * D;
                        const int64_t lo = t0 > first ? t0 : first, hi = t0 + block_size < len ? t0 + block_size : len;
                        for (int64_t t = lo; t < hi; t++) {
                            const float *v = block + (t - t0) * row;
                            const float p = s[t];
#pragma omp simd
                            for (int i = 0; i < D; i++) acc[i] += p * v[i];
                        }
                    }
                    float *o = out + (b * num_heads + h) * D;
                    for (int i = 0; i < D; i++) o[i] = acc[i] / l;
                }
            }
        }
        free(scores);
    }
    return failed;
}
