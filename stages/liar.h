// liar.h: the `lie` fault (docs/faults.md): a stage server that answers with plausible-looking
// lies, to test that the router and honest peers catch them (docs/security.md).
//
// Defines swarm::lie_about, which falsifies a reply the worker computed, by its type:
// (`on=` of a fault names the request: load_stage, forward, round_begin, round_apply, state_request)
//   STAGE_READY  a parameter count one too many (the router checks it against the job spec)
//   RESULT       the output tensor scaled up until its largest value is 1e7 (its receiver checks
//                their magnitude)
//   ROUND_DELTA  samples claimed 10^15 and the outer gradient times 1e6 (counted weights, clipping)
//   ROUND_DONE   a state hash that is not its own (the group's majority decides)
//   STATE_REPLY  negative AdamW second moments (the joiner checks them before loading)
// Tensor lies apply to fp32-coded tensors; others, and other types, pass unchanged. Torch-free.
#pragma once

#include "runtime/wire.h"

namespace swarm {

// Returns whether it changed anything.
bool lie_about(wire::Message& reply);

}  // namespace swarm
