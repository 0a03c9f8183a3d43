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
#include <pthread.h>

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
static double sub_sumsq(const float *a, const float *b, float *out, int64_t n, int stream) {
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
static void copy_(const float *in, float *out, int64_t n, int stream) {
    int64_t i = 0;
#if LANES
    for (int64_t k = lead(out, n, stream); i < k; i++) out[i] = in[i];
    for (; i + LANES <= n; i += LANES) vput(out + i, vload(in + i), stream);
    fence(stream);
#endif
    for (; i < n; i++) out[i] = in[i];
}

/* max |x|; NaN if any value is NaN, 0 for no values */
static float max_abs(const float *x, int64_t n) {
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
static void encode_f16(const float *x, int64_t n, float factor, half *out, float *decoded, double unit, double *stats,
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
static void decode_f16(const half *in, int64_t n, double unit, float *out, double *stats, int stream) {
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
static void add_f16(float *total, const half *in, int64_t n, double unit, int first, double *stats) {
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
static void add_f32(float *total, const float *x, int64_t n, float weight, int first, double *stats) {
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

/* ------------------------------------------------------------------------------------------------
 * The exported kernels: each cuts its n values into up to `threads` runs of whole BLOCKs (at least
 * MIN_PART values each) and runs the kernel above on every run, on the calling thread and the
 * library's own worker threads. Every value is written by the same arithmetic whatever the cut, so
 * the outputs are bitwise the same at any thread count; statistics are summed per run, then over
 * the runs in order.
 *
 * Why a pool of our own and not OpenMP: torch loads libgomp too, and the dynamic linker gives us
 * its copy, so a team we start becomes torch's. A child forked after that (tests fork their ranks)
 * inherits a pool whose threads do not exist, and GNU libgomp hangs on the child's next parallel
 * region, torch's included. This pool forgets its threads in a forked child and starts new ones
 * there. Its workers sleep on a condition variable between jobs instead of spinning, so sites that
 * share a few cores do not take CPU from each other. One job at a time: a second caller meanwhile
 * (the exchange thread beside the training loop, simulated sites) runs its job on its own thread. */
#define MIN_PART (64 * 1024) /* 256 KB of fp32: ~20 us of work, above the cost of waking a worker */
#define MAX_PARTS 64

typedef void (*run_fn)(void *job, int k);

static struct {
    pthread_mutex_t busy; /* held by the caller whose job the workers run */
    pthread_mutex_t mu;   /* guards the fields below */
    pthread_cond_t go, done;
    int workers;
    unsigned long gen; /* bumped per job: a worker runs runs of jobs newer than the last it saw */
    run_fn fn;
    void *job;
    int parts, next, finished;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
          0, 0, NULL, NULL, 0, 0, 0};

/* Runs of the current job, taken one at a time; called and returns with pool.mu held. */
static void take_runs(void) {
    while (pool.next < pool.parts) {
        int k = pool.next++;
        run_fn fn = pool.fn;
        void *job = pool.job;
        pthread_mutex_unlock(&pool.mu);
        fn(job, k);
        pthread_mutex_lock(&pool.mu);
        if (++pool.finished == pool.parts) pthread_cond_broadcast(&pool.done);
    }
}

static void *worker(void *arg) {
    (void)arg;
    unsigned long seen = 0;
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        while (pool.gen == seen) pthread_cond_wait(&pool.go, &pool.mu);
        seen = pool.gen;
        take_runs();
    }
    return NULL;
}

/* In a forked child only the forking thread exists: start over with no workers. */
static void forget_workers(void) {
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.go, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.workers = 0;
    pool.parts = pool.next = pool.finished = 0;
}
__attribute__((constructor)) static void watch_forks(void) { pthread_atfork(NULL, NULL, forget_workers); }

/* fn(job, k) for k < parts, on this thread and parts - 1 workers; returns when all have run. */
static void run_all(run_fn fn, void *job, int parts) {
    if (parts > 1 && pthread_mutex_trylock(&pool.busy) == 0) {
        pthread_mutex_lock(&pool.mu);
        while (pool.workers < parts - 1) {
            pthread_t t;
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            int failed = pthread_create(&t, &attr, worker, NULL);
            pthread_attr_destroy(&attr);
            if (failed) break; /* fewer workers: this thread runs more of the runs */
            pool.workers++;
        }
        pool.next = pool.finished = 0;
        pool.fn = fn;
        pool.job = job;
        pool.parts = parts;
        pool.gen++;
        pthread_cond_broadcast(&pool.go);
        take_runs();
        while (pool.finished < pool.parts) pthread_cond_wait(&pool.done, &pool.mu);
        pool.parts = pool.next = 0;
        pthread_mutex_unlock(&pool.mu);
        pthread_mutex_unlock(&pool.busy);
        return;
    }
    for (int k = 0; k < parts; k++) fn(job, k);
}

static inline int nparts(int64_t n, int threads) {
    int64_t p = n / MIN_PART;
    if (p > threads) p = threads;
    if (p > MAX_PARTS) p = MAX_PARTS;
    return p < 1 ? 1 : (int)p;
}

static inline int64_t cut(int64_t n, int parts, int k) { /* start of run k; cut(n, parts, parts) == n */
    int64_t blocks = (n + BLOCK - 1) / BLOCK, c = blocks * k / parts * BLOCK;
    return c < n ? c : n;
}

/* A job: the kernel's arguments, its run count, and per-run results (statistics rows, sums). */
typedef struct {
    const void *a, *b;
    void *out, *out2, *out3;
    int64_t n, tail;
    double unit, res[MAX_PARTS], rows[2 * MAX_PARTS];
    float f, g;
    int flag, flag2, stream, parts, has_stats;
} job_t;

#define RUN(name) static void name(void *ctx, int k)
#define RANGE                                                                     \
    job_t *j = ctx;                                                               \
    const int64_t lo = cut(j->n, j->parts, k), hi = cut(j->n, j->parts, k + 1); \
    double *row = j->has_stats ? j->rows + 2 * k : NULL;                          \
    (void)row

RUN(run_sub) { RANGE; j->res[k] = sub_sumsq((const float *)j->a + lo, (const float *)j->b + lo, (float *)j->out + lo, hi - lo, j->stream); }
RUN(run_copy) { RANGE; copy_((const float *)j->a + lo, (float *)j->out + lo, hi - lo, j->stream); }
RUN(run_max) { RANGE; j->res[k] = max_abs((const float *)j->a + lo, hi - lo); }
RUN(run_encode) {
    RANGE;
    encode_f16((const float *)j->a + lo, hi - lo, j->f, (half *)j->out + lo, j->out2 ? (float *)j->out2 + lo : NULL,
               j->unit, row, j->stream);
}
RUN(run_decode) { RANGE; decode_f16((const half *)j->a + lo, hi - lo, j->unit, (float *)j->out + lo, row, j->stream); }
RUN(run_add_f16) { RANGE; add_f16((float *)j->out + lo, (const half *)j->a + lo, hi - lo, j->unit, j->flag, row); }
RUN(run_add_f32) { RANGE; add_f32((float *)j->out + lo, (const float *)j->a + lo, hi - lo, j->f, j->flag, row); }
/* Runs `fn` over the job's n values (the job's rows start zeroed, as every caller initialises it);
 * adds the runs' statistics to `stats` (nullable) in run order. */
static void split(run_fn fn, job_t *j, int threads, double *stats) {
    j->parts = nparts(j->n, threads);
    j->has_stats = stats != NULL;
    run_all(fn, j, j->parts);
    for (int k = 0; stats && k < j->parts; k++) {
        stats[0] += j->rows[2 * k];
        stats[1] += j->rows[2 * k + 1];
    }
}

double zb_sub_sumsq(const float *a, const float *b, float *out, int64_t n, int stream, int threads) {
    job_t j = {.a = a, .b = b, .out = out, .n = n, .stream = stream};
    split(run_sub, &j, threads, NULL);
    double sum = 0.0;
    for (int k = 0; k < j.parts; k++) sum += j.res[k];
    return sum;
}

void zb_copy(const float *in, float *out, int64_t n, int stream, int threads) {
    job_t j = {.a = in, .out = out, .n = n, .stream = stream};
    split(run_copy, &j, threads, NULL);
}

float zb_max_abs(const float *x, int64_t n, int threads) {
    job_t j = {.a = x, .n = n};
    split(run_max, &j, threads, NULL);
    float best = 0.0f;
    for (int k = 0; k < j.parts; k++) {
        float m = (float)j.res[k];
        if (m != m) return NAN;
        best = m > best ? m : best;
    }
    return best;
}

void zb_encode_f16(const float *x, int64_t n, float factor, half *out, float *decoded, double unit, double *stats,
                   int stream, int threads) {
    job_t j = {.a = x, .out = out, .out2 = decoded, .n = n, .f = factor, .unit = unit, .stream = stream};
    split(run_encode, &j, threads, stats);
}

void zb_decode_f16(const half *in, int64_t n, double unit, float *out, double *stats, int stream, int threads) {
    job_t j = {.a = in, .out = out, .n = n, .unit = unit, .stream = stream};
    split(run_decode, &j, threads, stats);
}

void zb_add_f16(float *total, const half *in, int64_t n, double unit, int first, double *stats, int threads) {
    job_t j = {.a = in, .out = total, .n = n, .unit = unit, .flag = first};
    split(run_add_f16, &j, threads, stats);
}

void zb_add_f32(float *total, const float *x, int64_t n, float weight, int first, double *stats, int threads) {
    job_t j = {.a = x, .out = total, .n = n, .f = weight, .flag = first};
    split(run_add_f32, &j, threads, stats);
}
