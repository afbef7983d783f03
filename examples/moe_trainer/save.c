/*
 * save.c: moe_trainer's --save (the full f32 parameters in a safetensors file) and its
 * checkpoints: --save-dir (moonshard checkpoints of the units through the embedding API, the
 * trainer's own state in their extra), --resume and --init-from.
 */
#include "save.h"
#include "tp.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void put_le(FILE *f, uint64_t v, int nbytes) {
    for (int k = 0; k < nbytes; k++) fputc((int)(v >> (8 * k) & 0xff), f);
}

// The header JSON (names in table order, offsets contiguous, padded with spaces to a
// multiple of 8 bytes as safetensors writers do), then the data as little-endian f32.
static int write_safetensors(FILE *f, const ModelParam *table, int n, const float *data, size_t numel) {
    char *header = NULL;
    size_t len = 0;
    FILE *h = open_memstream(&header, &len);
    if (!h) return -1;
    for (int i = 0; i < n; i++) {
        const ModelParam *p = &table[i];
        fprintf(h, "%s\"%s\":{\"dtype\":\"F32\",\"shape\":[", i ? "," : "{", p->name);
        for (int d = 0; d < p->ndim; d++) fprintf(h, "%s%d", d ? "," : "", p->shape[d]);
        fprintf(h, "],\"data_offsets\":[%zu,%zu]}", 4 * p->offset, 4 * (p->offset + p->numel));
    }
    fputc('}', h);
    while (ftell(h) % 8) fputc(' ', h);
    int ok = fclose(h) == 0;
    if (ok) {
        put_le(f, len, 8);
        fwrite(header, 1, len, f);
        for (size_t j = 0; j < numel; j++) {
            uint32_t bits;
            memcpy(&bits, &data[j], 4);
            put_le(f, bits, 4);
        }
        ok = fflush(f) == 0 && !ferror(f);
    }
    free(header);
    return ok ? 0 : -1;
}

// Rank 0, after the last step: the parameters into a new file FILE.XXXXXX beside FILE,
// written and synced to disk; main renames it to FILE once every rank has succeeded
// (save_end).  A failure here removes it.
static ms_status write_save_file(Trainer *tr, const float *full, size_t P) {
    const Options *o = tr->opt;
    const size_t len = strlen(o->save_path) + sizeof ".XXXXXX";
    char *tmp = malloc(len);
    if (!tmp) return fail(tr, MS_ERR_OOM, "--save", "out of memory");
    snprintf(tmp, len, "%s.XXXXXX", o->save_path);
    const int fd = mkstemp(tmp);
    if (fd < 0) {
        const int e = errno;
        free(tmp);
        return fail(tr, MS_ERR_IO, "--save", "cannot create a file in %s: %s", o->save_dir, strerror(e));
    }
    FILE *f = NULL;
    int ok = fchmod(fd, o->save_mode) == 0 && (f = fdopen(fd, "wb")) != NULL;
    ok = ok && write_safetensors(f, tr->table, tr->nparams, full, P) == 0 && fsync(fd) == 0; // flushed: fsync
    int e = errno;
    if (f ? fclose(f) != 0 : close(fd) != 0) {
        if (ok) e = errno;
        ok = 0;
    }
    if (!ok) {
        unlink(tmp);
        const ms_status st = fail(tr, MS_ERR_IO, "--save", "cannot write %s (as %s): %s", o->save, tmp, strerror(e));
        free(tmp);
        return st;
    }
    tr->args->save_tmp = tmp;
    return MS_OK;
}

// An all_reduce over the world of n floats in place.
static ms_status all_reduce_floats(Trainer *tr, float *x, size_t n, ms_op op) {
    ms_tensor *t = NULL;
    int64_t len = (int64_t)n;
    TRY("--save", ms_tensor_wrap(&t, x, 1, &len, MS_F32));
    ms_status st = ms_all_reduce(tr->world, t, op);
    ms_tensor_release(t);
    TRY("--save: all_reduce over the world", st);
    return MS_OK;
}

// The f32 master shards (not the bf16 a unit may gather in) assembled on every rank: each
// rank writes the elements it holds (under a pipeline, of its stage's parameters) into a -inf
// buffer and an all_reduce max over the world fills it (ranks holding the same element must
// hold the same value: checked with a min, which is how tp's replicated parameters are seen
// to stay equal).  A shard is the rows
// [offset, offset + rows) of its shard dim (ms_unit_param_offset) of the part of the
// parameter the rank's unit holds (param_part: the whole tensor, its local experts, or its tp
// piece, which is assembled apart and then put in its place, tp_put_piece).
ms_status save(Trainer *tr) {
    const size_t P = model_param_numel(tr->cfg);
    float *full = tr->grads; // (P) reused: the assembled parameters
    for (size_t j = 0; j < P; j++) full[j] = -INFINITY;
    for (int i = 0; i < tr->nparams; i++) {
        if (tr->unit_of[i] < 0) continue; // another pipeline stage's: its ranks write it
        const ModelParam *p = &tr->table[i];
        ms_unit *u = tr->units[tr->unit_of[i]];
        size_t numel;
        int64_t shape[3], offset, rows;
        int dim;
        const size_t part = param_part(tr, i, &numel, shape);
        ms_tensor *shard, *values = NULL;
        TRY("--save", ms_unit_param_offset(u, tr->index_of[i], &dim, &offset, &rows));
        GET(shard, "--save", ms_unit_param_shard(u, tr->index_of[i]));
        TRY("--save: reading a shard", ms_tensor_to(&values, shard, MS_F32));
        // values: the part's (outer, shape[dim], inner) narrowed to (outer, rows, inner)
        size_t outer = 1, inner = 1;
        for (int d = 0; d < dim; d++) outer *= (size_t)shape[d];
        for (int d = dim + 1; d < p->ndim; d++) inner *= (size_t)shape[d];
        const size_t run = (size_t)rows * inner;
        const float *v = ms_tensor_data(values);
        const int piece = tp_split_dim(tr, i) >= 0;
        float *dst = piece ? tr->params + p->offset : full + p->offset + part; // params: free after the last step
        for (size_t j = 0; piece && j < numel; j++) dst[j] = -INFINITY;
        const int fits =
            (size_t)ms_tensor_numel(values) == outer * run && outer * (size_t)shape[dim] * inner == numel;
        for (size_t o = 0; fits && run && o < outer; o++)
            memcpy(dst + (o * (size_t)shape[dim] + (size_t)offset) * inner, v + o * run, run * sizeof *v);
        ms_tensor_release(values);
        if (fits && piece) tp_put_piece(tr, i, dst, full + p->offset);
        if (!fits)
            return fail(tr, MS_ERR_INTERNAL, "--save", "the shard of %s does not match its part of the parameter",
                        p->name);
    }
    // The replicas' agreement, checked: the smallest value any rank holds of each element (a
    // copy with +inf where this rank holds none, all_reduce min) must be the largest.
    float *low = malloc(P * sizeof *low);
    if (!low) return fail(tr, MS_ERR_OOM, "--save", "out of memory");
    for (size_t j = 0; j < P; j++) low[j] = full[j] == -INFINITY ? INFINITY : full[j];
    ms_status st = all_reduce_floats(tr, full, P, MS_OP_MAX);
    if (!st) st = all_reduce_floats(tr, low, P, MS_OP_MIN);
    size_t differ = 0, first = P;
    for (size_t j = 0; !st && j < P; j++)
        if (low[j] != full[j] && full[j] != -INFINITY && differ++ == 0) first = j;
    const double gap = first < P ? (double)full[first] - low[first] : 0.0;
    free(low);
    if (st) return st;
    for (size_t j = 0; j < P; j++)
        if (full[j] == -INFINITY) return fail(tr, MS_ERR_INTERNAL, "--save", "element %zu is held by no rank", j);
    if (differ) {
        int i = 0;
        while (i + 1 < tr->nparams && tr->table[i + 1].offset <= first) i++;
        return fail(tr, MS_ERR_INTERNAL, "--save", "%zu elements differ between the ranks holding them, the first in %s "
                    "(element %zu, by %g): replicas must hold the same values", differ, tr->table[i].name,
                    first - tr->table[i].offset, gap);
    }
    return tr->args->rank == 0 ? write_save_file(tr, full, P) : MS_OK;
}

// ----------------------------------------------------------------------------
// checkpoints: --save-dir, --resume, --init-from

// The model sizes a checkpoint's extra records and --resume compares.
static const struct {
    const char *key;
    size_t off;
} SIZES[] = {
    {"hidden_size", offsetof(ModelConfig, hidden_size)}, {"num_layers", offsetof(ModelConfig, num_layers)},
    {"num_experts", offsetof(ModelConfig, num_experts)}, {"top_k", offsetof(ModelConfig, top_k)},
    {"expert_dim", offsetof(ModelConfig, expert_dim)},   {"num_shared", offsetof(ModelConfig, num_shared)},
    {"conv_kernel", offsetof(ModelConfig, conv_kernel)}, {"seq_len", offsetof(ModelConfig, seq_len)},
};
#define SIZE_OF(cfg, k) (*(const int *)((const char *)(cfg) + SIZES[k].off))

// The value of "key" in the flat JSON object the trainer wrote (json.encode gives it back
// compact, keys sorted): a string without its quotes, or a number's text; NULL when absent.
static const char *extra_field(const char *json, const char *key, char *out, size_t len) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *at = strstr(json, pat);
    if (!at) return NULL;
    at += strlen(pat);
    const int quoted = *at == '"';
    at += quoted;
    size_t n = 0;
    while (at[n] && (quoted ? at[n] != '"' : at[n] != ',' && at[n] != '}')) n++;
    if (n >= len) n = len - 1;
    memcpy(out, at, n);
    out[n] = '\0';
    return out;
}

int checkpoint_dir_steps(const char *dir, long after, char *first, char *last, size_t len) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    long lo = -1, hi = -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        const char *name = e->d_name;
        if (strncmp(name, "step_", 5) || !name[5] || strspn(name + 5, "0123456789") != strlen(name + 5)) continue;
        const long k = strtol(name + 5, NULL, 10);
        if (k <= after) continue;
        n++;
        if (lo < 0 || k < lo) lo = k;
        if (k > hi) hi = k;
    }
    closedir(d);
    if (n) {
        snprintf(first, len, "step_%08ld", lo);
        snprintf(last, len, "step_%08ld", hi);
    }
    return n;
}

ms_status checkpoint_dir_check(Trainer *tr, long done) {
    const Options *o = tr->opt;
    char first[64] = "", last[64] = "";
    const int n = checkpoint_dir_steps(o->ckpt_dir, done, first, last, sizeof first);
    if (n > 0)
        return fail(tr, MS_ERR_ARG, "--save-dir", "%s holds %d checkpoint%s past step %ld, where this run resumes (%s%s%s): "
                    "its saves would collide with them; remove them or give another --save-dir", o->ckpt_dir, n,
                    n == 1 ? "" : "s", done, first, n > 1 ? " .. " : "", n > 1 ? last : "");
    return MS_OK;
}

// s as the body of a JSON string (quotes, backslashes and control bytes escaped) into out.
static void json_escape(const char *s, char *out, size_t len) {
    size_t n = 0;
    for (; *s && n + 7 < len; s++) {
        const unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            out[n++] = '\\';
            out[n++] = (char)c;
        } else if (c < 0x20) {
            n += (size_t)snprintf(out + n, len - n, "\\u%04x", c);
        } else {
            out[n++] = (char)c;
        }
    }
    out[n] = '\0';
}

// After step `step` (the last, or every --save-every): the units into --save-dir, with the
// data-loader position (batches are drawn for (seed, step): the next is step + 1), the RNG
// state (the seed: every draw is a hash of it and the step), the lr schedule and its
// position, and the model's sizes in extra.  Collective.
ms_status checkpoint_save(Trainer *tr, long step) {
    const Options *o = tr->opt;
    char extra[3072], data[1100];
    json_escape(o->data ? o->data : DATA_DEFAULT_PATH, data, sizeof data);
    int n = snprintf(extra, sizeof extra,
                     "{\"moe_trainer\":1,\"step\":%ld,\"data_next_step\":%ld,\"seed\":\"%llu\",\"lr\":%.17g,"
                     "\"lr_peak\":%.17g,\"lr_min\":%.17g,\"warmup_steps\":%ld,\"total_steps\":%ld,\"batch_size\":%d,"
                     "\"mesh\":\"%s\",\"world\":%d,\"data\":\"%s\",\"eval_held_out\":%d",
                     step, step + 1, o->seed, step > 0 ? tr->lr : 0.0, o->lr, o->min_lr, o->warmup, o->steps,
                     o->batch_size, o->mesh, o->nranks, data, o->eval_every > 0);
    for (size_t k = 0; k < sizeof SIZES / sizeof SIZES[0]; k++)
        n += snprintf(extra + n, sizeof extra - (size_t)n, ",\"%s\":%d", SIZES[k].key, SIZE_OF(&o->model, k));
    snprintf(extra + n, sizeof extra - (size_t)n, "}");
    const double t0 = now_seconds();
    TRY("--save-dir", ms_interp_checkpoint_save(tr->in, o->ckpt_dir, step, extra, o->keep_last));
    if (tr->args->rank == 0) {
        printf("# saved: %s/step_%08ld (step %ld) in %.3f s\n", o->ckpt_dir, step, step, now_seconds() - t0);
        fflush(stdout);
    }
    return MS_OK;
}

// --resume: the checkpoint's extra checked against this run (saved by moe_trainer, the same
// model sizes, the same seed, a step within --steps), then loaded into the units on this
// mesh, whatever mesh saved it.  *done: the checkpoint's step; tr->resume_note: the banner's.
ms_status checkpoint_resume(Trainer *tr, long *done) {
    const Options *o = tr->opt;
    int64_t step = 0;
    char *extra = NULL, v[128], mesh[128] = "?", world[32] = "?", lr[64] = "?";
    TRY("--resume", ms_interp_checkpoint_read(tr->in, o->resume, &step, &extra));
    ms_status st = MS_OK;
    char diff[1024] = "";
    size_t len = 0;
    if (!extra || !extra_field(extra, "moe_trainer", v, sizeof v)) {
        st = fail(tr, MS_ERR_ARG, "--resume", "%s: its checkpoint (step %lld) was not saved by moe_trainer: its extra "
                  "has no trainer state", o->resume, (long long)step);
    } else {
        for (size_t k = 0; k < sizeof SIZES / sizeof SIZES[0]; k++) {
            const long want = SIZE_OF(&o->model, k);
            if (extra_field(extra, SIZES[k].key, v, sizeof v) && strtol(v, NULL, 10) == want) continue;
            len += (size_t)snprintf(diff + len, sizeof diff - len, "%s%s %s (this run %ld)", len ? ", " : "",
                                    SIZES[k].key, extra_field(extra, SIZES[k].key, v, sizeof v) ? v : "unknown", want);
            if (len >= sizeof diff) len = sizeof diff - 1;
        }
        char seed[32];
        snprintf(seed, sizeof seed, "%llu", o->seed);
        if (len)
            st = fail(tr, MS_ERR_ARG, "--resume", "%s: the checkpoint's model differs from this run's: %s", o->resume,
                      diff);
        else if (!extra_field(extra, "seed", v, sizeof v) || strcmp(v, seed))
            st = fail(tr, MS_ERR_ARG, "--resume", "%s: the checkpoint was trained with --seed %s, this run has --seed "
                      "%s (the batches are drawn from the seed and the step): give --seed %s", o->resume, v, seed, v);
        else if (step > o->steps)
            st = fail(tr, MS_ERR_ARG, "--resume", "%s: the checkpoint is at step %lld, past --steps %ld (--steps is the "
                      "total count)", o->resume, (long long)step, o->steps);
        extra_field(extra, "mesh", mesh, sizeof mesh);
        extra_field(extra, "world", world, sizeof world);
        extra_field(extra, "lr", lr, sizeof lr);
        // the lr schedule is this run's flags': say so when they are not the saved run's
        char pk[64] = "", mn[64] = "", wu[32] = "", tot[32] = "";
        extra_field(extra, "lr_peak", pk, sizeof pk);
        extra_field(extra, "lr_min", mn, sizeof mn);
        extra_field(extra, "warmup_steps", wu, sizeof wu);
        extra_field(extra, "total_steps", tot, sizeof tot);
        // (a constant lr is the same whatever the step count)
        const int constant = strtod(pk, NULL) == strtod(mn, NULL) && strtol(wu, NULL, 10) == 0 && o->lr == o->min_lr &&
                             o->warmup == 0;
        if (strtod(pk, NULL) != o->lr || strtod(mn, NULL) != o->min_lr || strtol(wu, NULL, 10) != o->warmup ||
            (!constant && strtol(tot, NULL, 10) != o->steps))
            snprintf(tr->resume_schedule, sizeof tr->resume_schedule, "the saved run's lr schedule was --lr %.9g "
                     "--min-lr %.9g --warmup-steps %s --steps %s; this run's flags differ, and its lr follows them",
                     strtod(pk, NULL), strtod(mn, NULL), wu, tot);
        // the batches: drawn for (seed, step) from the text, batch_size rows of it, less the
        // held-out tail under --eval-every; another of these draws other batches
        char bs[32] = "", dpath[1100] = "", held[8] = "", mine[1100];
        json_escape(o->data ? o->data : DATA_DEFAULT_PATH, mine, sizeof mine);
        extra_field(extra, "batch_size", bs, sizeof bs);
        const int has_data = extra_field(extra, "data", dpath, sizeof dpath) != NULL;
        const int has_held = extra_field(extra, "eval_held_out", held, sizeof held) != NULL;
        if ((bs[0] && strtol(bs, NULL, 10) != o->batch_size) || (has_data && strcmp(dpath, mine)) ||
            (has_held && (strtol(held, NULL, 10) != 0) != (o->eval_every > 0)))
            snprintf(tr->resume_data, sizeof tr->resume_data, "the saved run drew its batches from %s (batch_size %s%s); "
                     "this run's %s (batch_size %d%s): its batches are not the ones the saved run would have drawn",
                     has_data ? dpath : "?", bs[0] ? bs : "?", has_held && strtol(held, NULL, 10) ? ", a tail held out "
                     "for --eval-every" : "", mine, o->batch_size, o->eval_every ? ", a tail held out for --eval-every" : "");
    }
    free(extra);
    if (st) return st;
    int64_t loaded = 0;
    TRY("--resume", ms_interp_checkpoint_load(tr->in, o->resume, &loaded, NULL));
    if (loaded != step) return fail(tr, MS_ERR_STATE, "--resume", "%s changed while it was read (step %lld, then %lld)",
                                    o->resume, (long long)step, (long long)loaded);
    *done = (long)step;
    if (step < o->steps)
        snprintf(tr->resume_note, sizeof tr->resume_note, "%s at step %lld (saved on mesh %s, world %s; its lr %.9g): "
                 "steps %lld..%ld run here", o->resume, (long long)step, mesh, world, strtod(lr, NULL),
                 (long long)step + 1, o->steps);
    else
        snprintf(tr->resume_note, sizeof tr->resume_note, "%s at step %lld (saved on mesh %s, world %s; its lr %.9g): "
                 "--steps %ld is the total, so no step runs here", o->resume, (long long)step, mesh, world,
                 strtod(lr, NULL), o->steps);
    if (o->ckpt_dir) return checkpoint_dir_check(tr, (long)step);
    return MS_OK;
}
