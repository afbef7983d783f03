/*
 * quant.c: the numerics of NeMo Automodel's lower-precision steps (moonshard.h, "lower
 * precision"), value for value as the libraries that define them:
 *
 * - NF4 (QLoRA): bitsandbytes 0.50.2's quantize_4bit / dequantize_4bit on the CPU
 *   (bitsandbytes/functional.py; the ops in bitsandbytes/backends/default/ops.py and
 *   backends/cpu/ops.py, csrc/cpu_ops.cpp), with compress_statistics.
 * - Float8 training casts: torchao 0.18's torchao/float8/float8_utils.py (amax_to_scale,
 *   to_fp8_saturated, _round_scale_down_to_power_of_2) and float8_training_tensor.py
 *   (_ToFloat8ConstrFunc, _FromFloat8ConstrFunc).
 * - QAT fake quantisation: torchao 0.18's legacy quantizers in
 *   torchao/quantization/qat/linear.py, through qat/fake_quantizer.py (IntxFakeQuantizer),
 *   torchao/quantization/utils.py and quant_primitives.py.
 *
 * Every step rounds where torch rounds: each tensor operation is computed in f32 (torch's
 * opmath for bf16) and rounded to the dtype torch's type promotion gives its result.
 * docs/numerics.md ("Lower precision") states the rules; tests/reference/quant.py made the
 * reference values tests/lua/quant_spec.lua compares.
 */
#include "moonshard.h"

#include "cast_scalar.h"
#include "ms_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- elements */

static float load_f32(const void *p, ms_dtype dt, int64_t i) {
    switch (dt) {
    case MS_F32: return ((const float *)p)[i];
    case MS_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
    case MS_F16: return f16_to_f32(((const uint16_t *)p)[i]);
    default: return 0.0f;
    }
}

static void store_f32(void *p, ms_dtype dt, int64_t i, float v) {
    switch (dt) {
    case MS_F32: ((float *)p)[i] = v; break;
    case MS_BF16: ((uint16_t *)p)[i] = f32_to_bf16(v); break;
    case MS_F16: ((uint16_t *)p)[i] = f32_to_f16(v); break;
    default: break;
    }
}

/* v rounded to dtype dt (f32: v itself), as a torch result of that dtype. */
static float rnd(ms_dtype dt, float v) {
    if (dt == MS_BF16) return bf16_to_f32(f32_to_bf16(v));
    if (dt == MS_F16) return f16_to_f32(f32_to_f16(v));
    return v;
}

/* torch.max / torch.min / torch.amax of two values: NaN propagates. */
static float max_nan(float a, float b) { return (a != a || b != b) ? (a != a ? a : b) : (a > b ? a : b); }
static float min_nan(float a, float b) { return (a != a || b != b) ? (a != a ? a : b) : (a < b ? a : b); }
/* torch.clamp(v, lo, hi): NaN stays NaN. */
static float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

/* A contiguous cpu tensor of one of the dtypes in `ok` (a list ending in MS_DTYPE_COUNT). */
static ms_status check_tensor(const char *fn, const char *what, const ms_tensor *t, const ms_dtype *ok) {
    if (ms_tensor_device(t) != MS_DEVICE_CPU)
        return ms__fail(MS_ERR_DEVICE, "%s: %s is on another device; a cpu tensor was expected", fn, what);
    if (!ms_tensor_is_contiguous(t))
        return ms__fail(MS_ERR_ARG, "%s: %s is not contiguous; a contiguous tensor was expected", fn, what);
    ms_dtype dt = ms_tensor_dtype(t);
    char names[96] = "";
    for (const ms_dtype *d = ok; *d != MS_DTYPE_COUNT; d++) {
        if (*d == dt) return MS_OK;
        size_t len = strlen(names);
        snprintf(names + len, sizeof names - len, "%s%s", len ? (d[1] == MS_DTYPE_COUNT ? " or " : ", ") : "",
                 ms_dtype_name(*d));
    }
    return ms__fail(MS_ERR_DTYPE, "%s: %s is %s; %s was expected", fn, what, ms_dtype_name(dt), names);
}

static ms_status check_numel(const char *fn, const char *what, const ms_tensor *t, int64_t want) {
    if (ms_tensor_numel(t) != want)
        return ms__fail(MS_ERR_SHAPE, "%s: %s has %lld elements; %lld were expected", fn, what,
                        (long long)ms_tensor_numel(t), (long long)want);
    return MS_OK;
}

static const ms_dtype FLOATS3[] = {MS_F32, MS_BF16, MS_F16, MS_DTYPE_COUNT};
static const ms_dtype FLOATS2[] = {MS_F32, MS_BF16, MS_DTYPE_COUNT};

static const ms_dtype ONLY_F32[] = {MS_F32, MS_DTYPE_COUNT};
static const ms_dtype ONLY_U8[] = {MS_U8, MS_DTYPE_COUNT};
static const ms_dtype FP8S[] = {MS_F8E4M3, MS_F8E5M2, MS_DTYPE_COUNT};

/* ---------------------------------------------------------------- torch's f32 sum

 * torch.sum of a contiguous f32 vector on the CPU, in its order (aten/src/ATen/native/cpu/
 * SumKernel.cpp, cascade_sum: vectorized_inner_sum over row_sum / multi_row_sum with 4
 * accumulators of 4 levels), for Vectorized<float> of VEC lanes: 8, the AVX2 build torch's
 * dispatch chose on the reference machine (AVX-512 would be 16).  One thread: torch splits a
 * reduction of more than 32768 elements among its threads. */
enum { VEC = 8, ILP = 4, LEVELS = 4 };

static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t b = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) b++;
    return b;
}

/* multi_row_sum<acc, ILP> over `size` rows of ILP accumulators of `lanes` lanes each: row i,
 * accumulator k, lane l is v[(i * ILP + k) * lanes + l]. */
static void multi_row_sum(const float *v, int64_t size, int lanes, float out[ILP][VEC]) {
    int64_t level_power = ceil_log2(size) / LEVELS;
    if (level_power < 4) level_power = 4;
    int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    float acc[LEVELS][ILP][VEC];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    while (i + level_step <= size) {
        for (int64_t j = 0; j < level_step; j++, i++)
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < lanes; l++) acc[0][k][l] += v[(i * ILP + k) * lanes + l];
        for (int j = 1; j < LEVELS; j++) {
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < lanes; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (level_mask << (j * level_power))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < lanes; l++) acc[0][k][l] += v[(i * ILP + k) * lanes + l];
    for (int j = 1; j < LEVELS; j++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < lanes; l++) acc[0][k][l] += acc[j][k][l];
    memcpy(out, acc[0], sizeof acc[0]);
}

/* row_sum: `size` items of `lanes` lanes, ILP at a time, the rest into accumulator 0. */
static void row_sum(const float *v, int64_t size, int lanes, float res[VEC]) {
    float p[ILP][VEC];
    int64_t size_ilp = size / ILP;
    multi_row_sum(v, size_ilp, lanes, p);
    for (int64_t i = size_ilp * ILP; i < size; i++)
        for (int l = 0; l < lanes; l++) p[0][l] += v[i * lanes + l];
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < lanes; l++) p[0][l] += p[k][l];
    memcpy(res, p[0], sizeof p[0]);
}

static float torch_sum_f32(const float *v, int64_t n) {
    float r[VEC];
    if (n < VEC) { /* scalar_inner_sum */
        row_sum(v, n, 1, r);
        return 0.0f + r[0];
    }
    int64_t nvec = n / VEC;
    row_sum(v, nvec, VEC, r);
    float acc = 0.0f;
    for (int64_t k = nvec * VEC; k < n; k++) acc += v[k];
    for (int l = 0; l < VEC; l++) acc += r[l];
    return 0.0f + acc;
}

/* ---------------------------------------------------------------- NF4 (bitsandbytes)

 * The NF4 code: bitsandbytes' table (bitsandbytes/functional.py get_4bit_type("nf4"), the
 * same values as backends/utils.py _NF4_QUANT_TABLE and csrc's dDequantizeNF4), made by
 * create_normal_map(offset=0.9677083, use_extra_value=True) from the normal distribution's
 * quantiles (QLoRA, arXiv:2305.14314, appendix E). */
static const float NF4[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f,
};

/* bitsandbytes' 8-bit dynamic map as f32 bits: create_dynamic_map(signed=True) of
 * bitsandbytes/functional.py (Dettmers, "8-Bit Approximations for Parallelism in Deep
 * Learning", arXiv:1511.04561), the map quantize_blockwise uses by default, dumped from
 * bitsandbytes 0.50.2 (tests/reference/quant.py checks it is still that). */
static const uint32_t DYN_BITS[256] = {
    0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333, 0xbf68999a, 0xbf650000,
    0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a, 0xbf530000, 0xbf4f6666, 0xbf4bcccd, 0xbf483333,
    0xbf44999a, 0xbf410000, 0xbf3d6666, 0xbf39cccd, 0xbf363334, 0xbf32999a, 0xbf2f0000, 0xbf2b6666,
    0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000, 0xbf196666, 0xbf15cccd, 0xbf123334, 0xbf0e999a,
    0xbf0b0000, 0xbf076666, 0xbf03cccc, 0xbf003333, 0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a,
    0xbedc6666, 0xbed53333, 0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000,
    0xbea2cccc, 0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999, 0xbe6f3333, 0xbe60cccd,
    0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333, 0xbe18cccd, 0xbe0a6666, 0xbdf80000, 0xbddb3334,
    0xbdc9eb85, 0xbdc428f7, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c2a, 0xbda1999a,
    0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd, 0xbd7e147b, 0xbd728f5d, 0xbd670a3d,
    0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3, 0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148,
    0xbcfeb852, 0xbce7ae15, 0xbcd0a3d7, 0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148,
    0xbc1f3b64, 0xbc160418, 0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3, 0xbbcfdf3b, 0xbbbd70a4,
    0xbbab020d, 0xbb989374, 0xbb8624dd, 0xbb676c8a, 0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d,
    0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705, 0xb923d70b,
    0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94, 0xb513a3b7, 0x00000000,
    0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034, 0x388aefb3, 0x38ba1f4b, 0x3923d70b,
    0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d,
    0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd, 0x3b989374, 0x3bab020d, 0x3bbd70a4,
    0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581, 0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148,
    0x3c68f5c3, 0x3c8b851f, 0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
    0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f, 0x3d670a3d,
    0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a,
    0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85, 0x3ddb3334,
    0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000, 0x3e526666, 0x3e60cccd,
    0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334, 0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000,
    0x3eb13333, 0x3eb86666, 0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a,
    0x3eeacccc, 0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a,
    0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666,
    0x3f2f0000, 0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
    0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd, 0x3f616666, 0x3f650000,
    0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666, 0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,

};

static float dyn_code(int i) { return f32_from_bits(DYN_BITS[i]); }

static const int64_t NF4_BLOCKSIZES[] = {32, 64, 128, 256, 512, 1024, 2048, 4096};

static ms_status check_blocksize(const char *fn, int64_t blocksize) {
    for (size_t i = 0; i < sizeof NF4_BLOCKSIZES / sizeof NF4_BLOCKSIZES[0]; i++)
        if (blocksize == NF4_BLOCKSIZES[i]) return MS_OK;
    return ms__fail(MS_ERR_ARG, "%s: blocksize %lld is not one of bitsandbytes' 32, 64, 128, 256, 512, 1024, 2048, 4096",
                    fn, (long long)blocksize);
}

/* torch.bucketize(v, bounds) (right=False): cus_lower_bound's search as torch runs it, so a
 * NaN lands past the last bound as it does there. */
static int bucketize(float v, const float *bounds, int n) {
    int start = 0, end = n;
    while (start < end) {
        int mid = start + ((end - start) >> 1);
        if (!(bounds[mid] >= v)) start = mid + 1;
        else end = mid;
    }
    return start;
}

ms_status ms_nf4_quantize(const ms_tensor *x, int64_t blocksize, ms_tensor *codes, ms_tensor *absmax) {
    MS_NOT_NULL(x);
    MS_NOT_NULL(codes);
    MS_NOT_NULL(absmax);
    const char *fn = __func__;
    ms_status st;
    if ((st = check_blocksize(fn, blocksize))) return st;
    if ((st = check_tensor(fn, "x", x, FLOATS3)) || (st = check_tensor(fn, "codes", codes, ONLY_U8)) ||
        (st = check_tensor(fn, "absmax", absmax, ONLY_F32)))
        return st;
    int64_t n = ms_tensor_numel(x), nb = (n + blocksize - 1) / blocksize;
    if ((st = check_numel(fn, "codes", codes, (n + 1) / 2)) || (st = check_numel(fn, "absmax", absmax, nb))) return st;
    float bounds[15];
    for (int i = 0; i < 15; i++) bounds[i] = (NF4[i] + NF4[i + 1]) / 2.0f;
    const void *xs = ms_tensor_data(x);
    ms_dtype dt = ms_tensor_dtype(x);
    uint8_t *out = ms_tensor_data(codes);
    float *am = ms_tensor_data(absmax);
    if (n % 2) out[n / 2] = 0;
    int64_t full = n - n % blocksize;
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * blocksize, hi = lo + blocksize < n ? lo + blocksize : n;
        float m = 0.0f;
        int first = 1;
        for (int64_t i = lo; i < hi; i++) {
            float a = fabsf(load_f32(xs, dt, i));
            m = first ? a : max_nan(m, a);
            first = 0;
        }
        /* default/ops.py quantize_4bit: a full block multiplies by 1.0 / absmax.clamp(min=1e-38),
         * keeping the unclamped absmax; the short last block divides by its clamped absmax and
         * keeps that */
        float tiny = 1e-38f, mc = m < tiny ? tiny : m;
        int is_full = hi <= full;
        float r = 1.0f / mc;
        am[b] = is_full ? m : mc;
        for (int64_t i = lo; i < hi; i++) {
            float v = load_f32(xs, dt, i);
            float s = clampf(is_full ? v * r : v / mc, -1.0f, 1.0f);
            int q = bucketize(s, bounds, 15);
            if (i % 2 == 0) out[i / 2] = (uint8_t)(q << 4);
            else out[i / 2] |= (uint8_t)q;
        }
    }
    if (n % 2) out[n / 2] |= (uint8_t)bucketize(0.0f, bounds, 15); /* the padding, 0.0: code 7 */
    return ms__ok();
}

ms_status ms_nf4_dequantize(ms_tensor *out, const ms_tensor *codes, const ms_tensor *absmax, int64_t blocksize) {
    MS_NOT_NULL(out);
    MS_NOT_NULL(codes);
    MS_NOT_NULL(absmax);
    const char *fn = __func__;
    ms_status st;
    if ((st = check_blocksize(fn, blocksize))) return st;
    if ((st = check_tensor(fn, "out", out, FLOATS3)) || (st = check_tensor(fn, "codes", codes, ONLY_U8)) ||
        (st = check_tensor(fn, "absmax", absmax, ONLY_F32)))
        return st;
    int64_t n = ms_tensor_numel(out), nb = (n + blocksize - 1) / blocksize;
    if ((st = check_numel(fn, "codes", codes, (n + 1) / 2)) || (st = check_numel(fn, "absmax", absmax, nb))) return st;
    const uint8_t *c = ms_tensor_data(codes);
    const float *am = ms_tensor_data(absmax);
    void *o = ms_tensor_data(out);
    ms_dtype dt = ms_tensor_dtype(out);
    for (int64_t i = 0; i < n; i++) {
        int q = i % 2 ? c[i / 2] & 0xF : c[i / 2] >> 4;
        store_f32(o, dt, i, NF4[q] * am[i / blocksize]);
    }
    return ms__ok();
}

/* bitsandbytes' CPU quantize_blockwise (csrc/cpu_ops.cpp quantize_cpu_impl, since
 * bitsandbytes' "perf: Improve CPU performance on x64 and arm64" (#1968), in 0.50.2): not the
 * nearest code, but a 65536-entry table over [-1, 1]: entry i holds the first code whose
 * midpoint with the next is not below -1 + 2i / 65535, and a value v (times 1 / absmax of its
 * block) looks up entry (uint16)((clamp(v, -1, 1) + 1) * 0.5 * 65535 + 0.5), in f32. */
static unsigned char DYN_LUT[65536];
static int dyn_lut_ready;

static const unsigned char *dyn_lut(void) {
    if (!dyn_lut_ready) { /* idempotent: racing threads write the same bytes */
        float mid[255];
        for (int i = 0; i < 255; i++) mid[i] = 0.5f * (dyn_code(i) + dyn_code(i + 1));
        int k = 0;
        for (int i = 0; i < 65536; i++) {
            float val = -1.0f + (2.0f * (float)i) / 65535.0f;
            while (k < 255 && mid[k] < val) k++;
            DYN_LUT[i] = (unsigned char)k;
        }
        dyn_lut_ready = 1;
    }
    return DYN_LUT;
}

static int dyn_lookup(float v) {
    v = v < -1.0f ? -1.0f : (v > 1.0f ? 1.0f : v);
    float t = (v + 1.0f) * 0.5f;
    return dyn_lut()[(uint16_t)(t * 65535.0f + 0.5f)];
}

ms_status ms_nf4_compress_absmax(const ms_tensor *absmax, ms_tensor *qabsmax, ms_tensor *absmax2, double *offset) {
    MS_NOT_NULL(absmax);
    MS_NOT_NULL(qabsmax);
    MS_NOT_NULL(absmax2);
    MS_NOT_NULL(offset);
    const char *fn = __func__;
    ms_status st;
    if ((st = check_tensor(fn, "absmax", absmax, ONLY_F32)) || (st = check_tensor(fn, "qabsmax", qabsmax, ONLY_U8)) ||
        (st = check_tensor(fn, "absmax2", absmax2, ONLY_F32)))
        return st;
    int64_t n = ms_tensor_numel(absmax), nb = (n + 255) / 256;
    if (n == 0) return ms__fail(MS_ERR_SHAPE, "%s: absmax is empty; its mean is the offset", fn);
    if ((st = check_numel(fn, "qabsmax", qabsmax, n)) || (st = check_numel(fn, "absmax2", absmax2, nb))) return st;
    const float *a = ms_tensor_data(absmax);
    float mean = torch_sum_f32(a, n) / (float)n; /* absmax.mean(): sum, then div_ */
    uint8_t *q = ms_tensor_data(qabsmax);
    float *a2 = ms_tensor_data(absmax2);
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * 256, hi = lo + 256 < n ? lo + 256 : n;
        float m = 0.0f;
        for (int64_t i = lo; i < hi; i++) m = fmaxf(m, fabsf(a[i] - mean));
        a2[b] = m;
        if (m == 0.0f) { /* a block of zeros: code 0 */
            for (int64_t i = lo; i < hi; i++) q[i] = 0;
            continue;
        }
        float inv = 1.0f / m;
        for (int64_t i = lo; i < hi; i++) q[i] = (uint8_t)dyn_lookup((a[i] - mean) * inv);
    }
    *offset = mean;
    return ms__ok();
}

ms_status ms_nf4_decompress_absmax(ms_tensor *absmax, const ms_tensor *qabsmax, const ms_tensor *absmax2,
                                   double offset) {
    MS_NOT_NULL(absmax);
    MS_NOT_NULL(qabsmax);
    MS_NOT_NULL(absmax2);
    const char *fn = __func__;
    ms_status st;
    if ((st = check_tensor(fn, "absmax", absmax, ONLY_F32)) || (st = check_tensor(fn, "qabsmax", qabsmax, ONLY_U8)) ||
        (st = check_tensor(fn, "absmax2", absmax2, ONLY_F32)))
        return st;
    int64_t n = ms_tensor_numel(absmax);
    if ((st = check_numel(fn, "qabsmax", qabsmax, n)) || (st = check_numel(fn, "absmax2", absmax2, (n + 255) / 256)))
        return st;
    float off = (float)offset;
    if ((double)off != offset && offset == offset)
        return ms__fail(MS_ERR_ARG, "%s: offset %.17g is not an f32 value", fn, offset);
    const uint8_t *q = ms_tensor_data(qabsmax);
    const float *a2 = ms_tensor_data(absmax2);
    float *a = ms_tensor_data(absmax);
    for (int64_t i = 0; i < n; i++) a[i] = dyn_code(q[i]) * a2[i / 256] + off;
    return ms__ok();
}

ms_status ms_nf4_bytes(int64_t numel, int64_t blocksize, int double_quant, int64_t *out) {
    MS_NOT_NULL(out);
    ms_status st;
    if ((st = check_blocksize(__func__, blocksize))) return st;
    if (numel < 0) return ms__fail(MS_ERR_ARG, "ms_nf4_bytes: numel %lld is negative", (long long)numel);
    int64_t nb = numel / blocksize + (numel % blocksize != 0);
    int64_t stats = double_quant ? (nb == 0 ? 0 : nb + 4 * ((nb + 255) / 256) + 4) : 4 * nb;
    *out = numel / 2 + numel % 2 + stats;
    return ms__ok();
}

/* ---------------------------------------------------------------- float8 (torchao) */

static float fp8_max(ms_dtype dt) { return dt == MS_F8E4M3 ? 448.0f : 57344.0f; }

/* rows and the row length of x for a scaling: tensorwise one row of numel. */
static void fp8_rows(const ms_tensor *x, ms_fp8_scaling scaling, int64_t *rows, int64_t *len) {
    int64_t n = ms_tensor_numel(x);
    int nd = ms_tensor_ndim(x);
    if (scaling == MS_FP8_ROWWISE && nd > 0) {
        *len = ms_tensor_size(x, nd - 1);
        *rows = *len ? n / *len : 0;
    } else {
        *rows = 1;
        *len = n;
    }
}

/* The row length a scale of 1 (tensorwise) or one value per row of t (rowwise) applies to. */
static ms_status scale_rows(const char *fn, const ms_tensor *t, const ms_tensor *scale, int64_t *len) {
    int64_t rows = 1, ns = ms_tensor_numel(scale);
    *len = ms_tensor_numel(t);
    if (ns == 1) return MS_OK;
    fp8_rows(t, MS_FP8_ROWWISE, &rows, len);
    if (ns != rows)
        return ms__fail(MS_ERR_SHAPE, "%s: scale has %lld elements; 1 (tensorwise) or %lld (one per row) were expected", fn,
                        (long long)ns, (long long)rows);
    return MS_OK;
}

ms_status ms_fp8_amax(ms_tensor *amax, const ms_tensor *x, ms_fp8_scaling scaling) {
    MS_NOT_NULL(amax);
    MS_NOT_NULL(x);
    const char *fn = __func__;
    ms_status st;
    if (scaling != MS_FP8_TENSORWISE && scaling != MS_FP8_ROWWISE)
        return ms__fail(MS_ERR_ARG, "%s: scaling %d is not MS_FP8_TENSORWISE or MS_FP8_ROWWISE", fn, (int)scaling);
    if ((st = check_tensor(fn, "x", x, FLOATS2)) || (st = check_tensor(fn, "amax", amax, ONLY_F32))) return st;
    int64_t rows, len;
    fp8_rows(x, scaling, &rows, &len);
    if ((st = check_numel(fn, "amax", amax, rows))) return st;
    if (len == 0) return ms__fail(MS_ERR_SHAPE, "%s: x has rows of 0 elements; torch.max of nothing is an error", fn);
    const void *xs = ms_tensor_data(x);
    ms_dtype dt = ms_tensor_dtype(x);
    float *a = ms_tensor_data(amax);
    for (int64_t r = 0; r < rows; r++) {
        float m = fabsf(load_f32(xs, dt, r * len));
        for (int64_t i = 1; i < len; i++) m = max_nan(m, fabsf(load_f32(xs, dt, r * len + i)));
        a[r] = m;
    }
    return ms__ok();
}

/* exp2(floor(log2(s))) in f32, log2 correctly rounded to f32 (torch.log2 of an f32 tensor). */
static float round_pow2(float s) {
    if (!(s > 0.0f) || isinf(s)) return s != s ? s : (s == 0.0f ? 0.0f : s);
    float l = (float)log2((double)s);
    return exp2f(floorf(l));
}

ms_status ms_fp8_scale(ms_tensor *scale, const ms_tensor *amax, ms_dtype fp8, int round_pow2_) {
    MS_NOT_NULL(scale);
    MS_NOT_NULL(amax);
    const char *fn = __func__;
    ms_status st;
    if (fp8 != MS_F8E4M3 && fp8 != MS_F8E5M2)
        return ms__fail(MS_ERR_DTYPE, "%s: fp8 is %s; f8e4m3 or f8e5m2 was expected", fn,
                        ms_dtype_name(fp8) ? ms_dtype_name(fp8) : "not a dtype");
    if ((st = check_tensor(fn, "scale", scale, ONLY_F32)) || (st = check_tensor(fn, "amax", amax, ONLY_F32))) return st;
    int64_t n = ms_tensor_numel(amax);
    if ((st = check_numel(fn, "scale", scale, n))) return st;
    const float *a = ms_tensor_data(amax);
    float *s = ms_tensor_data(scale);
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i];
        if (d < 1e-12) d = 1e-12; /* torch.clamp(amax.to(f64), min=EPS): NaN stays */
        float v = (float)((double)fp8_max(fp8) / d);
        s[i] = round_pow2_ ? round_pow2(v) : v;
    }
    return ms__ok();
}

ms_status ms_fp8_cast(ms_tensor *out, const ms_tensor *x, const ms_tensor *scale) {
    MS_NOT_NULL(out);
    MS_NOT_NULL(x);
    MS_NOT_NULL(scale);
    const char *fn = __func__;
    ms_status st;
    if ((st = check_tensor(fn, "out", out, FP8S)) || (st = check_tensor(fn, "x", x, FLOATS2)) ||
        (st = check_tensor(fn, "scale", scale, ONLY_F32)))
        return st;
    int64_t n = ms_tensor_numel(x);
    if ((st = check_numel(fn, "out", out, n))) return st;
    int64_t len;
    if ((st = scale_rows(fn, x, scale, &len))) return st;
    ms_dtype od = ms_tensor_dtype(out), dt = ms_tensor_dtype(x);
    float mx = fp8_max(od);
    const void *xs = ms_tensor_data(x);
    const float *s = ms_tensor_data(scale);
    uint8_t *o = ms_tensor_data(out);
    for (int64_t i = 0; i < n; i++) {
        float v = clampf(load_f32(xs, dt, i) * s[len ? i / len : 0], -mx, mx);
        if (v != v) o[i] = (uint8_t)(((f32_bits(v) >> 24) & 0x80) | 0x7F); /* torch's NaN codes */
        else o[i] = od == MS_F8E4M3 ? f32_to_e4m3(v) : f32_to_e5m2(v);
    }
    return ms__ok();
}

ms_status ms_fp8_dequantize(ms_tensor *out, const ms_tensor *fp8, const ms_tensor *scale) {
    MS_NOT_NULL(out);
    MS_NOT_NULL(fp8);
    MS_NOT_NULL(scale);
    const char *fn = __func__;
    ms_status st;
    if ((st = check_tensor(fn, "out", out, FLOATS3)) || (st = check_tensor(fn, "fp8", fp8, FP8S)) ||
        (st = check_tensor(fn, "scale", scale, ONLY_F32)))
        return st;
    int64_t n = ms_tensor_numel(fp8);
    if ((st = check_numel(fn, "out", out, n))) return st;
    int64_t len;
    if ((st = scale_rows(fn, fp8, scale, &len))) return st;
    ms_dtype id = ms_tensor_dtype(fp8), od = ms_tensor_dtype(out);
    const uint8_t *q = ms_tensor_data(fp8);
    const float *s = ms_tensor_data(scale);
    void *o = ms_tensor_data(out);
    for (int64_t i = 0; i < n; i++) {
        float v = id == MS_F8E4M3 ? e4m3_to_f32(q[i]) : e5m2_to_f32(q[i]);
        store_f32(o, od, i, v / s[len ? i / len : 0]);
    }
    return ms__ok();
}

/* ---------------------------------------------------------------- QAT (torchao) */

static ms_dtype promote(ms_dtype a, ms_dtype b) { return a == b ? a : MS_F32; }

/* One group of x (dtype X) fake-quantized into out, with scales and zero points in P. */
static void qat_group(const void *xs, void *o, ms_dtype X, ms_dtype P, int64_t lo, int64_t len,
                      ms_qat_scheme scheme) {
    float mn = load_f32(xs, X, lo), mx = mn;
    for (int64_t i = 1; i < len; i++) {
        float v = load_f32(xs, X, lo + i);
        mn = min_nan(mn, v);
        mx = max_nan(mx, v);
    }
    ms_dtype D = promote(X, P);
    if (scheme == MS_QAT_INT4_WEIGHT_ONLY) {
        /* _choose_qparams_affine_tinygemm in X (eps 1e-6), then .to(P); uint4 0..15 */
        float s = rnd(X, rnd(X, mx - mn) / 15.0f);
        float eps = rnd(X, 1e-6f);
        if (s < eps) s = eps;
        float zp = rnd(X, mn + rnd(X, s * 8.0f));
        s = rnd(P, s);
        zp = rnd(P, zp);
        /* _quantize_affine_tinygemm_no_dtype_cast: min_val in P, the rest in promote(X, P) */
        float minv = rnd(P, zp - rnd(P, s * 8.0f));
        for (int64_t i = 0; i < len; i++) {
            float x = load_f32(xs, X, lo + i);
            float q = clampf(nearbyintf(rnd(D, rnd(D, x - minv) / s)), 0.0f, 15.0f);
            /* _dequantize_affine_tinygemm_no_dtype_check: (q - 8).to(X) *= scale; += zero_point */
            float d = rnd(X, rnd(X, (q - 8.0f) * s) + zp);
            store_f32(o, X, lo + i, d);
        }
    } else if (scheme == MS_QAT_8DA4W_WEIGHT) {
        /* _choose_qparams_affine SYMMETRIC, int4 -8..7, eps finfo(X).smallest_normal, in X */
        float mnn = min_nan(mn, 0.0f), mxp = max_nan(mx, 0.0f);
        float amax = max_nan(-mnn, mxp);
        float s = rnd(X, amax / 7.5f);
        float eps = 1.17549435e-38f; /* 2^-126: f32's and bf16's smallest normal */
        if (s < eps) s = eps;
        s = rnd(P, s);
        float zp = 0.0f;
        /* _quantize_affine_no_dtype_cast: clamp(round(x * (1.0 / scale)) + zero_point) */
        float r = rnd(P, 1.0f / s);
        for (int64_t i = 0; i < len; i++) {
            float x = load_f32(xs, X, lo + i);
            float q = clampf(rnd(D, nearbyintf(rnd(D, x * r)) + zp), -8.0f, 7.0f);
            /* _dequantize_affine_no_dtype_check: (q.to(X) - zp.to(X)) * scale, .to(X) */
            float d = rnd(X, rnd(D, rnd(X, q - zp) * s));
            store_f32(o, X, lo + i, d);
        }
    } else {
        /* the activation: _choose_qparams_affine ASYMMETRIC int8 -128..127, eps finfo(f32).eps,
         * in X, then scale and zero point .to(f32) */
        float mnn = min_nan(mn, 0.0f), mxp = max_nan(mx, 0.0f);
        float s = rnd(X, rnd(X, mxp - mnn) / 255.0f);
        float eps = 1.1920929e-07f; /* 2^-23 */
        if (s < eps) s = eps;
        float zp = rnd(X, -128.0f - nearbyintf(rnd(X, mnn / s)));
        zp = clampf(zp, -128.0f, 127.0f);
        float r = 1.0f / s; /* f32 */
        for (int64_t i = 0; i < len; i++) {
            float x = load_f32(xs, X, lo + i);
            float q = clampf(nearbyintf(x * r) + zp, -128.0f, 127.0f);
            float d = rnd(X, rnd(X, q - zp) * s);
            store_f32(o, X, lo + i, d);
        }
    }
}

ms_status ms_qat_fake_quantize(ms_tensor *out, const ms_tensor *x, ms_qat_scheme scheme, int64_t group_size,
                               ms_dtype scales_precision) {
    MS_NOT_NULL(out);
    MS_NOT_NULL(x);
    const char *fn = __func__;
    ms_status st;
    if (scheme != MS_QAT_INT4_WEIGHT_ONLY && scheme != MS_QAT_8DA4W_WEIGHT && scheme != MS_QAT_8DA4W_ACTIVATION)
        return ms__fail(MS_ERR_ARG, "%s: scheme %d is not MS_QAT_INT4_WEIGHT_ONLY, MS_QAT_8DA4W_WEIGHT or MS_QAT_8DA4W_ACTIVATION",
                        fn, (int)scheme);
    if ((st = check_tensor(fn, "x", x, FLOATS2)) || (st = check_tensor(fn, "out", out, FLOATS2))) return st;
    ms_dtype X = ms_tensor_dtype(x);
    if (ms_tensor_dtype(out) != X)
        return ms__fail(MS_ERR_DTYPE, "%s: out is %s; x's dtype %s was expected", fn, ms_dtype_name(ms_tensor_dtype(out)),
                        ms_dtype_name(X));
    int64_t n = ms_tensor_numel(x);
    if ((st = check_numel(fn, "out", out, n))) return st;
    int nd = ms_tensor_ndim(x);
    if (nd == 0) return ms__fail(MS_ERR_SHAPE, "%s: x has no dims; groups lie along its last dim", fn);
    int64_t last = ms_tensor_size(x, nd - 1);
    ms_dtype P = scales_precision;
    if (scheme == MS_QAT_8DA4W_ACTIVATION) {
        group_size = last;
        P = MS_F32;
    } else {
        if (P != MS_F32 && P != MS_BF16)
            return ms__fail(MS_ERR_DTYPE, "%s: scales_precision is %s; f32 or bf16 was expected", fn,
                            ms_dtype_name(P) ? ms_dtype_name(P) : "not a dtype");
        if (group_size > last) group_size = last; /* get_group_qparams_*: groupsize > w.shape[-1] */
        if (group_size < 2 || last % group_size != 0)
            return ms__fail(MS_ERR_ARG, "%s: group_size %lld does not divide the last dim %lld into groups of 2 or more",
                            fn, (long long)group_size, (long long)last);
    }
    if (n == 0) return ms__ok();
    if (group_size == 0) return ms__fail(MS_ERR_SHAPE, "%s: x's last dim is 0", fn);
    const void *xs = ms_tensor_data(x);
    void *o = ms_tensor_data(out);
    for (int64_t g = 0; g < n / group_size; g++) qat_group(xs, o, X, P, g * group_size, group_size, scheme);
    return ms__ok();
}
