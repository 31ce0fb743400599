/* Fused fp32 RoPE re-rotation (half-split "rotate_half" layout), one streaming pass.
 *
 * o[l,h,t,j]        = x[j] * c[j]        + x[j+half] * s[j]          (s[j] = -sin)
 * o[l,h,t,j+half]   = x[j+half] * c[j+half] + x[j] * s[j+half]       (s[j+half] = +sin)
 * o[l,h,t,rot:]     = x[l,h,t,rot:]   (skipped when o is x)
 * c, s: [rows, tc, rot] contiguous fp32 (tc = 1: one row for every token); row_of[l] picks the row.
 * Strides are in elements for the layer, head and token dims; the last dim is contiguous.
 * Work is split over (layer, block of TB tokens) units across n_threads pthreads; inside a
 * unit the heads are the inner loop, so a per-token cos/sin row is read once for all heads. Built and loaded by
 * kvruntime/rope_native.py; the fp64 reference is kvruntime.rope.rotate_keys. */
#include <pthread.h>
#include <string.h>

typedef struct {
    const float *x; float *o; const float *c; const float *s; const long *row_of;
    long L, H, T, D, rot, tc, xs[3], os[3]; long first, last;
} job_t;

#define TB 256L

static void *run(void *arg) {
    const job_t *j = (const job_t *)arg;
    const long half = j->rot / 2, tstep = j->tc == 1 ? 0 : j->rot, nblk = (j->T + TB - 1) / TB;
    const int in_place = j->x == j->o && j->xs[0] == j->os[0] && j->xs[1] == j->os[1] && j->xs[2] == j->os[2];
    for (long u = j->first; u < j->last; u++) {
        const long l = u / nblk, t0 = (u % nblk) * TB, t1 = t0 + TB < j->T ? t0 + TB : j->T;
        const float *cr = j->c + j->row_of[l] * j->tc * j->rot, *sr = j->s + j->row_of[l] * j->tc * j->rot;
        for (long t = t0; t < t1; t++) for (long h = 0; h < j->H; h++) {
            const float *xt = j->x + l * j->xs[0] + h * j->xs[1] + t * j->xs[2];
            const float *ct = cr + t * tstep, *st = sr + t * tstep;
            float *ot = j->o + l * j->os[0] + h * j->os[1] + t * j->os[2];
            for (long k = 0; k < half; k++) {
                const float a = xt[k], b = xt[k + half];
                ot[k] = a * ct[k] + b * st[k];
                ot[k + half] = b * ct[k + half] + a * st[k + half];
            }
            if (!in_place && j->rot < j->D)
                memcpy(ot + j->rot, xt + j->rot, (size_t)(j->D - j->rot) * sizeof(float));
        }
    }
    return 0;
}

int kv_rope_rotate_f32(const float *x, float *o, const float *c, const float *s, const long *row_of,
                       long L, long H, long T, long D, long rot, long tc,
                       const long *xs, const long *os, int n_threads) {
    enum { MAXT = 64 };
    job_t jobs[MAXT];
    pthread_t tid[MAXT];
    const long units = L * ((T + TB - 1) / TB);
    if (n_threads < 1) n_threads = 1;
    if (n_threads > MAXT) n_threads = MAXT;
    if (n_threads > units) n_threads = (int)units;
    if (units == 0 || T == 0) return 0;
    for (int i = 0; i < n_threads; i++) {
        job_t j = {x, o, c, s, row_of, L, H, T, D, rot, tc, {xs[0], xs[1], xs[2]}, {os[0], os[1], os[2]},
                   units * i / n_threads, units * (i + 1) / n_threads};
        jobs[i] = j;
    }
    int started = 0;
    for (int i = 1; i < n_threads; i++) {
        if (pthread_create(&tid[i], 0, run, &jobs[i]) != 0) break;
        started = i;
    }
    run(&jobs[0]);
    for (int i = started + 1; i < n_threads; i++) run(&jobs[i]);   /* threads that failed to start */
    for (int i = 1; i <= started; i++) pthread_join(tid[i], 0);
    return 0;
}
