/*
 * check_mt.h: the C tests' harness for checks made on several threads or in forked
 * processes (check.h is the single-threaded one): atomic counters, and every failure
 * printed at once with its file, line and process.
 *   CHECK(cond) or CHECK(cond, "(context %d)", x)
 *   CHECK_ST(call, want, needle): the call returns `want` and its message contains needle
 *   CHECK_OK(call)
 *   fail_at(__LINE__, what, fmt, ...): a failure found by the test's own comparison
 */
#ifndef MS_CHECK_MT_H
#define MS_CHECK_MT_H

#include "moonshard.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static atomic_int passed, failed;

#define fail_at(line, what, ...) check_fail_at(__FILE__, line, what, __VA_ARGS__)

static void check_fail_at(const char *file, int line, const char *what, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void check_fail_at(const char *file, int line, const char *what, const char *fmt, ...) {
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    const char *base = strrchr(file, '/');
    fprintf(stderr, "%s:%d: [pid %d] %s%s\n", base ? base + 1 : file, line, (int)getpid(), what, buf);
    atomic_fetch_add(&failed, 1);
}

#define CHECK(cond, ...)                                                 \
    do {                                                                 \
        if (cond) atomic_fetch_add(&passed, 1);                          \
        else fail_at(__LINE__, "CHECK failed: " #cond, " " __VA_ARGS__); \
    } while (0)

#define CHECK_ST(call, want, needle)                                                          \
    do {                                                                                      \
        ms_status st_ = (call);                                                               \
        if (st_ == (want) && strstr(ms_last_error(), (needle))) atomic_fetch_add(&passed, 1); \
        else fail_at(__LINE__, #call, ": expected %s with \"%s\", got %s: \"%s\"",            \
                     ms_status_name(want), (needle), ms_status_name(st_), ms_last_error());   \
    } while (0)

#define CHECK_OK(call) CHECK_ST(call, MS_OK, "")

/* Seconds on the monotonic clock. */
static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#endif /* MS_CHECK_MT_H */
