/*
 * test_cuda.c: cuda tensors against the CPU path, through the public API only.
 *
 *  1. every f32 bit pattern (2^32, in slices) cast on the device to bf16, f16, e4m3 and e5m2
 *     gives the bits the CPU cast gives; every bf16, f16, e4m3 and e5m2 pattern cast back
 *     to f32 too (MOONSHARD_TEST_QUICK=1: 2^28 f32 patterns spread over the whole range);
 *  2. all 121 dtype pairs on values that probe each rule (signs, zeros, subnormals, ties,
 *     overflow, NaN and inf, integer limits), device against CPU, bit for bit;
 *  3. tensors: new is zeroed, fill, copies between host and device in both directions
 *     through strided views, a cast during the copy, to_device round trips, and the errors
 *     for a device that is not there.
 *
 * `test_cuda --tensors` runs part 3 alone (tests/gpu/run.sh, on two simulated devices: the
 * copies between them, the casts having been swept on one).
 * Exit 77 (ctest: skipped) when there is no CUDA device or moonshard was built without CUDA.
 */
#include "check.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static ms_tensor *new_tensor(int ndim, const int64_t *shape, ms_dtype dt, ms_device_type dev) {
    ms_tensor *t = NULL;
    if (ms_tensor_new(&t, ndim, shape, dt, dev, 0)) {
        fprintf(stderr, "tensor_new: %s\n", ms_last_error());
        exit(1);
    }
    return t;
}

static ms_tensor *to_dev(const ms_tensor *t, ms_device_type dev) {
    ms_tensor *r = NULL;
    if (ms_tensor_to_device(&r, t, dev, 0)) {
        fprintf(stderr, "to_device: %s\n", ms_last_error());
        exit(1);
    }
    return r;
}

/* src (cpu) cast to dt on the device and brought back, against the CPU cast: the number of
 * elements whose bytes differ (the first one printed). */
static int64_t device_vs_cpu(const ms_tensor *src, ms_dtype dt) {
    const int64_t n = ms_tensor_numel(src);
    ms_tensor *d_src = to_dev(src, MS_DEVICE_CUDA);
    ms_tensor *d_dst = new_tensor(1, &n, dt, MS_DEVICE_CUDA);
    ms_tensor *want = NULL;
    CHECK_OK(ms_tensor_copy(d_dst, d_src)); /* the cast runs on the device */
    CHECK_OK(ms_tensor_to(&want, src, dt));
    ms_tensor *got = to_dev(d_dst, MS_DEVICE_CPU);
    const int es = ms_dtype_size(dt);
    const unsigned char *g = ms_tensor_data(got), *w = want ? ms_tensor_data(want) : NULL;
    int64_t bad = 0;
    for (int64_t i = 0; w && i < n; i++)
        if (memcmp(g + i * es, w + i * es, (size_t)es)) {
            if (!bad++) {
                uint64_t gv = 0, wv = 0, sv = 0;
                memcpy(&gv, g + i * es, (size_t)es);
                memcpy(&wv, w + i * es, (size_t)es);
                memcpy(&sv, (const unsigned char *)ms_tensor_data(src) + i * ms_dtype_size(ms_tensor_dtype(src)),
                       (size_t)ms_dtype_size(ms_tensor_dtype(src)));
                fprintf(stderr, "  %s -> %s: element %lld (bits 0x%llx): device 0x%llx, cpu 0x%llx\n",
                        ms_dtype_name(ms_tensor_dtype(src)), ms_dtype_name(dt), (long long)i,
                        (unsigned long long)sv, (unsigned long long)gv, (unsigned long long)wv);
            }
        }
    ms_tensor_release(d_src);
    ms_tensor_release(d_dst);
    ms_tensor_release(want);
    ms_tensor_release(got);
    return bad;
}

/* ---------------------------------------------------------------- 1. sweeps */

static void sweep_f32(int quick) {
    enum { SLICE = 1 << 26 };
    const int64_t n = SLICE;
    const ms_dtype narrow[] = {MS_BF16, MS_F16, MS_F8E4M3, MS_F8E5M2};
    ms_tensor *src = new_tensor(1, &n, MS_F32, MS_DEVICE_CPU);
    uint32_t *bits = ms_tensor_data(src);
    const uint64_t step = quick ? 16 : 1; /* quick: every 16th pattern, all 2^32 / 16 */
    int64_t bad[4] = {0}, done = 0;
    for (uint64_t base = 0; base < (1ull << 32); base += (uint64_t)SLICE * step) {
        for (uint64_t i = 0; i < SLICE; i++) bits[i] = (uint32_t)(base + i * step);
        for (int k = 0; k < 4; k++) bad[k] += device_vs_cpu(src, narrow[k]);
        done += SLICE;
    }
    for (int k = 0; k < 4; k++) {
        printf("f32 -> %-6s on the device: %lld patterns, %lld differ from the CPU\n", ms_dtype_name(narrow[k]),
               (long long)done, (long long)bad[k]);
        CHECK(bad[k] == 0);
    }
    ms_tensor_release(src);
}

static void sweep_narrow(void) {
    const ms_dtype narrow[] = {MS_BF16, MS_F16, MS_F8E4M3, MS_F8E5M2};
    for (int k = 0; k < 4; k++) {
        const int64_t n = ms_dtype_size(narrow[k]) == 2 ? 1 << 16 : 1 << 8;
        ms_tensor *src = new_tensor(1, &n, narrow[k], MS_DEVICE_CPU);
        unsigned char *p = ms_tensor_data(src);
        for (int64_t i = 0; i < n; i++) {
            if (n == 256) p[i] = (unsigned char)i;
            else memcpy(p + 2 * i, &(uint16_t){(uint16_t)i}, 2);
        }
        int64_t bad = device_vs_cpu(src, MS_F32);
        printf("%-6s -> f32 on the device: all %lld patterns, %lld differ\n", ms_dtype_name(narrow[k]),
               (long long)n, (long long)bad);
        CHECK(bad == 0);
        ms_tensor_release(src);
    }
}

/* ---------------------------------------------------------------- 2. every pair */

static void all_pairs(void) {
    static const double probes[] = {
        0.0, -0.0, 1.0, -1.0, 0.5, 1.0 / 3, -2.5, 3.5, 255.0, 256.0, -129.0, 127.5, 65504.0, 65520.0, 1e6,
        -1e6, 448.0, 464.0, 57344.0, 1e-8, -1e-8, 6e-8, 1.5e-45, 3.4e38, -3.4e38, 1e300, 2147483648.0,
        -2147483649.0, 9.2233720368547758e18, -9.3e18, 1e-320, 0.0 / 0.0, 1.0 / 0.0, -1.0 / 0.0,
        16777217.0, 0.1, -0.7, 2.0e-38, 1.0e-39};
    const int64_t n = sizeof probes / sizeof probes[0];
    int pairs = 0, bad_pairs = 0;
    for (int s = 0; s < MS_DTYPE_COUNT; s++) {
        /* the probes as f64, then in the source dtype by the CPU rules */
        ms_tensor *f = new_tensor(1, &n, MS_F64, MS_DEVICE_CPU), *src = NULL;
        memcpy(ms_tensor_data(f), probes, sizeof probes);
        CHECK_OK(ms_tensor_to(&src, f, (ms_dtype)s));
        for (int d = 0; d < MS_DTYPE_COUNT && src; d++) {
            pairs++;
            if (device_vs_cpu(src, (ms_dtype)d)) bad_pairs++;
        }
        ms_tensor_release(src);
        ms_tensor_release(f);
    }
    printf("all %d dtype pairs on %lld probe values: %d pairs differ from the CPU\n", pairs, (long long)n, bad_pairs);
    CHECK(pairs == MS_DTYPE_COUNT * MS_DTYPE_COUNT && bad_pairs == 0);
}

/* ---------------------------------------------------------------- 3. tensors */

static void tensors(int ndev) {
    const int64_t shape[2] = {5, 7};
    ms_tensor *d = new_tensor(2, shape, MS_F32, MS_DEVICE_CUDA);
    CHECK(ms_tensor_device(d) == MS_DEVICE_CUDA && ms_tensor_device_index(d) == 0);
    ms_tensor *h = to_dev(d, MS_DEVICE_CPU);
    int zeros = 1;
    for (int i = 0; i < 35; i++) zeros &= ((float *)ms_tensor_data(h))[i] == 0.0f;
    CHECK(zeros); /* new device memory is zeroed */
    ms_tensor_release(h);

    /* fill a column band on the device through a narrow view (strided), read back */
    ms_tensor *band = NULL;
    CHECK_OK(ms_tensor_narrow(&band, d, 1, 2, 3));
    CHECK_OK(ms_tensor_fill(band, 1.5));
    h = to_dev(d, MS_DEVICE_CPU);
    int ok = 1;
    for (int r = 0; r < 5; r++)
        for (int c = 0; c < 7; c++) ok &= ((float *)ms_tensor_data(h))[r * 7 + c] == (c >= 2 && c < 5 ? 1.5f : 0.0f);
    CHECK(ok);

    /* host -> device into a strided view with a cast (f64 host values, f32 device) */
    const int64_t bshape[2] = {5, 3};
    ms_tensor *hv = new_tensor(2, bshape, MS_F64, MS_DEVICE_CPU);
    for (int i = 0; i < 15; i++) ((double *)ms_tensor_data(hv))[i] = i + 0.25;
    CHECK_OK(ms_tensor_copy(band, hv));
    ms_tensor_release(h);
    h = to_dev(d, MS_DEVICE_CPU);
    ok = 1;
    for (int r = 0; r < 5; r++)
        for (int c = 0; c < 7; c++)
            ok &= ((float *)ms_tensor_data(h))[r * 7 + c] == (c >= 2 && c < 5 ? (float)(r * 3 + c - 2) + 0.25f : 0.0f);
    CHECK(ok);

    /* device (strided view) -> host in another dtype */
    ms_tensor *hb = new_tensor(2, bshape, MS_BF16, MS_DEVICE_CPU);
    CHECK_OK(ms_tensor_copy(hb, band));
    CHECK(((uint16_t *)ms_tensor_data(hb))[4] == 0x4088); /* row 1, col 1: 4.25 in bf16 */

    /* device -> another device (cuda:0's strided view, in bf16 on cuda:1), then to the host:
     * the bits of the host copy above */
    if (ndev >= 2) {
        ms_tensor *other = NULL, *back = NULL;
        CHECK_OK(ms_tensor_new(&other, 2, bshape, MS_BF16, MS_DEVICE_CUDA, 1));
        if (other) {
            CHECK_OK(ms_tensor_copy(other, band));
            back = to_dev(other, MS_DEVICE_CPU);
            CHECK(back && !memcmp(ms_tensor_data(back), ms_tensor_data(hb), (size_t)ms_tensor_nbytes(hb)));
            ms_tensor_release(back);
            ms_tensor_release(other);
        }
        printf("tensors: cuda:0 -> cuda:1 (strided, f32 -> bf16): checked\n");
    }

    /* device memory the host owns, wrapped: the same bytes, no copy; host memory, memory of
     * another device and a meta "device" refused by name */
    ms_tensor *w = NULL;
    CHECK_OK(ms_tensor_wrap_device(&w, ms_tensor_data(d), 2, shape, MS_F32, MS_DEVICE_CUDA, 0));
    if (w) {
        CHECK(ms_tensor_device(w) == MS_DEVICE_CUDA && ms_tensor_data(w) == ms_tensor_data(d));
        CHECK_OK(ms_tensor_fill(w, -2));
        ms_tensor *seen = to_dev(d, MS_DEVICE_CPU);
        CHECK(seen && ((float *)ms_tensor_data(seen))[34] == -2.0f);
        ms_tensor_release(seen);
        ms_tensor_release(w);
    }
    ms_tensor *hw = NULL;
    CHECK_ERR(ms_tensor_wrap_device(&hw, ms_tensor_data(hb), 2, bshape, MS_BF16, MS_DEVICE_CUDA, 0), MS_ERR_DEVICE,
              "is host memory, not memory of cuda:0");
    CHECK_ERR(ms_tensor_wrap_device(&hw, ms_tensor_data(d), 2, (int64_t[]){5, 8}, MS_F32, MS_DEVICE_CUDA, 0),
              MS_ERR_DEVICE, "last byte of 160");
    CHECK_ERR(ms_tensor_wrap_device(&hw, ms_tensor_data(d), 2, shape, MS_F32, MS_DEVICE_META, 0), MS_ERR_DEVICE,
              "a meta tensor has no memory to wrap");
    if (ndev >= 2)
        CHECK_ERR(ms_tensor_wrap_device(&hw, ms_tensor_data(d), 2, shape, MS_F32, MS_DEVICE_CUDA, 1), MS_ERR_DEVICE,
                  "is memory of cuda:0, not of cuda:1");

    /* a meta tensor has nothing to move; a device that is not there says so */
    ms_tensor *m = new_tensor(2, shape, MS_F32, MS_DEVICE_META), *none = NULL;
    CHECK_ERR(ms_tensor_copy(d, m), MS_ERR_DEVICE, "a meta tensor holds no data");
    CHECK_ERR(ms_tensor_new(&none, 2, shape, MS_F32, MS_DEVICE_CUDA, ndev), MS_ERR_DEVICE, "CUDA device");
    printf("tensors: zeroed, fill, strided copies both ways with casts, errors: checked (%d device%s)\n", ndev,
           ndev == 1 ? "" : "s");
    ms_tensor_release(m);
    ms_tensor_release(hb);
    ms_tensor_release(hv);
    ms_tensor_release(h);
    ms_tensor_release(band);
    ms_tensor_release(d);
}

int main(int argc, char **argv) {
    const int tensors_only = argc == 2 && !strcmp(argv[1], "--tensors");
    if (argc > 1 && !tensors_only) {
        fprintf(stderr, "usage: test_cuda [--tensors]\n");
        return 2;
    }
    int ndev = 0;
    ms_status st = ms_cuda_device_count(&ndev);
    if (st != MS_OK) {
        printf("test_cuda: skipped: %s\n", ms_last_error());
        return 77;
    }
    const char *q = getenv("MOONSHARD_TEST_QUICK");
    int quick = q && *q && strcmp(q, "0");
    tensors(ndev);
    if (tensors_only) return check_summary("test_cuda");
    all_pairs();
    sweep_narrow();
    sweep_f32(quick);
    return check_summary("test_cuda");
}
