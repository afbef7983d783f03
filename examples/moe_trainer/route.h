/*
 * route.h: expert parallelism in moe_trainer (route.c): tokens to the experts' ranks and
 * back with all_to_all.
 */
#ifndef MOE_ROUTE_H
#define MOE_ROUTE_H

#include "trainer.h"

// Layer l's routed experts, forward: pairs out, experts run here on what arrives, back.
ms_status ep_forward(Trainer *tr, int l);
// Layer l's routed experts, backward: d output of each pair to the expert's rank, the
// expert gradients accumulated there, d input of each pair back.
ms_status ep_backward(Trainer *tr, int l);

#endif
