/*
 * layout.c: where a shard lives.  torch.chunk extents, DTensor local shapes and global
 * offsets over a mesh and FSDP2 padded shards.  Pure integer math.
 */
#include "ms_internal.h"

ms_status ms_chunk_extent(int64_t n, int64_t k, int64_t r, int64_t *length, int64_t *offset) {
    MS_NOT_NULL(length);
    MS_NOT_NULL(offset);
    if (n < 0) return ms__fail(MS_ERR_SHAPE, "chunk_extent: size %lld is negative", (long long)n);
    if (k < 1) return ms__fail(MS_ERR_ARG, "chunk_extent: %lld chunks; need at least 1", (long long)k);
    if (r < 0 || r >= k)
        return ms__fail(MS_ERR_ARG, "chunk_extent: index %lld out of range for %lld chunks", (long long)r,
                        (long long)k);
    if (n % k == 0) {
        *length = n / k;
        *offset = r * (n / k);
        return ms__ok();
    }
    int64_t c = n / k + 1; /* ceil(n/k) when n % k != 0 */
    /* c*r cannot overflow: c <= n/k + 1 and r < k, so c*r < n + k. */
    int64_t start = c * r;
    if (start >= n) {
        *length = 0;
        *offset = n;
    } else {
        *length = (n - start < c ? n - start : c);
        *offset = start;
    }
    return ms__ok();
}

ms_status ms_local_shape(int ndim, const int64_t *global_shape, int mesh_ndim, const int *kinds,
                         const int *shard_dims, const int64_t *mesh_sizes, const int64_t *coords,
                         int64_t *local_shape, int64_t *global_offset) {
    if (ndim > 0) MS_NOT_NULL(global_shape);
    if (mesh_ndim > 0) {
        MS_NOT_NULL(kinds);
        MS_NOT_NULL(shard_dims);
        MS_NOT_NULL(mesh_sizes);
        MS_NOT_NULL(coords);
    }
    MS_NOT_NULL(local_shape);
    MS_NOT_NULL(global_offset);
    int64_t numel;
    ms_status st = ms__check_shape(ndim, global_shape, &numel);
    if (st) return ms__wrap(st, "local_shape");
    if (mesh_ndim < 0 || mesh_ndim > MS_MAX_DIMS)
        return ms__fail(MS_ERR_ARG, "local_shape: a mesh has 0 to %d dims, got %d", MS_MAX_DIMS, mesh_ndim);
    for (int d = 0; d < ndim; d++) {
        local_shape[d] = global_shape[d];
        global_offset[d] = 0;
    }
    for (int i = 0; i < mesh_ndim; i++) {
        if (mesh_sizes[i] < 1)
            return ms__fail(MS_ERR_ARG, "local_shape: mesh dim %d has size %lld", i, (long long)mesh_sizes[i]);
        if (coords[i] < 0 || coords[i] >= mesh_sizes[i])
            return ms__fail(MS_ERR_ARG, "local_shape: coordinate %lld out of range for mesh dim %d of size %lld",
                            (long long)coords[i], i, (long long)mesh_sizes[i]);
        switch (kinds[i]) {
        case MS_PLACE_REPLICATE:
        case MS_PLACE_PARTIAL:
            break;
        case MS_PLACE_SHARD: {
            int d = shard_dims[i] < 0 ? shard_dims[i] + ndim : shard_dims[i];
            if (d < 0 || d >= ndim)
                return ms__fail(MS_ERR_ARG, "local_shape: Shard(%d) on mesh dim %d is out of range for a %d-dim tensor",
                                shard_dims[i], i, ndim);
            int64_t len, off;
            ms_chunk_extent(local_shape[d], mesh_sizes[i], coords[i], &len, &off);
            local_shape[d] = len;
            /* an empty shard sits at the end of the dim, as DTensor's
             * compute_local_shape_and_global_offset puts it, however many shardings deep */
            global_offset[d] = len ? global_offset[d] + off : global_shape[d];
            break;
        }
        default:
            return ms__fail(MS_ERR_ARG, "local_shape: placement kind %d on mesh dim %d is not Shard, Replicate or Partial",
                            kinds[i], i);
        }
    }
    return ms__ok();
}

ms_status ms_fsdp_shard(int ndim, const int64_t *shape, int64_t world, int64_t rank, int dim,
                        int64_t *local_shape, int64_t *offset, int64_t *padded_shape) {
    if (ndim > 0) MS_NOT_NULL(shape);
    MS_NOT_NULL(local_shape);
    MS_NOT_NULL(offset);
    MS_NOT_NULL(padded_shape);
    int64_t numel;
    ms_status st = ms__check_shape(ndim, shape, &numel);
    if (st) return ms__wrap(st, "fsdp_shard");
    if (ndim == 0) return ms__fail(MS_ERR_SHAPE, "fsdp_shard: scalar (0-dim) parameters cannot be sharded");
    if (world < 1) return ms__fail(MS_ERR_ARG, "fsdp_shard: world size %lld; need at least 1", (long long)world);
    if (rank < 0 || rank >= world)
        return ms__fail(MS_ERR_ARG, "fsdp_shard: rank %lld out of range for world size %lld", (long long)rank,
                        (long long)world);
    int d = dim < 0 ? dim + ndim : dim;
    if (d < 0 || d >= ndim)
        return ms__fail(MS_ERR_ARG, "fsdp_shard: dim %d out of range for a %d-dim parameter", dim, ndim);
    if (d != 0 && shape[d] % world != 0)
        return ms__fail(MS_ERR_SHAPE, "fsdp_shard: shard dim %d has size %lld, not divisible by world size %lld "
                        "(only dim 0 may be uneven)", d, (long long)shape[d], (long long)world);
    for (int i = 0; i < ndim; i++) local_shape[i] = padded_shape[i] = shape[i];
    int64_t len, off;
    ms_chunk_extent(shape[d], world, rank, &len, &off);
    local_shape[d] = len;
    *offset = off;
    padded_shape[d] = shape[d] / world + (shape[d] % world != 0);
    return ms__ok();
}
