/*
 * refdata.h: reads the reference data files of tests/reference/data (made by the scripts in
 * tests/reference/ from PyPI's PyTorch and friends; tests/reference/README.md).
 *
 * The format is line-based text, one record a line:
 *   # a comment (the scripts write the versions and the command that made the file here)
 *   <name> <type> <count> <value> ... <value>
 * with <type> one of x8 x16 x32 x64 (hexadecimal bit patterns without 0x), i64 (decimal
 * integers) or f64 (decimal numbers, as Python's repr prints them); a name has no spaces.
 * Every value is kept as a uint64_t (f64 as its bits, i64 as its two's complement).
 * refdata_get aborts the test with a message when a record is missing, so a test that
 * reads a record never silently checks nothing.
 */
#ifndef MS_REFDATA_H
#define MS_REFDATA_H

#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef MS_REFDATA_DIR
#error "MS_REFDATA_DIR (tests/reference/data) must be defined by the build"
#endif

typedef struct refrec {
    char name[160];
    char type[8];
    int64_t n;
    uint64_t *v; /* (n) */
} refrec;

typedef struct refdata {
    char path[512];
    refrec *recs;
    int64_t n, cap;
} refdata;

static inline void refdata_die(const char *path, long line, const char *what) {
    fprintf(stderr, "%s:%ld: %s\n", path, line, what);
    exit(2);
}

/* Loads MS_REFDATA_DIR/<file>; exits with a message naming the file and line when it is
 * missing or malformed. */
static inline refdata *refdata_load(const char *file) {
    refdata *d = calloc(1, sizeof *d);
    if (!d) refdata_die(file, 0, "out of memory");
    snprintf(d->path, sizeof d->path, "%s/%s", MS_REFDATA_DIR, file);
    FILE *f = fopen(d->path, "r");
    if (!f) {
        fprintf(stderr, "%s: %s (run tests/reference/make.sh to make it)\n", d->path, strerror(errno));
        exit(2);
    }
    char *line = NULL;
    size_t cap = 0;
    long lineno = 0;
    while (getline(&line, &cap, f) >= 0) {
        lineno++;
        char *save = NULL, *tok = strtok_r(line, " \t\r\n", &save);
        if (!tok || tok[0] == '#') continue;
        if (d->n == d->cap) {
            d->cap = d->cap ? 2 * d->cap : 64;
            d->recs = realloc(d->recs, (size_t)d->cap * sizeof *d->recs);
            if (!d->recs) refdata_die(d->path, lineno, "out of memory");
        }
        refrec *r = &d->recs[d->n];
        memset(r, 0, sizeof *r);
        if (strlen(tok) >= sizeof r->name) refdata_die(d->path, lineno, "record name too long");
        strcpy(r->name, tok);
        const char *type = strtok_r(NULL, " \t\r\n", &save), *count = strtok_r(NULL, " \t\r\n", &save);
        if (!type || !count || strlen(type) >= sizeof r->type) refdata_die(d->path, lineno, "expected: name type count values");
        strcpy(r->type, type);
        char *end;
        r->n = strtoll(count, &end, 10);
        if (*end || r->n < 0) refdata_die(d->path, lineno, "bad count");
        r->v = malloc((size_t)(r->n ? r->n : 1) * sizeof *r->v);
        if (!r->v) refdata_die(d->path, lineno, "out of memory");
        const int hex = type[0] == 'x', dec = !strcmp(type, "i64"), flt = !strcmp(type, "f64");
        if (!hex && !dec && !flt) refdata_die(d->path, lineno, "unknown type (x8 x16 x32 x64 i64 f64)");
        for (int64_t i = 0; i < r->n; i++) {
            const char *s = strtok_r(NULL, " \t\r\n", &save);
            if (!s) refdata_die(d->path, lineno, "fewer values than the count");
            errno = 0;
            if (hex) r->v[i] = strtoull(s, &end, 16);
            else if (dec) r->v[i] = (uint64_t)strtoll(s, &end, 10);
            else {
                const double x = strtod(s, &end);
                memcpy(&r->v[i], &x, sizeof x);
            }
            if (*end || errno) refdata_die(d->path, lineno, "bad value");
        }
        if (strtok_r(NULL, " \t\r\n", &save)) refdata_die(d->path, lineno, "more values than the count");
        d->n++;
    }
    free(line);
    fclose(f);
    return d;
}

/* The record `name`, which must exist (the test exits naming it otherwise). */
static inline const refrec *refdata_get(const refdata *d, const char *name) {
    for (int64_t i = 0; i < d->n; i++)
        if (!strcmp(d->recs[i].name, name)) return &d->recs[i];
    fprintf(stderr, "%s: no record '%s' (regenerate with tests/reference/make.sh)\n", d->path, name);
    exit(2);
}

/* The record `name`, or NULL. */
static inline const refrec *refdata_find(const refdata *d, const char *name) {
    for (int64_t i = 0; i < d->n; i++)
        if (!strcmp(d->recs[i].name, name)) return &d->recs[i];
    return NULL;
}

/* Element i of an f64 record. */
static inline double refdata_f64(const refrec *r, int64_t i) {
    double x;
    memcpy(&x, &r->v[i], sizeof x);
    return x;
}

static inline void refdata_free(refdata *d) {
    if (!d) return;
    for (int64_t i = 0; i < d->n; i++) free(d->recs[i].v);
    free(d->recs);
    free(d);
}

#endif
