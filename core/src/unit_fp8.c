/*
 * unit_fp8.c: the FP8 all-gather of shard units (ms_unit_set_fp8_all_gather), as torchao's
 * float8 weights gather under FSDP2 with dynamic scaling (torchao 0.18,
 * torchao/float8/fsdp_utils.py: WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather calls
 * hp_tensor_to_float8_dynamic(shard, e4m3, reduce_amax=True, device_mesh=mesh), and
 * fsdp_post_all_gather wraps the gathered data with that scale in a Float8TrainingTensor of
 * the param dtype):
 *
 *   amax = max |shard| (0 for an empty shard), all-reduced MAX over the shard group, then
 *          over the replicate group for HSDP (the replicas hold the same shards);
 *   scale = amax_to_scale(amax, e4m3) (ms_fp8_scale), the same on every rank;
 *   data  = to_fp8_saturated(shard.to(f32) * scale) (ms_fp8_cast), all-gathered as bytes in
 *           the unit's u8 buffer (one byte an element);
 *   full  = data.to(gather dtype) / scale (ms_fp8_dequantize: to_original_precision).
 *
 * unit.c calls in at finalize (an fp8 parameter makes the unit a bytes unit and takes one
 * byte an element), in prepare_gather (it leaves the fp8 parameters to the op, and records
 * their amax all-reduces), in unshard (the op below) and in finish_unshard (the unpacking).
 */
#include "comm.h"
#include "unit_internal.h"

#include <stddef.h>
#include <string.h>

bool ms__unit_has_fp8(const ms_unit *u) {
    for (int i = 0; i < u->nparams; i++)
        if (u->params[i].fp8) return true;
    return false;
}

ms_status ms_unit_set_fp8_all_gather(ms_unit *u, int i, int enable) {
    MS_NOT_NULL(u);
    unit_param *p = NULL;
    ms_status st = check_state(u, "set_fp8_all_gather", ST(ST_BUILDING));
    if (!st) st = param_at(u, "set_fp8_all_gather", i, &p);
    if (st) return st;
    if (!enable) {
        p->fp8 = false;
        return ms__ok();
    }
    const char *L = unit_label(u);
    if (p->dtype != MS_F32 && p->dtype != MS_BF16)
        return ms__fail(MS_ERR_DTYPE, "unit '%s': set_fp8_all_gather: '%s' is stored in %s; f32 or bf16 was expected", L,
                        p->fqn, ms_dtype_name(p->dtype));
    /* the gather dtype by finalize's rule */
    const int pd = p->own_policy ? p->policy_param : u->policy_param;
    const ms_dtype g = pd >= 0 && pd != (int)p->dtype ? (ms_dtype)pd : p->dtype;
    if (g != MS_F32 && g != MS_BF16 && g != MS_F16)
        return ms__fail(MS_ERR_DTYPE, "unit '%s': set_fp8_all_gather: '%s' gathers in %s; f32, bf16 or f16 was expected", L,
                        p->fqn, ms_dtype_name(g));
    if (u->device >= 0)
        return ms__fail(MS_ERR_DEVICE, "unit '%s': set_fp8_all_gather: the unit's buffers are on cuda:%d; the fp8 all-gather "
                        "runs on cpu units only", L, u->device);
    if (u->k >= 2)
        return ms__fail(MS_ERR_ARG, "unit '%s': set_fp8_all_gather: the unit reshards %d-way after forward; the fp8 "
                        "all-gather takes reshard_after_forward true or false", L, u->k);
    p->fp8 = true;
    return ms__ok();
}

/* The op: each fp8 parameter's amax all-reduced and its shard cast into this rank's chunk,
 * then the unit's all_gather.  Runs on the rank's communication thread, like run_all_gather. */
ms_status ms__unit_fp8_all_gather(void *arg) {
    unit_op *op = arg;
    ms_unit *u = (ms_unit *)((char *)op - offsetof(ms_unit, op));
    const int64_t one = 1;
    ms_tensor *amax = NULL, *scale = NULL, *data = NULL;
    ms__coll_label = op->label;
    ms_status st = ms_tensor_new(&amax, 1, &one, MS_F32, MS_DEVICE_CPU, 0);
    if (!st) st = ms_tensor_new(&scale, 1, &one, MS_F32, MS_DEVICE_CPU, 0);
    for (int i = 0; !st && i < u->nparams; i++) {
        unit_param *p = &u->params[i];
        if (!p->fp8) continue;
        if (p->padded_numel) st = ms_fp8_amax(amax, p->padded, MS_FP8_TENSORWISE); /* padding rows are zero */
        else st = ms_tensor_fill(amax, 0.0);
        if (!st) st = ms_all_reduce(u->shard, amax, MS_OP_MAX);
        if (!st && u->replicate) st = ms_all_reduce(u->replicate, amax, MS_OP_MAX);
        if (!st) st = ms_fp8_scale(scale, amax, MS_F8E4M3, 0);
        if (st || !p->padded_numel) {
            if (!st) p->fp8_scale = *(const float *)ms_tensor_data(scale);
            continue;
        }
        p->fp8_scale = *(const float *)ms_tensor_data(scale);
        st = ms_tensor_new(&data, 1, &p->padded_numel, MS_F8E4M3, MS_DEVICE_CPU, 0);
        ms_tensor *line = NULL;
        if (!st) st = ms_tensor_view(&line, p->padded, 1, &p->padded_numel);
        if (!st) st = ms_fp8_cast(data, line, scale);
        if (!st)
            memcpy((unsigned char *)ms_tensor_data(u->flat) + u->rank * u->S + p->flat_offset, ms_tensor_data(data),
                   (size_t)p->padded_numel);
        ms_tensor_release(line);
        ms_tensor_release(data);
        data = NULL;
    }
    ms_tensor_release(amax);
    ms_tensor_release(scale);
    if (!st) st = ms_all_gather(op->comm, op->flat, op->slice);
    ms__coll_label = NULL;
    return st;
}

/* p->full (gather dtype) from every shard rank's fp8 block in u->flat: each block
 * dequantized with the parameter's scale, its real rows (torch.chunk's extents on the shard
 * dim) copied into place. */
ms_status ms__unit_fp8_unpack(ms_unit *u, unit_param *p) {
    ms_status st = buf_new(u, MS_BYTES_UNSHARDED, &p->full, p->ndim, p->shape, p->gather, false);
    if (st || !p->padded_numel) return st;
    const int64_t one = 1;
    ms_tensor *data = NULL, *hp = NULL, *scale = NULL;
    st = ms_tensor_new(&data, 1, &p->padded_numel, MS_F8E4M3, MS_DEVICE_CPU, 0);
    if (!st) st = ms_tensor_new(&hp, 1, &p->padded_numel, p->gather, MS_DEVICE_CPU, 0);
    if (!st) st = ms_tensor_new(&scale, 1, &one, MS_F32, MS_DEVICE_CPU, 0);
    if (!st) *(float *)ms_tensor_data(scale) = p->fp8_scale;
    for (int q = 0; !st && q < u->W; q++) {
        int64_t len, off;
        ms_chunk_extent(p->shape[p->dim], u->W, q, &len, &off);
        if (!len) continue;
        memcpy(ms_tensor_data(data), (const unsigned char *)ms_tensor_data(u->flat) + q * u->S + p->flat_offset,
               (size_t)p->padded_numel);
        st = ms_fp8_dequantize(hp, data, scale);
        ms_tensor *shaped = NULL, *rows = NULL, *region = NULL;
        if (!st) st = ms_tensor_view(&shaped, hp, p->ndim, p->padded_shape);
        if (!st) st = ms_tensor_narrow(&rows, shaped, p->dim, 0, len);
        if (!st) st = ms_tensor_narrow(&region, p->full, p->dim, off, len);
        if (!st) st = ms_tensor_copy(region, rows);
        ms_tensor_release(region);
        ms_tensor_release(rows);
        ms_tensor_release(shaped);
    }
    ms_tensor_release(data);
    ms_tensor_release(hp);
    ms_tensor_release(scale);
    return st;
}
