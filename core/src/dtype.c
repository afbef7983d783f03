/*
 * dtype.c: the dtype table (one X-macro list in ms_internal.h), names and parsing.
 */
#include "ms_internal.h"

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
