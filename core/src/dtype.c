/*
 * dtype.c: the dtype table (one X-macro list in ms_internal.h), names and parsing.
 */
#include "ms_internal.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define MS_X_SIZE(e, n, s, f) [e] = s,
#define MS_X_NAME(e, n, s, f) [e] = n,
#define MS_X_FLOAT(e, n, s, f) [e] = f,
static const int dtype_size[MS_DTYPE_COUNT] = {MS_DTYPE_LIST(MS_X_SIZE)};
static const char *const dtype_name[MS_DTYPE_COUNT] = {MS_DTYPE_LIST(MS_X_NAME)};
static const int dtype_float[MS_DTYPE_COUNT] = {MS_DTYPE_LIST(MS_X_FLOAT)};

int ms_dtype_size(ms_dtype d) { return ms__dtype_valid(d) ? dtype_size[d] : 0; }
const char *ms_dtype_name(ms_dtype d) { return ms__dtype_valid(d) ? dtype_name[d] : NULL; }
int ms_dtype_is_float(ms_dtype d) { return ms__dtype_valid(d) ? dtype_float[d] : 0; }

ms_status ms_int_element(ms_dtype dt, int is_float, int64_t i, double f, int64_t *out) {
    MS_NOT_NULL(out);
    if (dt == MS_BOOL) {
        *out = is_float ? f != 0 : i != 0; /* NaN is true, as bool(nan) is */
        return MS_OK;
    }
    int64_t lo, hi;
    switch (dt) {
    case MS_I64: lo = INT64_MIN, hi = INT64_MAX; break;
    case MS_I32: lo = INT32_MIN, hi = INT32_MAX; break;
    case MS_I8: lo = INT8_MIN, hi = INT8_MAX; break;
    case MS_U8: lo = 0, hi = UINT8_MAX; break;
    default:
        return ms__fail(MS_ERR_DTYPE, "int_element: %s is not an integer dtype",
                        ms_dtype_name(dt) ? ms_dtype_name(dt) : "an invalid dtype");
    }
    if (!is_float) {
        if (i >= lo && i <= hi) {
            *out = i;
            return MS_OK;
        }
        return ms__fail(MS_ERR_ARG, "%" PRId64 " is out of range for %s (%" PRId64 " to %" PRId64 ")", i,
                        ms_dtype_name(dt), lo, hi);
    }
    double t = trunc(f); /* NaN fails both comparisons */
    if (t >= -0x1p63 && t < 0x1p63 && (int64_t)t >= lo && (int64_t)t <= hi) {
        *out = (int64_t)t;
        return MS_OK;
    }
    char num[32]; /* %.14g as both interpreters print numbers, "nan" for every NaN */
    if (isnan(f)) snprintf(num, sizeof num, "nan");
    else snprintf(num, sizeof num, "%.14g", f);
    return ms__fail(MS_ERR_ARG, "%s is out of range for %s (%" PRId64 " to %" PRId64 ")", num, ms_dtype_name(dt),
                    lo, hi);
}

/* Aliases users type from PyTorch and safetensors. */
static const struct { const char *alias; ms_dtype dtype; } dtype_alias[] = {
    {"float32", MS_F32}, {"float", MS_F32}, {"F32", MS_F32},
    {"float16", MS_F16}, {"half", MS_F16}, {"F16", MS_F16},
    {"bfloat16", MS_BF16}, {"BF16", MS_BF16},
    {"float8_e4m3fn", MS_F8E4M3}, {"F8_E4M3", MS_F8E4M3},
    {"float8_e5m2", MS_F8E5M2}, {"F8_E5M2", MS_F8E5M2},
    {"float64", MS_F64}, {"double", MS_F64}, {"F64", MS_F64},
    {"int64", MS_I64}, {"long", MS_I64}, {"I64", MS_I64},
    {"int32", MS_I32}, {"int", MS_I32}, {"I32", MS_I32},
    {"int8", MS_I8}, {"I8", MS_I8},
    {"uint8", MS_U8}, {"U8", MS_U8},
    {"BOOL", MS_BOOL},
};

ms_status ms_dtype_parse(const char *name, ms_dtype *out) {
    MS_NOT_NULL(name);
    MS_NOT_NULL(out);
    for (int d = 0; d < MS_DTYPE_COUNT; d++)
        if (strcmp(name, dtype_name[d]) == 0) {
            *out = (ms_dtype)d;
            return MS_OK;
        }
    for (size_t i = 0; i < sizeof dtype_alias / sizeof dtype_alias[0]; i++)
        if (strcmp(name, dtype_alias[i].alias) == 0) {
            *out = dtype_alias[i].dtype;
            return MS_OK;
        }
    return ms__fail(MS_ERR_DTYPE,
                    "unknown dtype '%s' (expected one of f32 f16 bf16 f8e4m3 f8e5m2 f64 i64 i32 i8 u8 bool)",
                    name);
}

static const char *const op_name[] = {"sum", "avg", "max", "min"};

const char *ms_op_name(ms_op op) { return (unsigned)op < 4u ? op_name[op] : NULL; }

ms_status ms_op_parse(const char *name, ms_op *out) {
    MS_NOT_NULL(name);
    MS_NOT_NULL(out);
    for (int i = 0; i < 4; i++)
        if (strcmp(name, op_name[i]) == 0) {
            *out = (ms_op)i;
            return MS_OK;
        }
    return ms__fail(MS_ERR_ARG, "unknown reduction op '%s' (expected sum, avg, max or min)", name);
}
