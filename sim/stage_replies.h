// stage_replies.h: what a stage server answers the router, without a model: the simulator's
// peers and the router core's test peers (tests/support/fake_swarm.h) both answer through it.
//
// Defines swarm::sim::Payloads (one sealed payload of zeros per tensor description, shared by
// every reply that carries one: the router checks descriptions, never values), StageBook (what
// a stage server knows: the job and stage it loaded, the tensors it holds for others, the
// forward graphs it keeps), Quirks (how a peer departs from the truth: misshapen outputs, false
// reports of bad inputs, a wrong parameter count), `to_fetch` and `fetch_error` (a request's
// references, and the ERROR when one cannot be fetched), `reply` (the answer to any router
// request, holding its tensors when asked to), `answer_fetch` (a FETCH from another peer) and
// `work_units` (the compute a request costs, in the router's units). No clock, no I/O: the
// caller decides when the answer leaves and what the work cost.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/flat_map.h"
#include "runtime/graph_cache.h"
#include "runtime/job_spec.h"
#include "runtime/messages.h"
#include "runtime/precision.h"

namespace swarm::sim {

// Sealed tensors of zeros, one per (dtype, shape, codec): a reply shares the cached payload
// (wire::share), so a thousand peers answering [B, T, d_model] activations hold one buffer. The
// bytes come from calloc and are never written: a large payload (a stage's state, a round's
// delta) is the kernel's zero pages until something writes it, which nothing here does.
class Payloads {
 public:
  wire::Tensor zeros(wire::DType dtype, const wire::Shape& shape, const compression::CodecSpec& codec);
  size_t size() const { return cache_.size(); }

 private:
  std::vector<wire::Tensor> cache_;   // a handful: looked up by description, oldest first
};

// What a stage server knows between requests.
struct StageBook {
  bool loaded = false;
  JobSpec spec;                  // the job of its last LOAD_STAGE
  uint64_t job = 0;
  int stage = -1;
  compression::CodecSpec act_codec, grad_codec;   // what its hops answer in (bound to the model for subspace)
  // Peer to peer: the tensors of the replies it was asked to hold, by request id, and the address
  // others fetch them from (a reference from elsewhere is not looked for among them; "": any).
  FlatMap<std::vector<wire::Tensor>> held;
  std::string listen;
  uint64_t held_bytes = 0;       // what `held` keeps [bytes]
  uint64_t released = 0;         // holdings dropped on RELEASE
  // Copies of what its training hops fetched or were pushed (their bytes, by key;
  // msg::Hop::keeps_copies), so a BACKWARD that comes back to the peer of the forward fetches
  // nothing; a RELEASE drops them, as the router sends once the stage's backward is done. Bounded
  // as stages/holdings.h bounds them: the oldest go once what it holds and its copies pass
  // hold_bytes (swarm-stage --hold-mb's default); their time to live (--cache-ttl-s) is not
  // modelled.
  FlatMap<uint64_t> copies;
  std::vector<uint64_t> copy_order;   // oldest first from copy_head; keys released since stay until they come up
  size_t copy_head = 0;
  uint64_t copy_bytes = 0;
  uint64_t hold_bytes = uint64_t(4096) << 20;
  // Tensors pushed here (PUSH to their holder): when each arrives, by key (the newest
  // 4 x cache_entries; one whose request went elsewhere is never used).
  FlatMap<double> incoming;
  std::vector<uint64_t> incoming_order;
  // The affinity cache: microbatches whose forward graph it keeps, and when each forward ran
  // (oldest first), under a stage server's rule (runtime/graph_cache.h) and size.
  FlatMap<bool> graphs;
  std::vector<std::pair<uint64_t, double>> graph_order;   // at most cache_entries
  size_t cache_entries = kGraphCacheEntries;   // sized at each LOAD_STAGE to what fits in `memory_bytes`
  GraphCacheRule graph_rule{cache_entries, kGraphCacheTtlS};
  // The peer's device, as its stage server would size its cache by it: free memory (-1: unknown,
  // the cache keeps kGraphCacheEntries), a GPU (scaled-dot-product attention), its own precision
  // where the job pins none.
  int64_t memory_bytes = -1;
  bool cuda = false;
  Precision precision = Precision::kFp32;
  // Its host holds the job's data (swarm-stage --data-root): loading the first or last stage of
  // a LOAD_STAGE with a data_hash, it samples its hops' tokens and targets (samples_tokens).
  bool has_data = false;
  bool samples_tokens = false;
};

// How a peer lies or breaks.
struct Quirks {
  wire::Shape wrong_shape;  // non-empty: its activations have this shape
  int bad_input_reports = 0;         // reports its next N stage inputs as bad (ERROR bad_tensor, tensor 0)
  int64_t params = -1;               // what it claims in STAGE_READY (-1: the truth)
  uint64_t hash = 7;                 // the state hash it reports
  double claim_factor = 1;           // reports compute_ms / claim_factor (> 1: claims to be faster)
};

// Compute units of a request, as stage servers count them (a forward is 1; a backward with its
// forward's graph cached 2, recomputing it 3; a forward with the loss and its backward 3).
double work_units(wire::MsgType t, bool cached);

// The references of `m` the server must fetch before it can act (those it neither holds nor
// keeps a copy of), and a fetched one kept as a copy.
std::vector<const wire::TensorRef*> to_fetch(const StageBook& b, const wire::Message& m);
void keep_copy(StageBook& b, uint64_t key, uint64_t bytes);
void drop_copy(StageBook& b, uint64_t key);

// kBusyLink: not in the window from a holder that sent the receiver tensors lately (ERROR
// unreachable with `reached`); the simulator's own peers never report it (a transfer under way
// is not cut off at the window there).
enum class FetchFailure { kUnreachable, kNotHeld, kBusyLink };
// The answer to `req` when reference slot `slot` (held at `from`) could not be fetched.
wire::Message fetch_error(const wire::Message& req, uint32_t slot, FetchFailure why, const std::string& from);

// A hop the router sent without its tokens or targets (Hop.own_tokens) made whole as a stage
// server makes it before fetching its references (msg::Hop::put_own; zeros stand in for the
// tokens), or the ERROR to answer when this peer holds no copy of the job's data.
std::optional<wire::Message> own_tokens(const StageBook& b, wire::Message& m, const msg::Hop& h, Payloads& pay);

// Whether a request of type `t` for microbatch `mb` is a BACKWARD that finds its forward's graph
// cached (a FORWARD keeps one, in `reply`): so the caller can time the work before it.
bool has_graph(const StageBook& b, wire::MsgType t, uint64_t mb);
bool has_graph(const StageBook& b, const wire::Message& m);   // reads its body

// The reply to a router request, or nullopt for a message without one (RELEASE, HEARTBEAT,
// WELCOME, BYE, CHAOS). `fetched`: bytes fetched peer to peer per request slot (empty: none).
// `compute_ms`: what the work took, reported in hop RESULTs. A request with `hold` keeps the
// reply's tensors in `b.held` and answers with references to them.
std::optional<wire::Message> reply(StageBook& b, const wire::Message& m, const std::vector<int64_t>& fetched, double compute_ms, double now,
                                   Quirks& q, Payloads& pay);

// A peer's FETCH {key, part}: FETCHED with the held tensor (shared), or ERROR not_held.
wire::Message answer_fetch(StageBook& b, const wire::Message& m);

}  // namespace swarm::sim
