/*
 * status.c: status names, the thread-local error message, checked integer arithmetic.
 */
#include "ms_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

enum { MS_MSG_CAP = 1024 };
static _Thread_local char ms_msg[MS_MSG_CAP];

const char *ms_status_name(ms_status st) {
    switch (st) {
    case MS_OK: return "ok";
    case MS_ERR_ARG: return "invalid_argument";
    case MS_ERR_OOM: return "out_of_memory";
    case MS_ERR_OVERFLOW: return "overflow";
    case MS_ERR_SHAPE: return "shape";
    case MS_ERR_DTYPE: return "dtype";
    case MS_ERR_DEVICE: return "device";
    case MS_ERR_MISMATCH: return "mismatch";
    case MS_ERR_TIMEOUT: return "timeout";
    case MS_ERR_PEER: return "peer_failed";
    case MS_ERR_NOT_BUILT: return "not_built";
    case MS_ERR_STATE: return "state";
    case MS_ERR_IO: return "io";
    case MS_ERR_INTERNAL: return "internal";
    }
    return "unknown_status";
}

const char *ms_last_error(void) { return ms_msg; }

ms_status ms_set_error(ms_status status, const char *message) {
    snprintf(ms_msg, sizeof ms_msg, "%s", message ? message : "");
    return status;
}

const char *ms_version(void) { return MOONSHARD_VERSION; }

ms_status ms__ok(void) {
    ms_msg[0] = '\0';
    return MS_OK;
}

ms_status ms__fail(ms_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ms_msg, sizeof ms_msg, fmt, ap);
    va_end(ap);
    return st;
}

ms_status ms__wrap(ms_status st, const char *fmt, ...) {
    char old[MS_MSG_CAP];
    memcpy(old, ms_msg, sizeof old);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ms_msg, sizeof ms_msg, fmt, ap);
    va_end(ap);
    size_t len = strlen(ms_msg), room = sizeof ms_msg - 1 - len;
    size_t add = strlen(old) + 2 < room ? strlen(old) + 2 : room;
    memcpy(ms_msg + len, ": ", add < 2 ? add : 2);
    if (add > 2) memcpy(ms_msg + len + 2, old, add - 2);
    ms_msg[len + add] = '\0';
    return st;
}

ms_status ms__null_arg(const char *fn, const char *arg) {
    return ms__fail(MS_ERR_ARG, "%s: %s is NULL", fn, arg);
}

bool ms__mul_ok(int64_t a, int64_t b, int64_t *out) { return !__builtin_mul_overflow(a, b, out); }
bool ms__add_ok(int64_t a, int64_t b, int64_t *out) { return !__builtin_add_overflow(a, b, out); }

const char *ms__shape_str(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t len = 0;
    buf[0] = '\0';
    len += (size_t)snprintf(buf + len, cap - len, "[");
    for (int i = 0; i < ndim && len < cap; i++)
        len += (size_t)snprintf(buf + len, cap - len, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (len < cap) snprintf(buf + len, cap - len, "]");
    return buf;
}
