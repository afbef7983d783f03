/*
 * ckpt.c: the file primitives of distributed checkpoints (lua/moonshard/checkpoint.lua):
 * CRC32C (SSE4.2's crc32 instruction where the CPU has it, else slicing-by-8 tables; the same
 * values), files written from tensors and fsynced, byte ranges of a row-major tensor in a
 * file read into a tensor with pread, rename + fsync of the directory, mkdir and a listing.
 */
#include "ms_internal.h"

#include <pthread.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---------------------------------------------------------------- CRC32C (Castagnoli) */

#define CRC32C_POLY 0x82F63B78u /* reflected 0x1EDC6F41 */

static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

#if defined(__x86_64__) && defined(__GNUC__)
static void crc_zeros_init(void);
#endif

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++) crc_table[t][n] = (crc_table[t - 1][n] >> 8) ^ crc_table[0][crc_table[t - 1][n] & 0xff];
#if defined(__x86_64__) && defined(__GNUC__)
    crc_zeros_init();
#endif
}

/* c: the register (already inverted) */
static uint32_t crc_soft(uint32_t c, const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) {
        c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
        n--;
    }
    while (n >= 8) {
        uint32_t lo = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
        uint32_t hi = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 | (uint32_t)p[7] << 24;
        lo ^= c;
        c = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff] ^ crc_table[5][(lo >> 16) & 0xff] ^
            crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xff] ^ crc_table[2][(hi >> 8) & 0xff] ^
            crc_table[1][(hi >> 16) & 0xff] ^ crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>
#define HAVE_CRC_HW 1
/* Three streams at once: the crc32 instruction takes 3 cycles and issues one a cycle, so a
 * buffer cut in three runs about three times faster, the three registers joined after each
 * block.  The register of A then B, from c: shift(reg(A, c), |B|) ^ reg(B, 0), where shift
 * runs the register over |B| zero bytes, a linear map of 32 bits: crc_zeros holds it for
 * CRC_BLOCK bytes as four byte tables, built once by squaring the one-zero-bit operator (the
 * method of zlib's crc32_combine). */
enum { CRC_BLOCK = 8192 };
static uint32_t crc_zeros[4][256];

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    for (int i = 0; vec; vec >>= 1, i++)
        if (vec & 1) sum ^= mat[i];
    return sum;
}

static void gf2_square(uint32_t *sq, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) sq[n] = gf2_times(mat, mat[n]);
}

/* The register run over len zero bytes (len >= 1). */
static uint32_t crc_shift_slow(uint32_t crc, size_t len) {
    uint32_t even[32], odd[32];
    odd[0] = 0x82F63B78u; /* one zero bit: the reflected polynomial, then a shift */
    for (int n = 1; n < 32; n++) odd[n] = 1u << (n - 1);
    gf2_square(even, odd); /* two zero bits */
    gf2_square(odd, even); /* four */
    for (;;) {
        gf2_square(even, odd); /* 8, 32, 128, ... bits */
        if (len & 1) crc = gf2_times(even, crc);
        len >>= 1;
        if (!len) break;
        gf2_square(odd, even); /* 16, 64, ... bits */
        if (len & 1) crc = gf2_times(odd, crc);
        len >>= 1;
        if (!len) break;
    }
    return crc;
}

static void crc_zeros_init(void) {
    for (int k = 0; k < 4; k++)
        for (uint32_t b = 0; b < 256; b++) crc_zeros[k][b] = crc_shift_slow(b << (8 * k), CRC_BLOCK);
}

static uint32_t crc_shift_block(uint32_t c) {
    return crc_zeros[0][c & 0xff] ^ crc_zeros[1][(c >> 8) & 0xff] ^ crc_zeros[2][(c >> 16) & 0xff] ^
           crc_zeros[3][c >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t c, const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) {
        c = _mm_crc32_u8(c, *p++);
        n--;
    }
    while (n >= 3 * (size_t)CRC_BLOCK) {
        uint64_t a = c, b = 0, d = 0;
        for (size_t i = 0; i < CRC_BLOCK; i += 8) {
            uint64_t x, y, z;
            memcpy(&x, p + i, 8);
            memcpy(&y, p + CRC_BLOCK + i, 8);
            memcpy(&z, p + 2 * CRC_BLOCK + i, 8);
            a = _mm_crc32_u64(a, x);
            b = _mm_crc32_u64(b, y);
            d = _mm_crc32_u64(d, z);
        }
        c = crc_shift_block(crc_shift_block((uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)d;
        p += 3 * CRC_BLOCK;
        n -= 3 * CRC_BLOCK;
    }
    uint64_t c64 = c;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c64 = _mm_crc32_u64(c64, v);
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c64;
    while (n--) c = _mm_crc32_u8(c, *p++);
    return c;
}
#endif

/* 1: hardware, 0: tables; decided once (MOONSHARD_CRC32C=table forces the tables, for tests). */
static int crc_use_hw = -1;

static uint32_t crc_update(uint32_t crc, const void *data, size_t n) {
    pthread_once(&crc_once, crc_init);
    if (crc_use_hw < 0) {
        int hw = 0;
#ifdef HAVE_CRC_HW
        const char *e = getenv("MOONSHARD_CRC32C");
        hw = __builtin_cpu_supports("sse4.2") && !(e && strcmp(e, "table") == 0);
#endif
        crc_use_hw = hw;
    }
    uint32_t c = ~crc;
#ifdef HAVE_CRC_HW
    if (crc_use_hw) return ~crc_hw(c, data, n);
#endif
    return ~crc_soft(c, data, n);
}

ms_status ms_crc32c(uint32_t crc, const void *data, int64_t nbytes, uint32_t *out) {
    MS_NOT_NULL(out);
    if (nbytes < 0) return ms__fail(MS_ERR_ARG, "ms_crc32c: nbytes %lld is negative", (long long)nbytes);
    if (nbytes > 0 && !data) return ms__null_arg(__func__, "data");
    *out = nbytes ? crc_update(crc, data, (size_t)nbytes) : crc;
    return ms__ok();
}

const char *ms_crc32c_impl(void) {
    uint32_t x;
    ms_crc32c(0, "", 1, &x); /* decides */
    return crc_use_hw ? "sse4.2" : "table";
}

/* A contiguous cpu tensor's bytes, or a message naming `fn` and what is wrong. */
static ms_status host_bytes(const char *fn, const ms_tensor *t, const void **data, int64_t *nbytes) {
    if (ms_tensor_device(t) != MS_DEVICE_CPU)
        return ms__fail(MS_ERR_DEVICE, "%s: the tensor is not on the cpu (copy it to the host first)", fn);
    if (!ms_tensor_is_contiguous(t)) return ms__fail(MS_ERR_ARG, "%s: the tensor is not contiguous", fn);
    *data = ms_tensor_data(t);
    *nbytes = ms_tensor_nbytes(t);
    return MS_OK;
}

ms_status ms_tensor_crc32c(const ms_tensor *t, uint32_t crc, uint32_t *out) {
    MS_NOT_NULL(t);
    MS_NOT_NULL(out);
    const void *data = NULL;
    int64_t n = 0;
    ms_status st = host_bytes(__func__, t, &data, &n);
    if (st) return st;
    *out = n ? crc_update(crc, data, (size_t)n) : crc;
    return ms__ok();
}

/* ---------------------------------------------------------------- files */

static ms_status io_fail(const char *fn, const char *what, const char *path) {
    int e = errno;
    return ms__fail(MS_ERR_IO, "%s: %s%s%s: %s", fn, what, path ? " " : "", path ? path : "", strerror(e));
}

ms_status ms_ckpt_open(const char *path, int write, int *fd) {
    MS_NOT_NULL(path);
    MS_NOT_NULL(fd);
    int f = write ? open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644) : open(path, O_RDONLY | O_CLOEXEC);
    if (f < 0) return io_fail(__func__, write ? "cannot create" : "cannot open", path);
    *fd = f;
    return ms__ok();
}

static ms_status write_all(const char *fn, int fd, const unsigned char *p, int64_t n) {
    while (n > 0) {
        size_t chunk = n > (1 << 30) ? (size_t)1 << 30 : (size_t)n;
        ssize_t w = write(fd, p, chunk);
        if (w < 0) {
            if (errno == EINTR) continue;
            return io_fail(fn, "write", NULL);
        }
        p += w;
        n -= w;
    }
    return MS_OK;
}

ms_status ms_ckpt_write(int fd, const void *data, int64_t nbytes) {
    if (nbytes < 0) return ms__fail(MS_ERR_ARG, "ms_ckpt_write: nbytes %lld is negative", (long long)nbytes);
    if (nbytes > 0 && !data) return ms__null_arg(__func__, "data");
    ms_status st = write_all(__func__, fd, data, nbytes);
    return st ? st : ms__ok();
}

ms_status ms_ckpt_write_tensor(int fd, const ms_tensor *t, uint32_t *crc) {
    MS_NOT_NULL(t);
    MS_NOT_NULL(crc);
    const void *data = NULL;
    int64_t n = 0;
    ms_status st = host_bytes(__func__, t, &data, &n);
    if (st) return st;
    if ((st = write_all(__func__, fd, data, n))) return st;
    *crc = n ? crc_update(0, data, (size_t)n) : 0;
    return ms__ok();
}

static ms_status pread_all(int fd, unsigned char *p, int64_t n, int64_t off) {
    while (n > 0) {
        size_t chunk = n > (1 << 30) ? (size_t)1 << 30 : (size_t)n;
        ssize_t r = pread(fd, p, chunk, (off_t)off);
        if (r < 0) {
            if (errno == EINTR) continue;
            return io_fail("ms_ckpt_read_box", "pread", NULL);
        }
        if (r == 0)
            return ms__fail(MS_ERR_IO, "ms_ckpt_read_box: the file ends at byte %lld, before the %lld bytes wanted there",
                            (long long)off, (long long)n);
        p += r;
        n -= r;
        off += r;
    }
    return MS_OK;
}

ms_status ms_ckpt_read_box(int fd, int64_t offset, int ndim, const int64_t *shape, const int64_t *start,
                           ms_tensor *out) {
    MS_NOT_NULL(shape);
    MS_NOT_NULL(start);
    MS_NOT_NULL(out);
    const void *cdata = NULL;
    int64_t nbytes = 0;
    ms_status st = host_bytes(__func__, out, &cdata, &nbytes);
    if (st) return st;
    if (ndim < 1 || ndim > MS_MAX_DIMS || ms_tensor_ndim(out) != ndim)
        return ms__fail(MS_ERR_SHAPE, "ms_ckpt_read_box: ndim %d; out has %d dims (1 to 8, the same)", ndim,
                        ms_tensor_ndim(out));
    if (offset < 0) return ms__fail(MS_ERR_ARG, "ms_ckpt_read_box: offset %lld is negative", (long long)offset);
    int64_t box[MS_MAX_DIMS];
    for (int d = 0; d < ndim; d++) {
        box[d] = ms_tensor_size(out, d);
        if (start[d] < 0 || shape[d] < 0 || start[d] + box[d] > shape[d])
            return ms__fail(MS_ERR_SHAPE, "ms_ckpt_read_box: dim %d: rows [%lld, %lld) are outside the stored %lld", d,
                            (long long)start[d], (long long)(start[d] + box[d]), (long long)shape[d]);
    }
    if (nbytes == 0) return ms__ok();
    const int64_t esize = ms_dtype_size(ms_tensor_dtype(out));
    /* One pread per contiguous run: k is the smallest dim such that the box is whole in every
       dim after it, so a run is box[k] x shape[k+1..] elements and there is one per index of
       the dims before k. */
    int k = ndim - 1;
    while (k > 0 && box[k] == shape[k] && start[k] == 0) k--;
    int64_t run = esize; /* bytes of one contiguous run: box[k] x shape[k+1..] */
    for (int d = k; d < ndim; d++) run *= box[d];
    int64_t stride[MS_MAX_DIMS]; /* bytes per step of each stored dim */
    stride[ndim - 1] = esize;
    for (int d = ndim - 2; d >= 0; d--) stride[d] = stride[d + 1] * shape[d + 1];
    int64_t idx[MS_MAX_DIMS] = {0}; /* over dims < k */
    unsigned char *dst = (unsigned char *)cdata;
    for (;;) {
        int64_t off = offset;
        for (int d = 0; d < ndim; d++) off += (start[d] + (d < k ? idx[d] : 0)) * stride[d];
        if ((st = pread_all(fd, dst, run, off))) return st;
        dst += run;
        int d = k - 1;
        while (d >= 0 && ++idx[d] == box[d]) idx[d--] = 0;
        if (d < 0) break;
    }
    return ms__ok();
}

ms_status ms_ckpt_close(int fd, int sync) {
    if (sync && fsync(fd) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return io_fail(__func__, "fsync", NULL);
    }
    if (close(fd) != 0) return io_fail(__func__, "close", NULL);
    return ms__ok();
}

ms_status ms_ckpt_fsync_path(const char *path) {
    MS_NOT_NULL(path);
    int f = open(path, O_RDONLY | O_CLOEXEC);
    if (f < 0) return io_fail(__func__, "cannot open", path);
    if (fsync(f) != 0) {
        int e = errno;
        close(f);
        errno = e;
        return io_fail(__func__, "fsync", path);
    }
    close(f);
    return ms__ok();
}

ms_status ms_ckpt_rename(const char *from, const char *to) {
    MS_NOT_NULL(from);
    MS_NOT_NULL(to);
    if (rename(from, to) != 0) {
        int e = errno;
        return ms__fail(MS_ERR_IO, "ms_ckpt_rename: %s -> %s: %s", from, to, strerror(e));
    }
    /* the directory holding `to`, so that the new name survives a crash */
    const char *slash = strrchr(to, '/');
    char *dir = NULL;
    if (slash) {
        size_t len = slash == to ? 1 : (size_t)(slash - to);
        dir = malloc(len + 1);
        if (!dir) return ms__fail(MS_ERR_OOM, "ms_ckpt_rename: out of memory");
        memcpy(dir, to, len);
        dir[len] = 0;
    }
    int f = open(dir ? dir : ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    ms_status st = MS_OK;
    if (f < 0 || fsync(f) != 0) st = io_fail(__func__, "fsync of the directory", dir ? dir : ".");
    if (f >= 0) close(f);
    free(dir);
    return st ? st : ms__ok();
}

ms_status ms_ckpt_mkdir(const char *path, int exist_ok) {
    MS_NOT_NULL(path);
    if (mkdir(path, 0755) != 0) {
        struct stat s;
        if (!(exist_ok && errno == EEXIST && stat(path, &s) == 0 && S_ISDIR(s.st_mode)))
            return io_fail(__func__, "cannot make the directory", path);
    }
    return ms__ok();
}

ms_status ms_ckpt_list_dir(const char *path, char *buf, int64_t cap, int64_t *len) {
    MS_NOT_NULL(path);
    MS_NOT_NULL(len);
    if (cap > 0 && !buf) return ms__null_arg(__func__, "buf");
    DIR *d = opendir(path);
    if (!d) return io_fail(__func__, "cannot list", path);
    int64_t need = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        int64_t n = (int64_t)strlen(e->d_name) + 1;
        if (need + n <= cap) memcpy(buf + need, e->d_name, (size_t)n);
        need += n;
    }
    closedir(d);
    *len = need;
    return ms__ok();
}
