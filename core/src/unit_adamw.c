/*
 * unit_adamw.c: the shard units' optimizer: AdamW on each rank's shards, with f32 master
 * weights (MS_ADAMW_MASTER) or in the stored dtype as torch.optim.AdamW (MS_ADAMW_TORCH),
 * its state (ms_unit_adamw_state) and the steps each parameter skipped without a gradient.
 */
#include "unit_internal.h"
#include "cuda.h"
#include "unit_math.h"

#include <math.h>

/* ---------------------------------------------------------------- AdamW */

/* p's AdamW state, made once: zero moments (f32, or the stored dtype with MS_ADAMW_TORCH),
 * and f32 master weights from the stored shard (MS_ADAMW_MASTER, stored dtype not f32). */
static ms_status adamw_state_make(ms_unit *u, unit_param *p) {
    if (p->exp_avg) return MS_OK;
    const int64_t n = ms_tensor_numel(p->shard);
    const ms_dtype mdt = u->adamw == MS_ADAMW_TORCH ? p->dtype : MS_F32;
    ms_status st = buf_new(u, MS_BYTES_OPTIMIZER, &p->exp_avg, 1, &n, mdt, true);
    if (!st) st = buf_new(u, MS_BYTES_OPTIMIZER, &p->exp_avg_sq, 1, &n, mdt, true);
    if (!st && u->adamw == MS_ADAMW_MASTER && p->dtype != MS_F32 &&
        !(st = buf_new(u, MS_BYTES_OPTIMIZER, &p->master, 1, &n, MS_F32, true)) && n)
        st = copy_into_flat(p->master, 0, p->shard); /* the f32 master weights from the stored shard */
    return st;
}

/* One AdamW step on the n real elements of p's shard (a prefix of its padded buffer), where
 * the shard is. */
static ms_status adamw_param(ms_unit *u, unit_param *p, const ms_adamw_hyper *h) {
    const int64_t n = ms_tensor_numel(p->shard);
    ms_status st = adamw_state_make(u, p);
    if (st) return st;
    if (u->adamw == MS_ADAMW_TORCH) { /* torch.optim.AdamW: the moments in the stored dtype, no master */
        if (!n) return MS_OK;
        void *w = ms_tensor_data(p->padded), *m = ms_tensor_data(p->exp_avg), *v = ms_tensor_data(p->exp_avg_sq);
        const void *grad = ms_tensor_data(p->grad_padded);
        if (shards_on_device(u)) return ms__cuda_adamw_torch(u->device, w, m, v, grad, p->dtype, n, h);
        ms__adamw_torch(w, m, v, grad, p->dtype, n, h);
        return MS_OK;
    }
    if (!n) return MS_OK;
    float *w = ms_tensor_data(p->master ? p->master : p->padded);
    float *m = ms_tensor_data(p->exp_avg), *v = ms_tensor_data(p->exp_avg_sq);
    const void *grad = ms_tensor_data(p->grad_padded);
    void *stored = p->master ? ms_tensor_data(p->padded) : NULL;
    if (shards_on_device(u)) return ms__cuda_adamw(u->device, w, m, v, grad, p->dtype, stored, p->dtype, n, h);
    ms__adamw(w, m, v, grad, p->dtype, stored, p->dtype, n, h);
    return MS_OK;
}

ms_status ms_unit_set_adamw(ms_unit *u, ms_adamw_mode mode) {
    MS_NOT_NULL(u);
    if ((int)mode != MS_ADAMW_MASTER && (int)mode != MS_ADAMW_TORCH)
        return ms__fail(MS_ERR_ARG, "unit '%s': set_adamw: mode %d: expected MS_ADAMW_MASTER (%d) or MS_ADAMW_TORCH (%d)",
                        unit_label(u), (int)mode, MS_ADAMW_MASTER, MS_ADAMW_TORCH);
    if (u->adamw_made && (int)mode != u->adamw)
        return ms__fail(MS_ERR_STATE, "unit '%s': set_adamw: the unit's AdamW state exists already (an adamw_step or "
                        "ms_unit_adamw_state made it); choose how it is kept before it is made", unit_label(u));
    u->adamw = mode;
    return ms__ok();
}

ms_tensor *ms_unit_adamw_state(ms_unit *u, int i, ms_adamw_state_kind which) {
    MS_NOT_NULL_OR(u, NULL);
    unit_param *p = NULL;
    if (param_at(u, "adamw_state", i, &p)) return NULL;
    if ((int)which < MS_ADAMW_EXP_AVG || (int)which > MS_ADAMW_MASTER_WEIGHTS) {
        ms__fail(MS_ERR_ARG, "unit '%s': adamw_state: which %d: expected MS_ADAMW_EXP_AVG (0), MS_ADAMW_EXP_AVG_SQ (1) "
                 "or MS_ADAMW_MASTER_WEIGHTS (2)", unit_label(u), (int)which);
        return NULL;
    }
    ms__ok();
    if (!p->requires_grad) return NULL; /* no gradient, no state */
    if (check_state(u, "adamw_state", ST_IDLE)) return NULL;
    if (!p->exp_avg) {
        ms_status st = adamw_state_make(u, p);
        if (st) {
            ms__wrap(st, "unit '%s': adamw_state", unit_label(u));
            return NULL;
        }
        u->adamw_made = true; /* the state exists: its mode is fixed */
    }
    ms__ok();
    return which == MS_ADAMW_EXP_AVG ? p->exp_avg : which == MS_ADAMW_EXP_AVG_SQ ? p->exp_avg_sq : p->master;
}

int64_t ms_unit_adamw_skipped(const ms_unit *u, int i) {
    MS_NOT_NULL_OR(u, -1);
    unit_param *p = NULL;
    if (param_at(u, "adamw_skipped", i, &p)) return -1;
    ms__ok();
    return p->skipped_steps;
}

ms_status ms_unit_set_adamw_skipped(ms_unit *u, int i, int64_t skipped) {
    MS_NOT_NULL(u);
    unit_param *p = NULL;
    ms_status st = param_at(u, "set_adamw_skipped", i, &p);
    if (st) return st;
    if (skipped < 0)
        return ms__fail(MS_ERR_ARG, "unit '%s': set_adamw_skipped: parameter '%s': %lld: expected a count >= 0",
                        unit_label(u), p->fqn, (long long)skipped);
    if (!p->requires_grad && skipped)
        return ms__fail(MS_ERR_ARG, "unit '%s': set_adamw_skipped: parameter '%s' is frozen: it takes no AdamW steps, so "
                        "it skips none", unit_label(u), p->fqn);
    p->skipped_steps = skipped;
    return ms__ok();
}

ms_status ms_adamw_defaults(double *beta1, double *beta2, double *eps, double *weight_decay) {
    MS_NOT_NULL(beta1);
    MS_NOT_NULL(beta2);
    MS_NOT_NULL(eps);
    MS_NOT_NULL(weight_decay);
    *beta1 = 0.9;
    *beta2 = 0.999;
    *eps = 1e-8;
    *weight_decay = 0.01;
    return ms__ok();
}

ms_status ms_unit_adamw_step(ms_unit *u, double lr, double beta1, double beta2, double eps, double weight_decay,
                             int64_t step) {
    MS_NOT_NULL(u);
    ms_status st = check_state(u, "adamw_step", ST(ST_SHARDED));
    if (st) return st;
    if (!(lr >= 0) || !(eps >= 0) || !(weight_decay >= 0) || !(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1) ||
        step < 1)
        return ms__fail(MS_ERR_ARG, "unit '%s': adamw_step: lr %g, betas (%g, %g), eps %g, weight_decay %g, step %lld: "
                        "expected lr, eps, weight_decay >= 0, 0 <= beta < 1 and step >= 1", unit_label(u), lr, beta1, beta2,
                        eps, weight_decay, (long long)step);
    /* torch counts steps per parameter (state['step'] advances only with a gradient): a
     * parameter that skipped k steps takes step - k in its bias corrections. */
    for (int i = 0; i < u->nparams; i++) {
        const unit_param *p = &u->params[i];
        if (p->has_grad && step - p->skipped_steps < 1)
            return ms__fail(MS_ERR_ARG, "unit '%s': adamw_step: step %lld: parameter '%s' had no gradient in %lld "
                            "earlier steps, so this would be its step %lld: expected step to count every adamw_step "
                            "call from 1", unit_label(u), (long long)step, p->fqn, (long long)p->skipped_steps,
                            (long long)(step - p->skipped_steps));
    }
    u->adamw_made = true;
    for (int i = 0; i < u->nparams && !st; i++) {
        unit_param *p = &u->params[i];
        if (!p->has_grad) {
            p->skipped_steps += p->requires_grad; /* a frozen one takes no steps */
            continue;
        }
        const double t = (double)(step - p->skipped_steps);
        ms_adamw_hyper h = {.d = {.decay = 1 - lr * weight_decay, .w1 = 1 - beta1, .b2 = beta2, .c2 = 1 - beta2,
                                  .step_size = lr / (1 - pow(beta1, t)), .bc2_sqrt = pow(1 - pow(beta2, t), 0.5),
                                  .eps = eps}};
        h.decay = (float)h.d.decay, h.w1 = (float)h.d.w1, h.b2 = (float)h.d.b2, h.c2 = (float)h.d.c2;
        h.step_size = (float)h.d.step_size, h.bc2_sqrt = (float)h.d.bc2_sqrt, h.eps = (float)h.d.eps;
        st = adamw_param(u, p, &h);
    }
    return st ? ms__wrap(st, "unit '%s': adamw_step", unit_label(u)) : ms__ok();
}
