/*
 * unit_math.c: the shard units' element-wise arithmetic on host memory (unit_math.h).
 * Blocks of EW_BLOCK elements are widened to the compute dtype with the CPU casts
 * (ms__cast_contig), computed, and rounded back: the same per-element rules as the
 * device's one element at a time (core/cuda/unit_element.h).
 */
#include "ms_internal.h"
#include "unit_math.h"

/* Elements per block: the opmath blocks (8 KiB each as f64) stay in L1. */
enum { EW_BLOCK = 1024 };

void ms__ew(ms_ew_op op, void *dst, ms_dtype dd, double s, const void *src, ms_dtype sd, bool round_src, int64_t n) {
    const bool wide = dd == MS_F64 || (op == MS_EW_ADD && sd == MS_F64);
    const ms_dtype ot = wide ? MS_F64 : MS_F32;
    const int64_t des = ms_dtype_size(dd), ses = op == MS_EW_ADD ? ms_dtype_size(sd) : 0;
    const float sf = (float)s;
    union {
        float f[EW_BLOCK];
        double d[EW_BLOCK];
    } a, b;                                          /* (m) opmath: dst, src */
    _Alignas(8) unsigned char rounded[EW_BLOCK * 8]; /* (m) src rounded to dd */
    for (int64_t off = 0; off < n; off += EW_BLOCK) {
        const int64_t m = n - off < EW_BLOCK ? n - off : EW_BLOCK;
        char *d = (char *)dst + off * des;
        ms__cast_contig(&a, ot, d, dd, m);
        if (op == MS_EW_ADD) {
            const void *x = (const char *)src + off * ses;
            ms_dtype xt = sd;
            if (round_src && sd != dd) {
                ms__cast_contig(rounded, dd, x, sd, m);
                x = rounded;
                xt = dd;
            }
            ms__cast_contig(&b, ot, x, xt, m);
            if (wide) for (int64_t i = 0; i < m; i++) a.d[i] += b.d[i];
            else for (int64_t i = 0; i < m; i++) a.f[i] += b.f[i];
        } else if (wide) {
            for (int64_t i = 0; i < m; i++) a.d[i] = op == MS_EW_MUL ? a.d[i] * s : a.d[i] / s;
        } else {
            for (int64_t i = 0; i < m; i++) a.f[i] = op == MS_EW_MUL ? a.f[i] * sf : a.f[i] / sf;
        }
        ms__cast_contig(d, dd, &a, ot, m);
    }
}

double ms__sum_sq(const void *x, ms_dtype dt, int64_t n) {
    double a[EW_BLOCK], s = 0; /* (m) x widened */
    const int64_t es = ms_dtype_size(dt);
    for (int64_t off = 0; off < n; off += EW_BLOCK) {
        const int64_t m = n - off < EW_BLOCK ? n - off : EW_BLOCK;
        ms__cast_contig(a, MS_F64, (const char *)x + off * es, dt, m);
        for (int64_t i = 0; i < m; i++) s += a[i] * a[i];
    }
    return s;
}

void ms__adamw(float *w, float *m, float *v, const void *grad, ms_dtype gdt, void *stored_out, ms_dtype sdt,
               int64_t n, const ms_adamw_hyper *h) {
    const int64_t ges = ms_dtype_size(gdt);
    float g[EW_BLOCK]; /* (b) the gradient widened to f32 */
    for (int64_t off = 0; off < n; off += EW_BLOCK) {
        const int64_t b = n - off < EW_BLOCK ? n - off : EW_BLOCK;
        ms__cast_contig(g, MS_F32, (const char *)grad + off * ges, gdt, b);
        for (int64_t i = 0; i < b; i++) ms_adamw_update(&w[off + i], &m[off + i], &v[off + i], g[i], h);
    }
    if (stored_out) ms__cast_contig(stored_out, sdt, w, MS_F32, n);
}

void ms__adamw_torch(void *w, void *m, void *v, const void *grad, ms_dtype dt, int64_t n, const ms_adamw_hyper *h) {
    if (dt == MS_F64) {
        double *wd = w, *md = m, *vd = v;
        const double *g = grad;
        for (int64_t i = 0; i < n; i++) ms_adamw_update_f64(&wd[i], &md[i], &vd[i], g[i], h);
        return;
    }
    if (dt == MS_F32) {
        ms__adamw(w, m, v, grad, MS_F32, NULL, MS_F32, n, h);
        return;
    }
    const int kind = ms__round16_kind(dt);
    const int64_t es = ms_dtype_size(dt);
    float a[4][EW_BLOCK]; /* (b) w, m, v, grad widened to f32 */
    void *const io[3] = {w, m, v};
    for (int64_t off = 0; off < n; off += EW_BLOCK) {
        const int64_t b = n - off < EW_BLOCK ? n - off : EW_BLOCK;
        for (int k = 0; k < 3; k++) ms__cast_contig(a[k], MS_F32, (char *)io[k] + off * es, dt, b);
        ms__cast_contig(a[3], MS_F32, (const char *)grad + off * es, dt, b);
        for (int64_t i = 0; i < b; i++) ms_adamw_update_as(&a[0][i], &a[1][i], &a[2][i], a[3][i], h, kind);
        for (int k = 0; k < 3; k++) ms__cast_contig((char *)io[k] + off * es, dt, a[k], MS_F32, b);
    }
}
