/*
 * bench_args.h: the command line of the C benchmarks of bench/.  A bad argument is refused
 * with what was wrong and what was expected, exit status 2, before any output or work;
 * -h / --help prints the usage and exits 0.
 */
#ifndef MS_BENCH_ARGS_H
#define MS_BENCH_ARGS_H

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Macro x's value as a string literal, for usage texts. */
#define BENCH_STR_(x) #x
#define BENCH_STR(x) BENCH_STR_(x)

/* The program's name and usage text (its first line the synopsis), set by bench_args(). */
static const char *bench_prog = "bench", *bench_usage = "";
/* Set on the ranks of a multi-process run that are not the first: they stay silent. */
static bool bench_quiet;

/* Prints "prog: message" and the synopsis to stderr, exits 2. */
static inline void bench_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static inline void bench_fail(const char *fmt, ...) {
    if (!bench_quiet) {
        va_list ap;
        va_start(ap, fmt);
        fprintf(stderr, "%s: ", bench_prog);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
        const char *nl = strchr(bench_usage, '\n');
        fprintf(stderr, "\n%.*s\n(%s --help for more)\n", nl ? (int)(nl - bench_usage) : (int)strlen(bench_usage),
                bench_usage, bench_prog);
    }
    exit(2);
}

/* Records prog and usage; with -h or --help anywhere on the line, prints usage and exits 0. */
static inline void bench_args(const char *prog, const char *usage, int argc, char **argv) {
    bench_prog = prog;
    bench_usage = usage;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            if (!bench_quiet) fputs(usage, stdout);
            exit(0);
        }
}

/* The value of the option argv[*i], advancing *i to it. */
static inline const char *bench_value(int argc, char **argv, int *i) {
    if (*i + 1 >= argc) bench_fail("%s wants a value", argv[*i]);
    return argv[++*i];
}

/* s as a whole decimal integer in lo..hi; what names it in messages. */
static inline long long bench_int(const char *what, const char *s, long long lo, long long hi) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > hi)
        bench_fail("%s wants an integer %lld..%lld, got '%s'", what, lo, hi, s);
    return v;
}

/* s as a number above lo, at most hi. */
static inline double bench_real(const char *what, const char *s, double lo, double hi) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno || !(v > lo && v <= hi))
        bench_fail("%s wants a number above %g, at most %g, got '%s'", what, lo, hi, s);
    return v;
}

/* "1,64" into v[0..max): each item an integer in lo..hi when integer, else a number above lo,
 * at most hi; returns the count. */
static inline int bench_list(const char *what, const char *s, double *v, int max, double lo, double hi, bool integer) {
    int k = 0;
    for (const char *p = s;; p++) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        char item[64];
        if (k == max) bench_fail("%s takes at most %d values, got '%s'", what, max, s);
        if (len == 0 || len >= sizeof item)
            bench_fail("%s wants a comma-separated list of %s, got '%s'", what, integer ? "integers" : "numbers", s);
        memcpy(item, p, len);
        item[len] = '\0';
        v[k++] = integer ? (double)bench_int(what, item, (long long)lo, (long long)hi) : bench_real(what, item, lo, hi);
        if (!end) return k;
        p = end;
    }
}

/* Refuses a run whose buffers (about `bytes`) exceed the machine's memory; expected says
 * what to lower. */
static inline void bench_memory(double bytes, const char *expected) {
    const double have = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
    if (have > 0 && bytes > have)
        bench_fail("the run's buffers need about %.1f GiB of memory, this machine has %.1f GiB: expected %s",
                   bytes / (1 << 30), have / (1 << 30), expected);
}

/* bytes as "128 B", "307.1 KiB", "64 MiB": the largest unit that leaves at least 1. */
static inline const char *bench_bytes(char *buf, size_t cap, double bytes) {
    static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (u < 4 && bytes >= 1024) bytes /= 1024, u++;
    snprintf(buf, cap, "%.4g %s", bytes, unit[u]);
    return buf;
}

#endif /* MS_BENCH_ARGS_H */
