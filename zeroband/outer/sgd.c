/* The outer optimizer's native kernel: Nesterov / heavy-ball SGD on the outer copy, written into the
 * local shard in the same pass (zeroband/outer/sgd_kernel.py loads it and checks it against torch).
 *
 * Not a file of its own: it is compiled as one translation unit after zeroband/comm/kernels.c
 * (`-include`), whose vector helpers (vload, vfma, vput, lead, fence), job type and thread pool it
 * uses, so its bits follow the same rules (one IEEE operation per step, -ffp-contract=off). */

/* The outer optimizer: torch's CPU fused SGD (dampening 0, no weight decay) as its kernel rounds:
 *   buf = first ? g : buf * m + g       (the product rounded, then the sum; one fma(buf, m, g) in
 *                                        torch's scalar loop over a tensor's last values, from
 *                                        `tail_from` on)
 *   d   = nesterov ? fma(buf, m, g) : buf
 *   p   = fma(d, -lr, p)                 (momentum 0: no buffer, d = g)
 * zeroband/outer/sgd_kernel.py checks these bits against torch's own optimizer before using this, since
 * where torch's compiler fused a product into a sum is a property of its build. `local` (nullable,
 * streamed when `stream`) receives the new p in the same pass: the copy back into the model. */
static void sgd(float *p, const float *g, float *buf, float *local, int64_t n, float lr, float m, int nesterov,
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

RUN(run_sgd) {
    RANGE;
    sgd((float *)j->out + lo, (const float *)j->a + lo, j->out2 ? (float *)j->out2 + lo : NULL,
        j->out3 ? (float *)j->out3 + lo : NULL, hi - lo, j->f, j->g, j->flag, j->flag2,
        j->tail < lo ? 0 : (j->tail > hi ? hi : j->tail) - lo, j->stream);
}


/* `tail_from` is where torch's scalar loop starts in the whole vector: each run gets its own offset */
void zb_sgd(float *p, const float *g, float *buf, float *local, int64_t n, float lr, float m, int nesterov,
            int first, int64_t tail_from, int stream, int threads) {
    job_t j = {.a = g, .out = p, .out2 = buf, .out3 = local, .n = n, .f = lr, .g = m, .flag = nesterov,
               .flag2 = first, .tail = tail_from, .stream = stream};
    split(run_sgd, &j, threads, NULL);
}
