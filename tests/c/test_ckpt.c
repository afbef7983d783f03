/*
 * test_ckpt.c: the checkpoint file primitives (core/src/ckpt.c): CRC32C against the
 * published test vectors (RFC 3720 B.4 and the "123456789" check value), hardware and table
 * alike, chained; a file written from tensors, read back whole and in boxes with pread;
 * rename with the directory synced; mkdir and the listing.
 */
#include "check.h"

#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static uint32_t crc_of(const void *p, int64_t n) {
    uint32_t c = 0;
    CHECK_OK(ms_crc32c(0, p, n, &c));
    return c;
}

static void vectors(void) {
    unsigned char b[32];
    CHECK(crc_of("123456789", 9) == 0xE3069283u);
    memset(b, 0, 32);
    CHECK(crc_of(b, 32) == 0x8A9136AAu);
    memset(b, 0xff, 32);
    CHECK(crc_of(b, 32) == 0x62A8AB43u);
    for (int i = 0; i < 32; i++) b[i] = (unsigned char)i;
    CHECK(crc_of(b, 32) == 0x46DD794Eu);
    for (int i = 0; i < 32; i++) b[i] = (unsigned char)(31 - i);
    CHECK(crc_of(b, 32) == 0x113FDB5Cu);
    CHECK(crc_of("", 0) == 0);
    /* chained = whole, at every split and alignment */
    unsigned char big[1000];
    for (int i = 0; i < 1000; i++) big[i] = (unsigned char)(i * 7 + 3);
    uint32_t whole = crc_of(big, 1000);
    int chained_ok = 1;
    for (int cut = 0; cut <= 1000; cut += 37) {
        uint32_t a = 0, c = 0;
        ms_crc32c(0, big, cut, &a);
        ms_crc32c(a, big + cut, 1000 - cut, &c);
        chained_ok &= c == whole;
    }
    CHECK(chained_ok);
    int off_ok = 1; /* unaligned starts agree with a bitwise reference */
    for (int s = 0; s < 9; s++) {
        uint32_t r = ~0u;
        for (int i = s; i < 1000; i++) {
            r ^= big[i];
            for (int k = 0; k < 8; k++) r = r & 1 ? (r >> 1) ^ 0x82F63B78u : r >> 1;
        }
        off_ok &= crc_of(big + s, 1000 - s) == ~r;
    }
    CHECK(off_ok);
    /* buffers long enough for the hardware's three streams (blocks of 3 x 8 KiB), at several
     * lengths and offsets, against the bitwise reference */
    enum { HUGE = 3 * 3 * 8192 + 1000 };
    unsigned char *h = malloc(HUGE);
    CHECK(h != NULL);
    if (h) {
        for (int i = 0; i < HUGE; i++) h[i] = (unsigned char)(i * 131 + (i >> 9));
        int big_ok = 1;
        const int lens[] = {3 * 8192, 3 * 8192 + 1, 6 * 8192 + 7, HUGE - 3};
        for (int s = 0; s < 3; s++)
            for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
                uint32_t r = ~0u;
                for (int i = s; i < s + lens[k]; i++) {
                    r ^= h[i];
                    for (int b = 0; b < 8; b++) r = r & 1 ? (r >> 1) ^ 0x82F63B78u : r >> 1;
                }
                big_ok &= crc_of(h + s, lens[k]) == ~r;
            }
        CHECK(big_ok);
        free(h);
    }
    printf("crc32c: %s\n", ms_crc32c_impl());
}

static void files(void) {
    char dir[] = "/tmp/ms_test_ckpt.XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char path[256], to[256], sub[256];
    snprintf(path, sizeof path, "%s/a.bin", dir);
    snprintf(to, sizeof to, "%s/b.bin", dir);
    snprintf(sub, sizeof sub, "%s/sub", dir);
    /* a 3 x 4 x 5 f32 tensor of 0..59 after an 8-byte header */
    const int64_t shape[3] = {3, 4, 5};
    ms_tensor *t = NULL, *box = NULL, *whole = NULL;
    CHECK_OK(ms_tensor_new(&t, 3, shape, MS_F32, MS_DEVICE_CPU, 0));
    float *v = ms_tensor_data(t);
    for (int i = 0; i < 60; i++) v[i] = (float)i;
    int fd = -1;
    uint32_t crc = 0, want = 0;
    CHECK_OK(ms_ckpt_open(path, 1, &fd));
    CHECK_OK(ms_ckpt_write(fd, "HEADER..", 8));
    CHECK_OK(ms_ckpt_write_tensor(fd, t, &crc));
    CHECK_OK(ms_ckpt_close(fd, 1));
    CHECK_OK(ms_tensor_crc32c(t, 0, &want));
    CHECK(crc == want && crc == crc_of(v, 240));
    CHECK_OK(ms_ckpt_rename(path, to));
    CHECK_OK(ms_ckpt_open(to, 0, &fd));
    const int64_t zero[3] = {0, 0, 0};
    CHECK_OK(ms_tensor_new(&whole, 3, shape, MS_F32, MS_DEVICE_CPU, 0));
    CHECK_OK(ms_ckpt_read_box(fd, 8, 3, shape, zero, whole));
    CHECK(memcmp(ms_tensor_data(whole), v, 240) == 0);
    /* boxes: rows 1..2 of dim 0 (one run); dims 1 and 2 cut (a run per row) */
    const int64_t cases[3][6] = {{2, 4, 5, 1, 0, 0}, {2, 2, 3, 1, 1, 2}, {3, 4, 1, 0, 0, 4}};
    for (int c = 0; c < 3; c++) {
        CHECK_OK(ms_tensor_new(&box, 3, cases[c], MS_F32, MS_DEVICE_CPU, 0));
        CHECK_OK(ms_ckpt_read_box(fd, 8, 3, shape, cases[c] + 3, box));
        const float *b = ms_tensor_data(box);
        int ok = 1, k = 0;
        for (int i = 0; i < cases[c][0]; i++)
            for (int j = 0; j < cases[c][1]; j++)
                for (int l = 0; l < cases[c][2]; l++)
                    ok &= b[k++] == v[(cases[c][3] + i) * 20 + (cases[c][4] + j) * 5 + cases[c][5] + l];
        CHECK(ok);
        ms_tensor_release(box);
    }
    const int64_t past[3] = {2, 0, 0};
    CHECK_ERR(ms_ckpt_read_box(fd, 8, 3, shape, past, whole), MS_ERR_SHAPE, "outside");
    CHECK_ERR(ms_ckpt_read_box(fd, 100, 3, shape, zero, whole), MS_ERR_IO, "ends at byte");
    CHECK_OK(ms_ckpt_close(fd, 0));
    CHECK_ERR(ms_ckpt_open(path, 0, &fd), MS_ERR_IO, "a.bin");
    CHECK_OK(ms_ckpt_mkdir(sub, 0));
    CHECK_ERR(ms_ckpt_mkdir(sub, 0), MS_ERR_IO, "File exists");
    CHECK_OK(ms_ckpt_mkdir(sub, 1));
    CHECK_OK(ms_ckpt_fsync_path(sub));
    int64_t len = 0;
    char buf[64];
    CHECK_OK(ms_ckpt_list_dir(dir, NULL, 0, &len));
    CHECK(len == 10); /* "b.bin\0sub\0" */
    CHECK_OK(ms_ckpt_list_dir(dir, buf, sizeof buf, &len));
    CHECK((strcmp(buf, "b.bin") == 0 && strcmp(buf + 6, "sub") == 0) ||
          (strcmp(buf, "sub") == 0 && strcmp(buf + 4, "b.bin") == 0));
    rmdir(sub);
    unlink(to);
    rmdir(dir);
    ms_tensor_release(t);
    ms_tensor_release(whole);
}

int main(void) {
    /* the kernel is chosen once per process: a child that forces the tables first */
    pid_t child = fork();
    if (child == 0) {
        setenv("MOONSHARD_CRC32C", "table", 1);
        vectors();
        if (strcmp(ms_crc32c_impl(), "table") != 0) check_failed++;
        exit(check_failed ? 1 : 0);
    }
    int status = 0;
    waitpid(child, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    vectors();
    files();
    return check_summary("test_ckpt");
}
