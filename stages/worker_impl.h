// worker_impl.h: Worker::Impl, the state and the handlers of stages/worker.h, shared by the two
// files that define them: worker.cpp (loading a stage, the hops, the affinity cache, the inner
// steps) and worker_rounds.cpp (the within-stage round and the state transfers). Included only
// by those two.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "stages/worker.h"
#include "compression/codec.h"
#include "runtime/data.h"
#include "runtime/diloco.h"
#include "runtime/graph_cache.h"
#include "runtime/log.h"
#include "runtime/memory_estimate.h"
#include "runtime/timing.h"
#include "stages/attention.h"
#include "stages/device_codec.h"
#include "stages/device_info.h"
#include "stages/liar.h"
#include "stages/subspace.h"
#include "stages/model.h"
#include "stages/optim.h"
#include "stages/precision.h"
#include "stages/tensor_codec.h"
#include "stages/weight_versions.h"

namespace swarm {

using wire::Message;
using wire::MsgType;
using Clock = std::chrono::steady_clock;

namespace worker_detail {

// The largest |value| a stage input may hold (docs/security.md).
constexpr float kMaxActivationAbs = 1e5f;

// async weight prediction: a forward runs on the weights its gradient will be applied to plus
// this many more of the last update (a Nesterov-style look-ahead); what it bought is in
// docs/schedules.md.
constexpr double kPredictionLookAhead = 1.0;

inline double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// A request tensor that is bad (non-finite, out of range, the wrong shape): the router blames
// whoever made it, not this peer, once another peer agrees.
class BadTensor : public WireError {
 public:
  BadTensor(int index, const std::string& what) : WireError(WireErrc::kBadTensor, what), index(index) {}
  int index;
};

// A forward's autograd graph, kept so the BACKWARD of the same microbatch skips the recompute.
struct CacheEntry {
  uint64_t mb = 0;
  uint64_t input_checksum = 0;  // the backward must carry exactly the input this graph saw
  torch::Tensor input, output;
  Clock::time_point at;
  uint64_t version = 0;         // the weights the forward ran on (WeightVersions::version)
};

inline bool is_hop(MsgType t) {
  return t == MsgType::kForward || t == MsgType::kForwardLoss || t == MsgType::kBackward || t == MsgType::kEval || t == MsgType::kStep;
}

}  // namespace worker_detail

using worker_detail::BadTensor;
using worker_detail::CacheEntry;
using worker_detail::is_hop;
using worker_detail::kMaxActivationAbs;
using worker_detail::kPredictionLookAhead;
using worker_detail::ms_since;

struct Worker::Impl {
  Impl(const StageOptions& opt, SharedStats& stats, StageFaults& faults, const DeviceCaps& caps)
      : opt_(opt), stats_(stats), faults_(faults), caps_(caps) {}

  Message handle(Message& req, uint64_t seq);

  // Microseconds spent in codecs for the current request, per direction: the job's summary
  // reports them (activations encode/decode, activation gradients encode/decode).
  struct CodecTime {
    double act_enc = 0, act_dec = 0, grad_enc = 0, grad_dec = 0;
    bool any() const { return act_enc + act_dec + grad_enc + grad_dec > 0; }
  } codec_time_;

  template <typename F>
  auto timed(double& acc_us, F&& f) {
    const auto t0 = Clock::now();
    auto r = f();
    acc_us += std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    return r;
  }

  Message dispatch(Message& req);

  static double work_units(MsgType t, bool cached);

  // --emulate and an injected slow fault both stretch the compute time.
  void pad_for_emulation(Clock::time_point t0);

  // --- injected faults for the request at hand (stages/stage_faults.h) ---

  void begin_faults(const Message& req, uint64_t seq);

  // The after_compute check, once per request: when its first output is encoded, else at the end.
  void after_compute();

  // An output about to be encoded. Under a nan fault: all NaN and one +Inf, so that every codec
  // carries it (int8/int4 blocks holding NaN/Inf decode to NaN). The model itself is untouched.
  torch::Tensor emit(const torch::Tensor& t);

  bool has_output(MsgType t) const { return model_ && !(t == MsgType::kBackward && model_->is_first()); }

  // A transport-benchmark peer loads nothing (the I/O thread echoes its FORWARDs).
  Message echo(Message& req);

  void check_job(uint64_t job) const;

  Message load(Message& req);

  // How many graphs the affinity cache keeps for stage_ of `spec`: what fits in the memory free
  // now (capped by --memory-mb) by the stage's estimate, at most opt_.cache_entries. A graph not
  // kept costs its backward a recomputed forward; placement asks only that a peer hold the stage
  // with none kept (runtime/memory_estimate.h).
  size_t cache_entries_for(const JobSpec& spec, const torch::Device& dev);

  // One forward and backward at the job's microbatch shape: the peer's first throughput figure.
  // Timed on a second pass: the first, cold (allocations, first-touch pages, lazy kernel set-up),
  // read 89-91 ms per unit on the CPU where warm passes read 9-15 (`swarm bench sim`'s peers).
  double measure();

  // Request tensor `index` as the stage input; a bad one is the fault of whoever made it.
  torch::Tensor input_tensor(const wire::Tensor& t, int index);

  // The codecs of the hops. The subspace codec needs the job's basis and the token ids, so it
  // runs here (stages/subspace.h); every other codec runs where the tensor lives
  // (stages/device_codec.h). A subspace-coded input also sets ids_, its token ids.
  torch::Tensor decode_act(const wire::Tensor& t);
  torch::Tensor decode_grad(const wire::Tensor& t);
  wire::Tensor encode_act(const torch::Tensor& out);
  wire::Tensor encode_grad(const torch::Tensor& g);

  torch::Tensor targets_tensor(const wire::Tensor& t, const torch::Tensor& input);

  // The job's data from this host's disk, for the first or last stage: when --data-root holds
  // every file of it and its tokens are the router's (LoadStage.data_hash). Null otherwise (the
  // router then sends the tokens), and why is logged.
  std::shared_ptr<const TokenData> own_data(const JobSpec& spec, uint64_t want);

  void need_tensors(const Message& req, size_t n);

  Message result(const Message& req, const msg::Hop& h, msg::Result r);

  Message forward(Message& req, bool eval);

  // Keeps the forward's graph for its backward, as runtime/graph_cache.h decides (the oldest
  // stay, since their backwards come first).
  void remember(uint64_t mb, uint64_t checksum, torch::Tensor x, torch::Tensor out);

  Message forward_loss(Message& req);

  Message backward(Message& req);

  // Before the weights change in place other than by an inner step (a round, a state load).
  void before_weights_change() { versions_.before_change(*model_); }

  void drop_unused_snapshots();

  void publish_scale() { stats_.loss_scale = prec_.scaling() ? prec_.scale() : 0.0; }  // for heartbeats

  // Mixed precision after a backward: the stage-input gradient unscaled (zeros when this backward
  // overflowed) and, with loss scaling, `overflow` in the reply (stages/precision.h).
  torch::Tensor finish_backward(const torch::Tensor& x, msg::Result& r);

  // The job step (1-based) that training microbatch `mb` belongs to.
  int job_step_of(uint64_t mb) const { return int(mb / uint64_t(spec_.microbatches_per_step())) + 1; }

  // async: a backward of a later job step than the gradients held ends the held step: the peer
  // takes it (on the samples of it that it served) before this backward adds to the gradients.
  // A dense step is the round's to take.
  void before_backward(uint64_t mb);

  // After a backward's gradients were added. async: the router said no other backward of the
  // held step is left at this stage (`closes`): the step is taken once the reply is out
  // (after_reply), so that the step's gradients reach the next forwards sooner and the previous
  // stage does not wait for it. async_local: a peer steps on its own once it has
  // accumulated inner_batch samples. Neither in the warm start, whose steps are the round's.
  void accumulate(int64_t samples, uint64_t mb, bool closes);

  void after_reply();

  // `skip`: the router's instruction (another stage overflowed). An overflow here skips too.
  // Returns true when the step was skipped.
  bool take_step(bool skip = false);

  // STEP {skip?}: reply {steps, skipped, loss_scale?}.
  Message step(Message& req);

  // --- the within-stage round (DiLoCo outer step) ---

  std::vector<float> flatten();

  void load_flat(const std::vector<float>& flat);

  uint64_t state_hash() const;

  wire::Tensor flat_tensor(const std::vector<float>& v, const compression::CodecSpec& codec);

  // Request tensor `index`: a flat fp32 tensor of n values (default: the whole stage), decoded and all finite.
  std::vector<float> flat_from_wire(const wire::Tensor& t, int index, size_t n = 0);

  // The flat range of the round's fragment (all parameters when the job does not stream).
  std::pair<size_t, size_t> fragment(const msg::RoundRef& r) const;

  // The round's n values cut into `shards` contiguous parts (peer to peer, one owner each):
  // part j is [bounds[j], bounds[j + 1]).
  static std::vector<int64_t> part_bounds(size_t n, int shards);

  // ROUND_BEGIN. "delta" (DiLoCo): the outer gradient theta_g - theta over the fragment's range.
  // "grad" (sync every_step): the gradient sums since the last step. Both travel through the
  // outer codec; a lossy one keeps what it could not send (error feedback) for the next round.
  Message round_begin(Message& req);

  // ROUND_REDUCE: this peer reduces its group's round. "delta": the weighted mean
  // sum(w_i d_i) / sum(w_i); "grad": the sum. In fp32, in the order the router listed them,
  // encoded through the outer codec with this peer's error feedback for the group's mean.
  Message round_reduce(Message& req);

  // ROUND_APPLY. "delta": the group's mean outer gradient d for the fragment; theta_g and the
  // momentum take the outer step (diloco::outer_step: the same fp32 loop on every peer) and
  // the local weights become theta_g plus whatever this peer learned since it sent its delta
  // (nothing, unless the exchange overlapped inner steps). "grad": the group's gradient sum
  // over {samples}; one inner optimizer step with it, identical on every peer.
  Message round_apply(Message& req);

  // v through the outer codec, one tensor per part [bounds[j], bounds[j + 1]); a lossy codec
  // keeps what it could not send for the next call with the same key (error feedback).
  std::vector<wire::Tensor> outer_encode(const std::string& key, const std::vector<float>& v, const std::vector<int64_t>& bounds);

  // The accumulated gradient sums, flat (zeros where a parameter has none).
  std::vector<float> flat_grads();

  void set_grads(const std::vector<float>& flat);

  // STATE_REQUEST: theta_g and the outer momentum; with {full} also this peer's local weights
  // and AdamW moments (flat, named_parameters order) and its step count: a stage snapshot or
  // checkpoint.
  Message state_request(Message& req);

  // STATE_LOAD: tensors [theta_g, momentum] (a donor's) set theta = theta_g; with
  // [theta_g, momentum, theta, adam_m, adam_v] and {adam_step} (a snapshot or checkpoint) the
  // local weights and the optimizer continue exactly where they were. Every array is checked
  // (size, finite; second moments not negative) before anything is loaded.
  Message state_load(Message& req);

  void optimizer_flat(std::vector<float>* m, std::vector<float>* v, int64_t* step);

  void load_optimizer_flat(const std::vector<float>& m, const std::vector<float>& v, int64_t step);

  const StageOptions& opt_;
  SharedStats& stats_;
  StageFaults& faults_;
  StageFaults::Compute fault_;          // what the injected faults do to the request at hand
  MsgType fault_type_ = MsgType::kHeartbeat;
  uint64_t fault_seq_ = 0;
  bool fault_after_done_ = true;
  JobSpec spec_;
  uint64_t job_id_ = 0;
  int stage_ = -1;
  compression::CodecSpec act_codec_, grad_codec_, outer_codec_;
  std::unique_ptr<StageModel> model_;
  std::unique_ptr<AdamW> optim_;
  std::unique_ptr<Subspace> subspace_;  // the subspace codec's side of this stage, or null
  std::shared_ptr<const TokenData> data_;   // the job's data, when this stage samples its own tokens (own_data)
  torch::Tensor ids_;                   // token ids [B, T] of the request at hand (subspace codec)
  const DeviceCaps& caps_;  // what the device computes in (probed at start)
  StagePrecision prec_;
  std::vector<float> theta_g_, momentum_;  // the group's global weights and outer momentum (fp32, CPU)
  int64_t accum_samples_ = 0;              // samples in the gradients since the last inner step
  bool step_due_ = false;                   // async: the held step is to be taken after this reply
  // An inner step taken outside a hop (async: after the closing backward's reply; sync: a STEP)
  // [ms]: added to the next hop's compute_ms, so that the peer's measured speed, which placement
  // and dispatch read, counts its steps as async_local's (taken inside a backward) always did.
  double step_ms_unreported_ = 0;
  int held_step_ = 0;                      // the latest job step (1-based) whose microbatches this peer ran a backward of
  std::map<int, std::vector<float>> sent_;  // local weights of a fragment when its delta left
  std::unique_ptr<compression::ErrorFeedback> outer_ef_ = std::make_unique<compression::ErrorFeedback>();  // what a lossy outer codec has not sent yet
  std::list<CacheEntry> cache_;   // oldest first
  GraphCacheRule graph_rule_{opt_.cache_entries, opt_.cache_ttl_s};
  int64_t stale_samples_ = 0;  // sum over the held samples of the steps between their forward and now
  WeightVersions versions_;   // async: the weights each version's forwards ran on
};

}  // namespace swarm
