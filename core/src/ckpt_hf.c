/*
 * ckpt_hf.c: the one IO primitive of the Hugging Face checkpoint loader
 * (lua/moonshard/checkpoint_hf.lua): a box of a row-major tensor stored in a file (a
 * .safetensors data area), read with pread and cast into a tensor, optionally with its dims
 * permuted (the transposes of Automodel's grouped experts).  Only the bytes from the box's
 * first element to its last are read, so a rank that holds rows [a, b) of a tensor sharded on
 * dim 0 reads exactly those rows.
 *
 * ckpt.c's ms_ckpt_read_box is the other pread primitive; they stay two: this one takes a
 * path (the loader opens each tensor's file once per region), casts and permutes through a
 * buffer of the covering run; ms_ckpt_read_box takes an open fd and reads exact runs with no
 * cast straight into its tensor (the checkpoint's direct reads into shards).  Folding one into
 * the other would add a dtype/perm path to the checkpoint's hot loop or an fd cache to the
 * loader for no gain; the pread loops are a dozen lines each.
 */
#include "ms_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static ms_status read_at(const char *path, int64_t offset, void *buf, int64_t n) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int err = errno;
        return ms__fail(MS_ERR_IO, "ms_file_read_region: %s: %s", path, strerror(err));
    }
    int64_t done = 0;
    while (done < n) {
        size_t want = (size_t)(n - done > (int64_t)1 << 30 ? (int64_t)1 << 30 : n - done);
        ssize_t got = pread(fd, (char *)buf + done, want, (off_t)(offset + done));
        if (got < 0) {
            if (errno == EINTR) continue;
            int err = errno;
            close(fd);
            return ms__fail(MS_ERR_IO, "ms_file_read_region: %s: reading %lld bytes at %lld: %s", path,
                            (long long)n, (long long)offset, strerror(err));
        }
        if (got == 0) {
            close(fd);
            return ms__fail(MS_ERR_IO,
                            "ms_file_read_region: %s: the file ends at byte %lld, before the %lld bytes at %lld",
                            path, (long long)(offset + done), (long long)n, (long long)offset);
        }
        done += got;
    }
    close(fd);
    return ms__ok();
}

ms_status ms_file_read_region(const char *path, int64_t data_offset, ms_dtype src_dtype, int ndim,
                              const int64_t *src_shape, const int64_t *start, const int64_t *perm, ms_tensor *dst,
                              int64_t *bytes_read) {
    MS_NOT_NULL(path);
    MS_NOT_NULL(dst);
    if (bytes_read) *bytes_read = 0;
    if (ndim < 0 || ndim > MS_MAX_DIMS)
        return ms__fail(MS_ERR_SHAPE, "ms_file_read_region: a tensor has 0 to %d dims, got %d", MS_MAX_DIMS, ndim);
    if (ndim > 0) {
        MS_NOT_NULL(src_shape);
        MS_NOT_NULL(start);
    }
    int esize = ms_dtype_size(src_dtype);
    if (esize <= 0) return ms__fail(MS_ERR_DTYPE, "ms_file_read_region: source dtype %d is not a dtype", (int)src_dtype);
    if (data_offset < 0) return ms__fail(MS_ERR_ARG, "ms_file_read_region: data offset %lld < 0", (long long)data_offset);
    if (ms_tensor_ndim(dst) != ndim)
        return ms__fail(MS_ERR_SHAPE, "ms_file_read_region: dst has %d dims, the source %d", ms_tensor_ndim(dst), ndim);
    /* box dim perm[i] has dst's size i */
    int64_t size[MS_MAX_DIMS], stride[MS_MAX_DIMS];
    int seen[MS_MAX_DIMS] = {0};
    for (int i = 0; i < ndim; i++) {
        int64_t p = perm ? perm[i] : i;
        if (p < 0 || p >= ndim || seen[p])
            return ms__fail(MS_ERR_ARG, "ms_file_read_region: perm is not a permutation of 0..%d", ndim - 1);
        seen[p] = 1;
        size[p] = ms_tensor_size(dst, i);
    }
    int64_t s = 1, empty = 0;
    for (int d = ndim - 1; d >= 0; d--) {
        if (src_shape[d] < 0 || start[d] < 0 || start[d] > src_shape[d] || size[d] > src_shape[d] - start[d])
            return ms__fail(MS_ERR_SHAPE, "ms_file_read_region: dim %d: rows [%lld, %lld) of a dim of %lld", d,
                            (long long)start[d], (long long)(start[d] + size[d]), (long long)src_shape[d]);
        stride[d] = s;
        if (src_shape[d] > 0 && s > INT64_MAX / src_shape[d])
            return ms__fail(MS_ERR_OVERFLOW, "ms_file_read_region: the source shape overflows");
        s *= src_shape[d];
        if (size[d] == 0) empty = 1;
    }
    if (empty) return ms__ok();
    int64_t first = 0, last = 0;
    for (int d = 0; d < ndim; d++) {
        first += start[d] * stride[d];
        last += (start[d] + size[d] - 1) * stride[d];
    }
    int64_t n = last - first + 1;
    /* the covering run, as a tensor of src_dtype, then a strided view of the box over it */
    ms_tensor *buf = NULL, *view = NULL;
    int64_t one = n;
    ms_status st = ms_tensor_new(&buf, 1, &one, src_dtype, MS_DEVICE_CPU, 0);
    if (st) return st;
    if (n > INT64_MAX / esize || data_offset > INT64_MAX - first * esize) {
        ms_tensor_release(buf);
        return ms__fail(MS_ERR_OVERFLOW, "ms_file_read_region: the byte range overflows");
    }
    st = read_at(path, data_offset + first * esize, ms_tensor_data(buf), n * esize);
    if (!st) st = ms_tensor_narrow(&view, buf, 0, 0, n);
    if (!st) {
        view->ndim = ndim;
        for (int i = 0; i < ndim; i++) {
            int p = perm ? (int)perm[i] : i;
            view->shape[i] = size[p];
            view->stride[i] = stride[p];
        }
        st = ms_tensor_copy(dst, view);
    }
    if (view) ms_tensor_release(view);
    ms_tensor_release(buf);
    if (!st && bytes_read) *bytes_read = n * esize;
    return st;
}
