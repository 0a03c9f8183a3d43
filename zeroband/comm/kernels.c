/* zeroband's native kernels for the outer step: each is one pass over memory doing what the eager
 * torch path does in two to four (zeroband/comm/kernels.py loads them and checks them against it).
 *
 * Bits: every arithmetic operation here is one IEEE operation rounded to nearest even, the same one
 * torch's eager kernels do: fp32 products and sums (built with -ffp-contract=off, so no product is
 * fused into an add) and fp32 <-> fp16 conversions (vcvtps2ph / vcvtph2ps, or _Float16 casts). So the
 * values written are bitwise those of the eager path on any CPU. Only the statistics (sums of
 * squares) are summed in another order; they are compared across sites with a tolerance.
 *
 * Statistics: `stats` (nullable) is a float64 row [sum of squares, non-finite count] that a kernel
 * adds to: squares of fp32 values summed in fp32 per block of BLOCK values, the blocks in float64,
 * the sum then multiplied by unit^2 in float64 (unit: the power of two that decodes fp16 values).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

typedef _Float16 half;
#define BLOCK 4096 /* values per fp32 partial sum: short enough to keep fp32 rounding ~1e-6 relative */

#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
typedef __m512 vf;
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vset(float x) { return _mm512_set1_ps(x); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); } /* a * b + c, one rounding */
static inline vf vabs(vf a) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff))); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vhmax(vf v) { return _mm512_reduce_max_ps(v); }
static inline int vnan(vf v) { return __builtin_popcount(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)); }
static inline int vnonfinite(vf v) { return LANES - __builtin_popcount(_mm512_cmp_ps_mask(vabs(v), vset(FLT_MAX), _CMP_LE_OQ)); }
static inline void vstream(float *p, vf v) { _mm512_stream_ps(p, v); } /* p aligned to 64 bytes */
static inline vf vload_h(const half *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* stores fp16(v) and returns it widened back to fp32 (exact) */
static inline vf vstore_h(half *p, vf v) {
    __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256((__m256i *)p, h);
    return _mm512_cvtph_ps(h);
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
typedef __m256 vf;
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vset(float x) { return _mm256_set1_ps(x); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); } /* needs FMA3: -march=native has it */
static inline vf vabs(vf a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vhmax(vf v) {
    float t[LANES], m = 0.0f;
    _mm256_storeu_ps(t, v);
    for (int i = 0; i < LANES; i++) m = t[i] > m ? t[i] : m;
    return m;
}
static inline int vnan(vf v) { return __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))); }
static inline int vnonfinite(vf v) { return LANES - __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(vabs(v), vset(FLT_MAX), _CMP_LE_OQ))); }
static inline void vstream(float *p, vf v) { _mm256_stream_ps(p, v); } /* p aligned to 32 bytes */
static inline vf vload_h(const half *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vstore_h(half *p, vf v) {
    __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)p, h);
    return _mm256_cvtph_ps(h);
}
#else
#define LANES 0 /* scalar loops only (the compiler may still vectorise them) */
#endif

static inline int nonfinite(float v) { return !(fabsf(v) <= FLT_MAX); }

/* Streaming (non-temporal) stores for output that is not read again soon: they skip reading each
 * cache line before writing it, a third of a pass's memory traffic. `lead` is how many values to
 * write the plain way first so the vector stores start aligned (0 when not streaming). */
#if LANES
static inline void vput(float *p, vf v, int stream) {
    if (stream)
        vstream(p, v);
    else
        vstore(p, v);
}
static inline int64_t lead(const float *out, int64_t n, int stream) {
    if (!out || !stream) return 0;
    int64_t k = (int64_t)(((LANES * 4) - (uintptr_t)out % (LANES * 4)) % (LANES * 4)) / 4;
    return k < n ? k : n;
}
static inline void fence(int stream) {
    if (stream) _mm_sfence(); /* streamed stores are visible to other threads before we return */
}
#endif

/* Each kernel: the plain element loop for the lead-in (to align streaming stores) and the tail, and
 * between them a vector loop over blocks of BLOCK values, each block's squares summed in fp32. */
typedef struct {
    double sumsq;
    int64_t bad;
} acc_t;

static inline void tally(acc_t *acc, float v) {
    acc->sumsq += (double)(v * v);
    acc->bad += nonfinite(v);
}

static inline void finish(double *stats, acc_t acc, double unit) {
    if (stats) {
        stats[0] += acc.sumsq * unit * unit;
        stats[1] += (double)acc.bad;
    }
}

/* out = a - b; returns the sum of squares of out (non-finite if any value is) */
double zb_sub_sumsq(const float *a, const float *b, float *out, int64_t n, int stream) {
    acc_t acc = {0.0, 0};
    int64_t i = 0;
#define ELEM(i)                  \
    do {                         \
        float d = a[i] - b[i];   \
        out[i] = d;              \
        tally(&acc, d);          \
    } while (0)
#if LANES
    for (int64_t k = lead(out, n, stream); i < k; i++) ELEM(i);
    while (i + LANES <= n) {
        int64_t end = i + BLOCK < n ? i + BLOCK : n;
        vf sq = vset(0.0f);
        for (; i + LANES <= end; i += LANES) {
            vf d = vsub(vload(a + i), vload(b + i));
            vput(out + i, d, stream);
            sq = vadd(sq, vmul(d, d));
        }
        acc.sumsq += vsum(sq);
    }
    fence(stream);
#endif
    for (; i < n; i++) ELEM(i);
#undef ELEM
    return acc.sumsq;
}

/* out = in, streamed when `stream` (the copy back into the model) */
void zb_copy(const float *in, float *out, int64_t n, int stream) {
    int64_t i = 0;
#if LANES
    for (int64_t k = lead(out, n, stream); i < k; i++) out[i] = in[i];
    for (; i + LANES <= n; i += LANES) vput(out + i, vload(in + i), stream);
    fence(stream);
#endif
    for (; i < n; i++) out[i] = in[i];
}

/* max |x|; NaN if any value is NaN, 0 for no values */
float zb_max_abs(const float *x, int64_t n) {
    float m = 0.0f;
    int64_t nans = 0, i = 0;
#if LANES
    vf vm = vset(0.0f);
    for (; i + LANES <= n; i += LANES) {
        vf v = vload(x + i);
        nans += vnan(v);
        vm = vmax(vm, vabs(v));
    }
    m = vhmax(vm);
#endif
    for (; i < n; i++) {
        float a = fabsf(x[i]);
        nans += a != a;
        m = a > m ? a : m;
    }
    return nans ? NAN : m;
}

/* out = fp16(fp32(x * factor)); decoded (nullable; streamed when `stream`) = fp32(out) * unit;
 * stats += those values' */
void zb_encode_f16(const float *x, int64_t n, float factor, half *out, float *decoded, double unit, double *stats,
                   int stream) {
    const float u = (float)unit;
    acc_t acc = {0.0, 0};
    int64_t i = 0;
#define ELEM(i)                              \
    do {                                     \
        half h = (half)(x[i] * factor);      \
        float v = (float)h;                  \
        out[i] = h;                          \
        tally(&acc, v);                      \
        if (decoded) decoded[i] = v * u;     \
    } while (0)
#if LANES
    const vf f = vset(factor), vu = vset(u);
    for (int64_t k = lead(decoded, n, stream); i < k; i++) ELEM(i);
    while (i + LANES <= n) {
        int64_t end = i + BLOCK < n ? i + BLOCK : n;
        vf sq = vset(0.0f);
        for (; i + LANES <= end; i += LANES) {
            vf v = vstore_h(out + i, vmul(vload(x + i), f));
            sq = vadd(sq, vmul(v, v));
            acc.bad += vnonfinite(v);
            if (decoded) vput(decoded + i, vmul(v, vu), stream);
        }
        acc.sumsq += vsum(sq);
    }
    fence(stream);
#endif
    for (; i < n; i++) ELEM(i);
#undef ELEM
    finish(stats, acc, unit);
}

/* out (streamed when `stream`) = fp32(in) * unit; stats += those values' */
void zb_decode_f16(const half *in, int64_t n, double unit, float *out, double *stats, int stream) {
    const float u = (float)unit;
    acc_t acc = {0.0, 0};
    int64_t i = 0;
#define ELEM(i)                  \
    do {                         \
        float v = (float)in[i];  \
        tally(&acc, v);          \
        out[i] = v * u;          \
    } while (0)
#if LANES
    const vf vu = vset(u);
    for (int64_t k = lead(out, n, stream); i < k; i++) ELEM(i);
    while (i + LANES <= n) {
        int64_t end = i + BLOCK < n ? i + BLOCK : n;
        vf sq = vset(0.0f);
        for (; i + LANES <= end; i += LANES) {
            vf v = vload_h(in + i);
            sq = vadd(sq, vmul(v, v));
            acc.bad += vnonfinite(v);
            vput(out + i, vmul(v, vu), stream);
        }
        acc.sumsq += vsum(sq);
    }
    fence(stream);
#endif
    for (; i < n; i++) ELEM(i);
#undef ELEM
    finish(stats, acc, unit);
}

/* total = (first ? +0 : total) + fp32(in) * unit; stats += the decoded values' */
void zb_add_f16(float *total, const half *in, int64_t n, double unit, int first, double *stats) {
    const float u = (float)unit;
    acc_t acc = {0.0, 0};
    int64_t i = 0;
#if LANES
    const vf vu = vset(u), zero = vset(0.0f);
    while (i + LANES <= n) {
        int64_t end = i + BLOCK < n ? i + BLOCK : n;
        vf sq = vset(0.0f);
        for (; i + LANES <= end; i += LANES) {
            vf v = vload_h(in + i);
            sq = vadd(sq, vmul(v, v));
            acc.bad += vnonfinite(v);
            vstore(total + i, vadd(first ? zero : vload(total + i), vmul(v, vu)));
        }
        acc.sumsq += vsum(sq);
    }
#endif
    for (; i < n; i++) {
        float v = (float)in[i];
        tally(&acc, v);
        total[i] = (first ? 0.0f : total[i]) + v * u;
    }
    finish(stats, acc, unit);
}

/* total = (first ? +0 : total) + fp32(x * weight); stats += those products' */
void zb_add_f32(float *total, const float *x, int64_t n, float weight, int first, double *stats) {
    acc_t acc = {0.0, 0};
    int64_t i = 0;
#if LANES
    const vf w = vset(weight), zero = vset(0.0f);
    while (i + LANES <= n) {
        int64_t end = i + BLOCK < n ? i + BLOCK : n;
        vf sq = vset(0.0f);
        for (; i + LANES <= end; i += LANES) {
            vf v = vmul(vload(x + i), w);
            sq = vadd(sq, vmul(v, v));
            acc.bad += vnonfinite(v);
            vstore(total + i, vadd(first ? zero : vload(total + i), v));
        }
        acc.sumsq += vsum(sq);
    }
#endif
    for (; i < n; i++) {
        float v = x[i] * weight;
        tally(&acc, v);
        total[i] = (first ? 0.0f : total[i]) + v;
    }
    finish(stats, acc, 1.0);
}

/* The outer optimizer: torch's CPU fused SGD (dampening 0, no weight decay) as its kernel rounds:
 *   buf = first ? g : buf * m + g       (the product rounded, then the sum; one fma(buf, m, g) in
 *                                        torch's scalar loop over a tensor's last values, from
 *                                        `tail_from` on)
 *   d   = nesterov ? fma(buf, m, g) : buf
 *   p   = fma(d, -lr, p)                 (momentum 0: no buffer, d = g)
 * zeroband/comm/kernels.py checks these bits against torch's own optimizer before using this, since
 * where torch's compiler fused a product into a sum is a property of its build. `local` (nullable,
 * streamed when `stream`) receives the new p in the same pass: the copy back into the model. */
void zb_sgd(float *p, const float *g, float *buf, float *local, int64_t n, float lr, float m, int nesterov,
            int first, int64_t tail_from, int stream) {
    int64_t i = 0;
#define ELEM(i)                                                                         \
    do {                                                                                \
        float gi = g[i], d = gi;                                                        \
        if (m != 0.0f) {                                                                \
            float b = first ? gi : (i) >= tail_from ? fmaf(buf[i], m, gi) : buf[i] * m + gi; \
            buf[i] = b;                                                                 \
            d = nesterov ? fmaf(b, m, gi) : b;                                          \
        }                                                                               \
        p[i] = fmaf(d, -lr, p[i]);                                                      \
        if (local) local[i] = p[i];                                                     \
    } while (0)
#if LANES
    const vf vm = vset(m), vlr = vset(-lr);
    for (int64_t k = lead(local, n, stream); i < k; i++) ELEM(i);
    for (; i + LANES <= tail_from; i += LANES) {
        vf gi = vload(g + i), d = gi;
        if (m != 0.0f) {
            vf b = first ? gi : vadd(vmul(vload(buf + i), vm), gi);
            vstore(buf + i, b);
            d = nesterov ? vfma(b, vm, gi) : b;
        }
        vf q = vfma(d, vlr, vload(p + i));
        vstore(p + i, q);
        if (local) vput(local + i, q, stream);
    }
    fence(stream);
#endif
    for (; i < n; i++) ELEM(i);
#undef ELEM
}
