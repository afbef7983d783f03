/*
 * check.h: the C tests' tiny harness.  CHECK counts failures and keeps going; a test
 * program returns check_summary() as its exit status and prints "N passed, N failed".
 */
#ifndef MS_CHECK_H
#define MS_CHECK_H

#include "moonshard.h"

#include <stdio.h>
#include <string.h>

static int check_passed, check_failed;

#define CHECK(cond)                                                               \
    do {                                                                          \
        if (cond) check_passed++;                                                 \
        else {                                                                    \
            check_failed++;                                                       \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                         \
    } while (0)

/* The call succeeds. */
#define CHECK_OK(call)                                                                      \
    do {                                                                                    \
        ms_status st_ = (call);                                                             \
        if (st_ == MS_OK) check_passed++;                                                   \
        else {                                                                              \
            check_failed++;                                                                 \
            fprintf(stderr, "%s:%d: %s failed: %s: %s\n", __FILE__, __LINE__, #call,        \
                    ms_status_name(st_), ms_last_error());                                  \
        }                                                                                   \
    } while (0)

/* The call fails with status `want` and a message containing `needle`. */
#define CHECK_ERR(call, want, needle)                                                       \
    do {                                                                                    \
        ms_status st_ = (call);                                                             \
        if (st_ == (want) && strstr(ms_last_error(), (needle))) check_passed++;             \
        else {                                                                              \
            check_failed++;                                                                 \
            fprintf(stderr, "%s:%d: %s: expected %s with \"%s\", got %s: \"%s\"\n", __FILE__, \
                    __LINE__, #call, ms_status_name(want), needle, ms_status_name(st_),     \
                    ms_last_error());                                                       \
        }                                                                                   \
    } while (0)

static int check_summary(const char *name) {
    printf("%s: %d passed, %d failed\n", name, check_passed, check_failed);
    return check_failed ? 1 : 0;
}

#endif
