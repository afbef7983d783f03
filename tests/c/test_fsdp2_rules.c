/*
 * test_fsdp2_rules.c: the dtypes a shard unit gathers and reduces one parameter in, against
 * tests/data/fsdp2_rules.txt, the table the planner is checked against too
 * (tests/lua/fsdp2_rules_spec.lua): one rule, two implementations, one table.
 */
#include "check.h"

#include <stdio.h>
#include <string.h>

static int dtype_of(const char *name, ms_dtype *out) {
    if (!strcmp(name, "-")) return 0;
    CHECK_OK(ms_dtype_parse(name, out));
    return 1;
}

int main(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/../../data/fsdp2_rules.txt", MS_REFDATA_DIR);
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "test_fsdp2_rules: cannot open %s\n", path);
        return 1;
    }
    ms_world *w = NULL;
    ms_comm *world = NULL;
    CHECK_OK(ms_threads_world_new(&w, 1, 60));
    CHECK_OK(ms_world_comm(w, 0, &world));
    char line[256];
    int rows = 0, lineno = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        char s[16], p[16], r[16], arrow[8], g[16], rd[16];
        if (line[0] == '#' || sscanf(line, "%15s %15s %15s %7s %15s %15s", s, p, r, arrow, g, rd) != 6) continue;
        CHECK(!strcmp(arrow, "->"));
        ms_dtype stored = MS_F32, pd = MS_F32, red = MS_F32, gather_want = MS_F32, reduce_want = MS_F32;
        CHECK(dtype_of(s, &stored));
        const int has_pd = dtype_of(p, &pd), has_rd = dtype_of(r, &red);
        CHECK(dtype_of(g, &gather_want));
        const int has_reduce = dtype_of(rd, &reduce_want);
        ms_unit *u = NULL;
        CHECK_OK(ms_unit_new(&u, "rule", world, NULL, has_pd ? (int)pd : -1, has_rd ? (int)red : -1, MS_RESHARD_FULL));
        if (!u) continue;
        CHECK_OK(ms_unit_add_param(u, "p", 1, (int64_t[]){4}, stored, 0, has_reduce));
        CHECK_OK(ms_unit_finalize(u));
        int ndim = 0, requires_grad = -1;
        int64_t shape[MS_MAX_DIMS];
        ms_dtype st = MS_F32, gather = MS_F32, reduce = MS_F32;
        CHECK_OK(ms_unit_param_info(u, 0, &ndim, shape, &st, &gather, &requires_grad));
        if (gather != gather_want)
            fprintf(stderr, "%s:%d: %s %s %s gathers in %s, the table says %s\n", path, lineno, s, p, r,
                    ms_dtype_name(gather), g);
        CHECK(gather == gather_want);
        if (has_reduce) {
            CHECK_OK(ms_unit_reduce_dtype(u, &reduce));
            if (reduce != reduce_want)
                fprintf(stderr, "%s:%d: %s %s %s reduces in %s, the table says %s\n", path, lineno, s, p, r,
                        ms_dtype_name(reduce), rd);
            CHECK(reduce == reduce_want);
        }
        ms_unit_release(u);
        rows++;
    }
    fclose(f);
    CHECK(rows >= 19);
    ms_comm_release(world);
    ms_world_release(w);
    printf("test_fsdp2_rules: %d rows of tests/data/fsdp2_rules.txt agree with the shard units\n", rows);
    return check_summary("test_fsdp2_rules");
}
