/*
 * ms_lua_quant.c: the raw functions of the lower-precision kernels (core/src/quant.c) for
 * the Lua 5.4 binding; lua/moonshard/core_ffi.lua has the same ones for LuaJIT and
 * lua/moonshard/quant.lua the API over both.  The output tensors are the caller's, made by
 * moonshard.quant; a failed core call returns nil and the message.
 */
#include "ms_lua_internal.h"

static int l_nf4_quantize(lua_State *L) {
    TRY(L, ms_nf4_quantize(check_tensor(L, 1), luaL_checkinteger(L, 2), check_tensor(L, 3), check_tensor(L, 4)));
    return ms_lua_done(L);
}

static int l_nf4_dequantize(lua_State *L) {
    TRY(L, ms_nf4_dequantize(check_tensor(L, 1), check_tensor(L, 2), check_tensor(L, 3), luaL_checkinteger(L, 4)));
    return ms_lua_done(L);
}

/* nf4_compress_absmax(absmax, qabsmax, absmax2) -> offset */
static int l_nf4_compress_absmax(lua_State *L) {
    double offset = 0.0;
    TRY(L, ms_nf4_compress_absmax(check_tensor(L, 1), check_tensor(L, 2), check_tensor(L, 3), &offset));
    lua_pushnumber(L, offset);
    return 1;
}

static int l_nf4_decompress_absmax(lua_State *L) {
    TRY(L, ms_nf4_decompress_absmax(check_tensor(L, 1), check_tensor(L, 2), check_tensor(L, 3), luaL_checknumber(L, 4)));
    return ms_lua_done(L);
}

/* nf4_bytes(numel, blocksize, double_quant) -> bytes */
static int l_nf4_bytes(lua_State *L) {
    int64_t out = 0;
    TRY(L, ms_nf4_bytes(luaL_checkinteger(L, 1), luaL_checkinteger(L, 2), lua_toboolean(L, 3), &out));
    lua_pushinteger(L, out);
    return 1;
}

static int l_fp8_amax(lua_State *L) {
    TRY(L, ms_fp8_amax(check_tensor(L, 1), check_tensor(L, 2), (ms_fp8_scaling)luaL_checkinteger(L, 3)));
    return ms_lua_done(L);
}

static int l_fp8_scale(lua_State *L) {
    TRY(L, ms_fp8_scale(check_tensor(L, 1), check_tensor(L, 2), (ms_dtype)luaL_checkinteger(L, 3), lua_toboolean(L, 4)));
    return ms_lua_done(L);
}

static int l_fp8_cast(lua_State *L) {
    TRY(L, ms_fp8_cast(check_tensor(L, 1), check_tensor(L, 2), check_tensor(L, 3)));
    return ms_lua_done(L);
}

static int l_fp8_dequantize(lua_State *L) {
    TRY(L, ms_fp8_dequantize(check_tensor(L, 1), check_tensor(L, 2), check_tensor(L, 3)));
    return ms_lua_done(L);
}

static int l_qat_fake_quantize(lua_State *L) {
    TRY(L, ms_qat_fake_quantize(check_tensor(L, 1), check_tensor(L, 2), (ms_qat_scheme)luaL_checkinteger(L, 3),
                                luaL_checkinteger(L, 4), (ms_dtype)luaL_checkinteger(L, 5)));
    return ms_lua_done(L);
}

static int l_unit_set_fp8_all_gather(lua_State *L) {
    TRY(L, ms_unit_set_fp8_all_gather(check_unit(L, 1), (int)luaL_checkinteger(L, 2), lua_toboolean(L, 3)));
    return ms_lua_done(L);
}

void ms_lua_open_quant(lua_State *L) {
    static const luaL_Reg funcs[] = {
        {"nf4_quantize", l_nf4_quantize}, {"nf4_dequantize", l_nf4_dequantize},
        {"nf4_compress_absmax", l_nf4_compress_absmax}, {"nf4_decompress_absmax", l_nf4_decompress_absmax},
        {"nf4_bytes", l_nf4_bytes}, {"fp8_amax", l_fp8_amax}, {"fp8_scale", l_fp8_scale},
        {"fp8_cast", l_fp8_cast}, {"fp8_dequantize", l_fp8_dequantize},
        {"qat_fake_quantize", l_qat_fake_quantize}, {"unit_set_fp8_all_gather", l_unit_set_fp8_all_gather},
        {NULL, NULL}};
    luaL_setfuncs(L, funcs, 0);
    static const struct { const char *name; int value; } k[] = {
        {"FP8_TENSORWISE", MS_FP8_TENSORWISE}, {"FP8_ROWWISE", MS_FP8_ROWWISE},
        {"QAT_INT4_WEIGHT_ONLY", MS_QAT_INT4_WEIGHT_ONLY}, {"QAT_8DA4W_WEIGHT", MS_QAT_8DA4W_WEIGHT},
        {"QAT_8DA4W_ACTIVATION", MS_QAT_8DA4W_ACTIVATION},
    };
    lua_getfield(L, -1, "const");
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        lua_pushinteger(L, k[i].value);
        lua_setfield(L, -2, k[i].name);
    }
    lua_pop(L, 1);
}
