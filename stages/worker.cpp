// worker.cpp: implements stages/worker.h: the stage's model, optimizer and round state, on the
// compute thread of a stage server.
#include "stages/worker.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <thread>

#ifdef SWARM_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "compression/codec.h"
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

namespace {

// The largest |value| a stage input may hold (docs/security.md).
constexpr float kMaxActivationAbs = 1e5f;

// async weight prediction: a forward runs on the weights its gradient will be applied to plus
// this many more of the last update (a Nesterov-style look-ahead); what it bought is in
// docs/schedules.md.
constexpr double kPredictionLookAhead = 1.0;

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

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

bool is_hop(MsgType t) {
  return t == MsgType::kForward || t == MsgType::kForwardLoss || t == MsgType::kBackward || t == MsgType::kEval || t == MsgType::kStep;
}

}  // namespace

struct Worker::Impl {
  Impl(const StageOptions& opt, SharedStats& stats, StageFaults& faults, const DeviceCaps& caps)
      : opt_(opt), stats_(stats), faults_(faults), caps_(caps) {}

  Message handle(Message& req, uint64_t seq) {
    begin_faults(req, seq);  // may crash or freeze here, before the clock starts
    const auto t0 = Clock::now();
    codec_time_ = CodecTime{};
    try {
      Message rep = dispatch(req);
      after_compute();
      if (rep.type == MsgType::kResult && is_hop(req.type)) {
        msg::Result r = msg::read<msg::Result>(rep);
        if (fault_.nan && r.loss) r.loss = std::numeric_limits<double>::quiet_NaN();
        if (codec_time_.any()) r.codec_us = std::vector<double>{codec_time_.act_enc, codec_time_.act_dec, codec_time_.grad_enc, codec_time_.grad_dec};
        const double units = work_units(req.type, r.cached.value_or(false));
        if (units > 0) {
          pad_for_emulation(t0);
          const double ms = ms_since(t0);
          r.compute_ms = ms;
          stats_.ms_per_unit = timing::ema(stats_.ms_per_unit.load(), ms / units);
          stats_.compute_s = stats_.compute_s.load() + ms / 1000;
        }
        rep.body = msg::pack(r);
      }
      if (fault_.lie && lie_about(rep)) log_warn("fault", std::string("lied in a ") + wire::msg_type_name(rep.type));
      return rep;
    } catch (const BadTensor& e) {
      stats_.errors++;
      Message err = msg::error_reply(&req, e.code(), e.what());
      msg::Error body = msg::read<msg::Error>(err);
      body.tensor = e.index;
      err.body = msg::pack(body);
      return err;
    } catch (const WireError& e) {
      stats_.errors++;
      return msg::error_reply(&req, e.code(), e.what());
    } catch (const InputError& e) {
      stats_.errors++;
      return msg::error_reply(&req, WireErrc::kBadTensor, e.what());
    } catch (const std::exception& e) {
      // A torch error on a tensor a peer sent us (shape mismatch, ...): the request is bad,
      // the process is fine.
      stats_.errors++;
      return msg::error_reply(&req, WireErrc::kBadTensor, std::string("compute failed: ") + e.what());
    }
  }

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

  Message dispatch(Message& req) {
    if (opt_.echo) return echo(req);
    if (req.type == MsgType::kLoadStage) return load(req);
    if (!model_) throw WireError(WireErrc::kOutOfOrder, std::string(wire::msg_type_name(req.type)) + " before LOAD_STAGE");
    switch (req.type) {
      case MsgType::kForward: return forward(req, /*eval=*/false);
      case MsgType::kEval: return forward(req, /*eval=*/true);
      case MsgType::kForwardLoss: return forward_loss(req);
      case MsgType::kBackward: return backward(req);
      case MsgType::kStep: return step(req);
      case MsgType::kRoundBegin: return round_begin(req);
      case MsgType::kRoundReduce: return round_reduce(req);
      case MsgType::kRoundApply: return round_apply(req);
      case MsgType::kStateRequest: return state_request(req);
      case MsgType::kStateLoad: return state_load(req);
      default:
        throw WireError(WireErrc::kOutOfOrder, std::string("a stage server does not take ") + wire::msg_type_name(req.type));
    }
  }

  static double work_units(MsgType t, bool cached) {
    switch (t) {
      case MsgType::kForward: case MsgType::kEval: return 1;
      case MsgType::kForwardLoss: return 3;
      case MsgType::kBackward: return cached ? 2 : 3;
      default: return 0;
    }
  }

  // --emulate and an injected slow fault both stretch the compute time.
  void pad_for_emulation(Clock::time_point t0) {
    const double factor = opt_.emulate * fault_.slow;
    if (factor <= 1.0) return;
    const double spent = ms_since(t0);
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(spent * (factor - 1.0)));
  }

  // --- injected faults for the request at hand (stages/stage_faults.h) ---

  void begin_faults(const Message& req, uint64_t seq) {
    fault_type_ = req.type;
    fault_seq_ = seq;
    fault_after_done_ = !faults_.armed();
    fault_ = faults_.before_compute(int(req.type), seq, has_output(req.type));
  }

  // The after_compute check, once per request: when its first output is encoded, else at the end.
  void after_compute() {
    if (fault_after_done_) return;
    fault_after_done_ = true;
    const StageFaults::Compute c = faults_.after_compute(int(fault_type_), fault_seq_, has_output(fault_type_));
    fault_.slow *= c.slow;
    fault_.nan = fault_.nan || c.nan;
    fault_.lie = fault_.lie || c.lie;
  }

  // An output about to be encoded. Under a nan fault: all NaN and one +Inf, so that every codec
  // carries it (int8/int4 blocks holding NaN/Inf decode to NaN). The model itself is untouched.
  torch::Tensor emit(const torch::Tensor& t) {
    after_compute();
    if (!fault_.nan) return t;
    torch::Tensor p = torch::full(t.sizes(), std::numeric_limits<float>::quiet_NaN(), t.options());
    if (p.numel() > 0) p.view(-1)[0].fill_(std::numeric_limits<float>::infinity());
    return p;
  }

  bool has_output(MsgType t) const { return model_ && !(t == MsgType::kBackward && model_->is_first()); }

  // A transport-benchmark peer loads nothing (the I/O thread echoes its FORWARDs).
  Message echo(Message& req) {
    if (req.type != MsgType::kLoadStage)
      throw WireError(WireErrc::kOutOfOrder, std::string("an echo peer answers LOAD_STAGE and FORWARD only, not ") + wire::msg_type_name(req.type));
    msg::StageReady r;
    r.echo = true;
    return msg::make(r, req.id, req.attempt);
  }

  void check_job(uint64_t job) const {
    if (job != job_id_) throw WireError(WireErrc::kOutOfOrder, "request for job " + std::to_string(job) + " but this peer serves job " + std::to_string(job_id_));
  }

  Message load(Message& req) {
    const msg::LoadStage b = msg::read<msg::LoadStage>(req);
    JobSpec spec = parse_job_spec(b.spec, /*check_files=*/false);
    if (b.stage >= spec.partition.stages) throw WireError(WireErrc::kMalformed, "stage " + std::to_string(b.stage) + " out of range");
    stats_.ready = false;
    cache_.clear();
    versions_.reset();
    spec_ = spec;
    job_id_ = b.job_id;
    stage_ = b.stage;
    act_codec_ = compression::parse_codec(spec.compression.activations);
    grad_codec_ = compression::parse_codec(spec.compression.gradients);
    outer_codec_ = compression::parse_codec(spec.compression.outer);
    torch::Device dev(opt_.device == "cuda" ? std::string("cuda:0") : opt_.device);
    // Precision (stages/precision.h): the job's pin, else --precision, resolved on this device.
    prec_ = StagePrecision(spec.model, opt_.precision, caps_);
    publish_scale();
    // The previous stage's model goes first: what is free now is what this stage may use.
    optim_.reset();
    model_.reset();
    graph_rule_ = GraphCacheRule(cache_entries_for(spec, dev), opt_.cache_ttl_s);
    model_ = std::make_unique<StageModel>(spec.model, stage_, spec.partition.stages, spec.first_layer(stage_),
                                          spec.partition.layers_per_stage[size_t(stage_)], spec.seed, dev, prec_.type());
    SWARM_CHECK(model_->num_parameters() == stage_parameter_counts(spec)[size_t(stage_)],
                "the stage model and stage_parameter_counts disagree on the stage's size");
    optim_ = std::make_unique<AdamW>(model_->named_parameters(), spec.optimizer, spec.steps);
    // The subspace codec's constraint holds from the first weights on, and every optimizer step
    // keeps it (stages/subspace.h).
    subspace_ = Subspace::for_stage(spec, stage_);
    if (subspace_) {
      subspace_->project_params(model_->named_parameters());
      optim_->set_constraint(subspace_.get());
    }
    theta_g_ = flatten();
    momentum_.assign(theta_g_.size(), 0.f);
    accum_samples_ = 0;
    stale_samples_ = 0;
    held_step_ = 0;
    sent_.clear();
    outer_ef_ = std::make_unique<compression::ErrorFeedback>();
    const double fwd_ms = measure();
    stats_.stage = stage_;
    stats_.job_id = job_id_;
    stats_.ready = true;
    set_log_job(job_id_);   // this process's log lines are about this job from now on
    log_info("stage", "loaded stage " + std::to_string(stage_) + " of job " + std::to_string(job_id_) + ": " +
                          std::to_string(model_->num_parameters()) + " parameters, " + std::to_string(fwd_ms) + " ms per forward; " +
                          prec_.reason() + ", " + attention_name(model_->attention()) + " attention; memory estimate " +
                          estimate_stage_memory(spec, stage_, prec_.precision(), dev.is_cuda() && sdpa_available(), dev.is_cuda())
                              .describe(dev.is_cuda()));
    msg::StageReady r;
    r.job_id = job_id_;
    r.stage = stage_;
    r.params = model_->num_parameters();
    r.fwd_ms = fwd_ms;
    r.hash = state_hash();
    r.precision = precision_name(prec_.precision());
    return msg::make(r, req.id, req.attempt);
  }

  // How many graphs the affinity cache keeps for stage_ of `spec`: what fits in the memory free
  // now (capped by --memory-mb) by the stage's estimate, at most opt_.cache_entries. A graph not
  // kept costs its backward a recomputed forward; placement asks only that a peer hold the stage
  // with none kept (runtime/memory_estimate.h).
  size_t cache_entries_for(const JobSpec& spec, const torch::Device& dev) {
#ifdef SWARM_CUDA
    // What the previous stage's tensors left in libtorch's caching allocator is free for this one.
    if (dev.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
    const int64_t free_b = usable_bytes(query_device(opt_.device), opt_.memory_limit_bytes);
    const bool cuda = dev.is_cuda(), flash = cuda && sdpa_available();
    const size_t entries = graph_cache_entries(spec, stage_, prec_.precision(), flash, cuda, free_b, opt_.cache_entries);
    stats_.cache_entries = int64_t(entries);
    if (free_b < 0) return entries;
    if (cache_entries_that_fit(spec, stage_, prec_.precision(), flash, cuda, free_b) < 0)
      log_warn("stage", "stage " + std::to_string(stage_) + " needs more than the " + human_bytes(free_b) +
                            " this peer has free even with no graph cached: loading it anyway, every backward recomputes its forward");
    else if (entries < opt_.cache_entries)
      log_info("stage", "affinity cache: " + std::to_string(entries) + " graph(s), what fits in the " + human_bytes(free_b) +
                            " free (at most " + std::to_string(opt_.cache_entries) + ")");
    return entries;
  }

  // One forward and backward at the job's microbatch shape: the peer's first throughput figure.
  // Timed on a second pass: the first, cold (allocations, first-touch pages, lazy kernel set-up),
  // read 89-91 ms per unit on the CPU where warm passes read 9-15 (`swarm bench sim`'s peers).
  double measure() {
    const int B = spec_.batch.microbatch_size, T = spec_.model.seq_len;
    torch::Tensor in = model_->is_first()
                           ? torch::zeros({B, T}, torch::kInt64).to(model_->device())
                           : torch::zeros({B, T, spec_.model.d_model}).to(model_->device()).requires_grad_(true);
    model_->forward(in).sum().backward();
    optim_->zero_grad();
    const auto t0 = Clock::now();
    torch::Tensor out = model_->forward(in);
    const double fwd = ms_since(t0);
    out.sum().backward();
    optim_->zero_grad();
    const double ms = ms_since(t0) * opt_.emulate;
    stats_.ms_per_unit = ms / 3.0;
    return fwd * opt_.emulate;
  }

  // Request tensor `index` as the stage input; a bad one is the fault of whoever made it.
  torch::Tensor input_tensor(const wire::Tensor& t, int index) {
    try {
      if (model_->is_first()) {
        if (t.desc.dtype == wire::DType::kF32) throw BadTensor(index, "stage 0 takes token ids, not floats");
        torch::Tensor x = from_wire(t, 2);
        if (x.size(1) > spec_.model.max_seq_len) throw BadTensor(index, "sequence longer than the model's maximum");
        if (x.numel() && (x.min().item<int64_t>() < 0 || x.max().item<int64_t>() >= spec_.model.vocab_size))
          throw BadTensor(index, "token id outside the vocabulary");
        ids_ = x;  // the subspace codec sends them on with this stage's output
        return x.to(model_->device());
      }
      torch::Tensor a = timed(codec_time_.act_dec, [&] { return decode_act(t); });
      // Finite and within bounds: an honest stage's output is a LayerNorm'd residual stream,
      // orders of magnitude below kMaxActivationAbs; a liar's outsized values would blow up
      // every stage after it.
      const float amax = a.numel() ? a.abs().max().item<float>() : 0.f;
      if (!std::isfinite(amax)) throw BadTensor(index, "non-finite values in the stage input");
      if (amax > kMaxActivationAbs)
        throw BadTensor(index, "stage input values up to " + std::to_string(amax) + ", over the bound " + std::to_string(kMaxActivationAbs));
      return a;
    } catch (const BadTensor&) {
      throw;
    } catch (const WireError& e) {
      throw BadTensor(index, e.what());
    }
  }

  // The codecs of the hops. The subspace codec needs the job's basis and the token ids, so it
  // runs here (stages/subspace.h); every other codec runs where the tensor lives
  // (stages/device_codec.h). A subspace-coded input also sets ids_, its token ids.
  torch::Tensor decode_act(const wire::Tensor& t) {
    if (t.desc.codec.codec != compression::Codec::kSubspace) {
      ids_ = torch::Tensor();  // no ids came with it
      return decode_input(t, 3, spec_.model.d_model, model_->device());
    }
    if (!subspace_) throw WireError(WireErrc::kBadTensor, "a subspace-coded activation, but this job does not use the subspace codec");
    return subspace_->decode_activation(t, &ids_).to(model_->device());
  }
  torch::Tensor decode_grad(const wire::Tensor& t) {
    if (t.desc.codec.codec != compression::Codec::kSubspace) return decode_input(t, 3, spec_.model.d_model, model_->device());
    if (!subspace_) throw WireError(WireErrc::kBadTensor, "a subspace-coded gradient, but this job does not use the subspace codec");
    return subspace_->decode_gradient(t).to(model_->device());
  }
  wire::Tensor encode_act(const torch::Tensor& out) {
    if (subspace_ && subspace_->codes_activations()) {
      if (!ids_.defined()) throw WireError(WireErrc::kBadTensor, "the stage input carried no token ids, which the subspace codec needs");
      return subspace_->encode_activation(out, ids_);
    }
    return encode_output(out, act_codec_);
  }
  wire::Tensor encode_grad(const torch::Tensor& g) {
    if (subspace_ && subspace_->codes_gradients()) return subspace_->encode_gradient(g);
    return encode_output(g, grad_codec_);
  }

  torch::Tensor targets_tensor(const wire::Tensor& t, const torch::Tensor& input) {
    torch::Tensor y;
    try {
      y = from_wire(t, 2);
    } catch (const WireError& e) {
      throw BadTensor(1, e.what());
    }
    if (y.size(0) != input.size(0) || y.size(1) != input.size(1)) throw BadTensor(1, "targets do not match the input's [B, T]");
    if (y.numel() && (y.min().item<int64_t>() < 0 || y.max().item<int64_t>() >= spec_.model.vocab_size))
      throw BadTensor(1, "target id outside the vocabulary");
    return y.to(model_->device());
  }

  void need_tensors(const Message& req, size_t n) {
    if (req.tensors.size() != n)
      throw WireError(WireErrc::kMalformed, std::string(wire::msg_type_name(req.type)) + " carries " + std::to_string(n) + " tensor(s), got " + std::to_string(req.tensors.size()));
  }

  Message result(const Message& req, const msg::Hop& h, msg::Result r) {
    r.mb = h.mb;
    r.stage = stage_;
    return msg::make(r, req.id, req.attempt);
  }

  Message forward(Message& req, bool eval) {
    const msg::Hop h = msg::read<msg::Hop>(req);
    check_job(h.job_id);
    const bool last = model_->is_last();
    need_tensors(req, eval && last ? 2 : 1);
    torch::Tensor x = input_tensor(req.tensors[0], 0);
    if (eval) {
      torch::NoGradGuard ng;
      torch::Tensor out = model_->forward(x);
      if (last) {
        torch::Tensor y = targets_tensor(req.tensors[1], x);
        msg::Result r;
        r.loss = StageModel::loss(out, y).item<double>();
        return result(req, h, r);
      }
      Message rep = result(req, h, msg::Result{});
      rep.tensors.push_back(timed(codec_time_.act_enc, [&] { return encode_act(emit(out)); }));
      return rep;
    }
    if (last) throw WireError(WireErrc::kOutOfOrder, "the last stage takes FORWARD_LOSS, not FORWARD");
    stats_.forwards++;
    if (!model_->is_first()) x.requires_grad_(true);
    torch::Tensor out;
    {
      // async: on the snapshot of this version's weights, which no step writes into, so the
      // graph stays the gradient of what the next stage receives (stages/weight_versions.h).
      SetAside own(*model_);
      if (spec_.schedule == Schedule::kAsync) own.swap_in(versions_.current(*model_));
      out = model_->forward(x);
    }
    Message rep = result(req, h, msg::Result{});
    rep.tensors.push_back(timed(codec_time_.act_enc, [&] { return encode_act(emit(out)); }));
    remember(h.mb, req.tensors[0].desc.checksum, x, out);
    return rep;
  }

  // Keeps the forward's graph for its backward, as runtime/graph_cache.h decides (the oldest
  // stay, since their backwards come first).
  void remember(uint64_t mb, uint64_t checksum, torch::Tensor x, torch::Tensor out) {
    const auto now = Clock::now();
    auto age = [&](const CacheEntry& e) { return std::chrono::duration<double>(now - e.at).count(); };
    for (auto it = cache_.begin(); it != cache_.end();) {
      if (it->mb == mb || graph_rule_.expired(age(*it))) it = cache_.erase(it);
      else ++it;
    }
    switch (graph_rule_.admit(cache_.size(), cache_.empty() ? 0.0 : age(cache_.front()))) {
      case GraphCacheRule::Admit::kSkip: drop_unused_snapshots(); return;
      case GraphCacheRule::Admit::kEvictOldest: cache_.pop_front(); break;
      case GraphCacheRule::Admit::kKeep: break;
    }
    cache_.push_back(CacheEntry{mb, checksum, std::move(x), std::move(out), now, versions_.version()});
    drop_unused_snapshots();
  }

  Message forward_loss(Message& req) {
    const msg::Hop h = msg::read<msg::Hop>(req);
    check_job(h.job_id);
    if (!model_->is_last()) throw WireError(WireErrc::kOutOfOrder, "FORWARD_LOSS goes to the last stage");
    need_tensors(req, 2);
    torch::Tensor x = input_tensor(req.tensors[0], 0);
    torch::Tensor y = targets_tensor(req.tensors[1], x);
    const int64_t samples = x.size(0);
    before_backward(h.mb);
    if (!model_->is_first()) x.requires_grad_(true);
    torch::Tensor loss = StageModel::loss(model_->forward(x), y);
    prec_.backward(loss, torch::full({}, double(samples), loss.options()), fault_.overflow);  // (loss x samples x scale).backward()
    stats_.backwards++;
    msg::Result r;
    r.loss = loss.item<double>();
    r.samples = samples;
    const torch::Tensor gx = finish_backward(x, r);
    Message rep = result(req, h, r);
    if (!model_->is_first()) rep.tensors.push_back(timed(codec_time_.grad_enc, [&] { return encode_grad(emit(gx)); }));
    accumulate(samples, h.mb, h.closes_step.value_or(false) && !h.eval);
    return rep;
  }

  Message backward(Message& req) {
    const msg::Hop h = msg::read<msg::Hop>(req);
    check_job(h.job_id);
    if (model_->is_last()) throw WireError(WireErrc::kOutOfOrder, "the last stage runs its backward inside FORWARD_LOSS");
    need_tensors(req, 2);
    torch::Tensor g;
    try {
      g = timed(codec_time_.grad_dec, [&] { return decode_grad(req.tensors[1]); });
    } catch (const WireError& e) {
      throw BadTensor(1, e.what());
    }
    if (!torch::isfinite(g).all().item<bool>()) throw BadTensor(1, "non-finite values in the output gradient");
    before_backward(h.mb);
    torch::Tensor x, out;
    bool cached = false;
    SetAside own(*model_);
    for (auto it = cache_.begin(); it != cache_.end(); ++it) {
      if (it->mb == h.mb && it->input_checksum == req.tensors[0].desc.checksum) {
        const std::vector<torch::Tensor>* snap = versions_.kept(it->version);
        if (spec_.schedule != Schedule::kAsync || snap) {
          // async: the weights the forward ran on go back in for the backward (a pointer swap);
          // the gradient adds to the current step, this many versions late.
          if (snap) own.swap_in(*snap);
          x = it->input;
          out = it->output;
          cached = true;
          graph_rule_.used(std::chrono::duration<double>(Clock::now() - it->at).count());
          stale_samples_ += int64_t(versions_.version() - it->version) * x.size(0);
        }
        cache_.erase(it);
        break;
      }
    }
    if (!cached && !out.defined()) {
      x = input_tensor(req.tensors[0], 0);
      if (!model_->is_first()) x.requires_grad_(true);
      out = model_->forward(x);
      stats_.recomputes++;
    } else if (cached) {
      stats_.cache_hits++;
    }
    if (g.sizes() != out.sizes()) throw BadTensor(1, "output gradient shape does not match the stage output");
    prec_.backward(out, g, fault_.overflow);  // out.backward(g x scale)
    stats_.backwards++;
    const int64_t samples = x.size(0);
    msg::Result r;
    r.cached = cached;
    r.samples = samples;
    const torch::Tensor gx = finish_backward(x, r);
    own.put_back();
    drop_unused_snapshots();
    Message rep = result(req, h, r);
    if (!model_->is_first()) rep.tensors.push_back(timed(codec_time_.grad_enc, [&] { return encode_grad(emit(gx)); }));
    accumulate(samples, h.mb, h.closes_step.value_or(false) && !h.eval);
    return rep;
  }

  // Before the weights change in place other than by an inner step (a round, a state load).
  void before_weights_change() { versions_.before_change(*model_); }

  void drop_unused_snapshots() {
    versions_.drop_unused([this](uint64_t v) {
      for (const CacheEntry& e : cache_)
        if (e.version == v) return true;
      return false;
    });
  }

  void publish_scale() { stats_.loss_scale = prec_.scaling() ? prec_.scale() : 0.0; }  // for heartbeats

  // Mixed precision after a backward: the stage-input gradient unscaled (zeros when this backward
  // overflowed) and, with loss scaling, `overflow` in the reply (stages/precision.h).
  torch::Tensor finish_backward(const torch::Tensor& x, msg::Result& r) {
    bool overflow = false;
    torch::Tensor gx = prec_.finish(model_->is_first() ? torch::Tensor() : x.grad(), model_->parameters(), &overflow);
    if (prec_.scaling()) r.overflow = overflow;
    if (overflow) stats_.overflows++;
    return gx;
  }

  // The job step (1-based) that training microbatch `mb` belongs to.
  int job_step_of(uint64_t mb) const { return int(mb / uint64_t(spec_.microbatches_per_step())) + 1; }

  // async: a backward of a later job step than the gradients held ends the held step: the peer
  // takes it (on the samples of it that it served) before this backward adds to the gradients.
  // A dense step is the round's to take.
  void before_backward(uint64_t mb) {
    if (spec_.schedule != Schedule::kAsync || accum_samples_ == 0) return;
    if (job_step_of(mb) > held_step_ && !dense_step(spec_, held_step_)) take_step();
  }

  // After a backward's gradients were added. async: the router said no other backward of the
  // held step is left at this stage (`closes`): the step is taken once the reply is out
  // (after_reply), so that the step's gradients reach the next forwards sooner and the previous
  // stage does not wait for it. async_local: a peer steps on its own once it has
  // accumulated inner_batch samples. Neither in the warm start, whose steps are the round's.
  void accumulate(int64_t samples, uint64_t mb, bool closes) {
    accum_samples_ += samples;
    held_step_ = std::max(held_step_, job_step_of(mb));
    if (dense_step(spec_, held_step_)) return;
    const int inner = spec_.batch.inner_batch > 0 ? spec_.batch.inner_batch : spec_.batch.batch_size;
    if (spec_.schedule == Schedule::kAsyncLocal && accum_samples_ >= inner) take_step();
    if (spec_.schedule == Schedule::kAsync && closes && job_step_of(mb) == held_step_) step_due_ = true;
  }

  void after_reply() {
    if (!step_due_) return;
    try {
      take_step();
    } catch (const std::exception& e) {
      // No reply to carry it: the next backward's step, or the barrier's STEP, tries again.
      log_warn("stage", std::string("the step a closing backward ended failed: ") + e.what());
    }
  }

  // `skip`: the router's instruction (another stage overflowed). An overflow here skips too.
  // Returns true when the step was skipped.
  bool take_step(bool skip = false) {
    step_due_ = false;
    if (accum_samples_ == 0 && !prec_.overflow_pending()) return false;
    const double scale = prec_.scale();
    const bool skipped = prec_.skip_step(skip);
    publish_scale();
    if (skipped) {
      optim_->zero_grad();
      accum_samples_ = 0;
      stale_samples_ = 0;
      stats_.skipped_steps++;
      log_info("stage", std::string("skipped an optimizer step: ") + (skip ? "the router said so" : "the gradients overflowed") +
                            "; loss scale " + std::to_string(prec_.scale()));
      return true;
    }
    // async: the learning rate of the job step the gradients belong to, whatever number of steps
    // this peer took (it serves a share of the microbatches; it may have joined late).
    const int64_t lr_step = spec_.schedule == Schedule::kAsync ? int64_t(held_step_) - 1 : -1;
    // Staleness-aware (PipeMare): divided by 1 + the mean number of this peer's steps between a
    // sample's forward and this step, as measured on the affinity cache.
    const bool async = spec_.schedule == Schedule::kAsync;
    const double mean_stale = double(stale_samples_) / double(accum_samples_);
    const double lr_factor = async ? 1.0 / (1.0 + mean_stale) : 1.0;
    // async: the update this step makes, and how late its samples were, predict the weights of
    // the next version's forwards (WeightVersions::current; the last stage runs each backward at
    // once): as many updates on as the gradients will be applied late, plus one look-ahead update
    // (docs/schedules.md, "Weight versions and prediction").
    versions_.before_change(*model_, async && !model_->is_last(), mean_stale + kPredictionLookAhead);
    const double norm = optim_->step(accum_samples_, scale, lr_step, lr_factor);
    versions_.after_step(*model_);
    drop_unused_snapshots();
    stale_samples_ = 0;
    log_debug("stage", "inner step " + std::to_string(optim_->steps_taken()) + " on " + std::to_string(accum_samples_) +
                           " samples, gradient norm " + std::to_string(norm));
    accum_samples_ = 0;
    stale_samples_ = 0;
    stats_.steps++;
    return false;
  }

  // STEP {skip?}: reply {steps, skipped, loss_scale?}.
  Message step(Message& req) {
    const msg::Step b = msg::read<msg::Step>(req);
    check_job(b.job_id);
    msg::Result r;
    r.skipped = take_step(b.skip);
    r.stage = stage_;
    r.steps = optim_->steps_taken();
    if (prec_.scaling()) r.loss_scale = prec_.scale();
    return msg::make(r, req.id, req.attempt);
  }

  // --- the within-stage round (DiLoCo outer step) ---

  std::vector<float> flatten() {
    std::vector<float> flat;
    flat.reserve(size_t(model_->num_parameters()));
    for (const auto& [name, p] : model_->named_parameters()) {
      torch::Tensor c = p.detach().to(torch::kCPU).to(torch::kFloat32).contiguous();
      flat.insert(flat.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
    }
    return flat;
  }

  void load_flat(const std::vector<float>& flat) {
    torch::NoGradGuard ng;
    size_t off = 0;
    for (const auto& [name, p] : model_->named_parameters()) {
      const int64_t n = p.numel();
      torch::Tensor src = torch::from_blob(const_cast<float*>(flat.data() + off), p.sizes(), torch::kFloat32);
      // .data(): its own version counter. Under async a round or a state load may land while
      // graphs the affinity cache keeps still hold this parameter; it ran on a weight version,
      // and its backward must not see the load as an in-place change (detach() would bump it).
      p.data().copy_(src.to(p.device()));
      off += size_t(n);
    }
    SWARM_CHECK(off == flat.size(), "flat parameter vector size");
  }

  uint64_t state_hash() const {
    const uint64_t a = wire::checksum(theta_g_.data(), theta_g_.size() * sizeof(float));
    const uint64_t b = wire::checksum(momentum_.data(), momentum_.size() * sizeof(float));
    return a ^ (b * 0x9E3779B97F4A7C15ull);
  }

  wire::Tensor flat_tensor(const std::vector<float>& v, const compression::CodecSpec& codec) {
    torch::Tensor t = torch::from_blob(const_cast<float*>(v.data()), {int64_t(v.size())}, torch::kFloat32);
    return to_wire(t, codec);
  }

  // Request tensor `index`: a flat fp32 tensor of n values (default: the whole stage), decoded and all finite.
  std::vector<float> flat_from_wire(const wire::Tensor& t, int index, size_t n = 0) {
    if (n == 0) n = theta_g_.size();
    if (t.desc.dtype != wire::DType::kF32 || t.desc.shape.size() != 1 || t.desc.numel() != int64_t(n))
      throw BadTensor(index, "flat parameter tensor of the wrong size for this stage (" + std::to_string(n) + " values expected)");
    std::vector<float> v(n);
    try {
      compression::decode(t.desc.codec, static_cast<const uint8_t*>(t.data.data()), t.data.size(), int64_t(v.size()), v.data());
    } catch (const CodecError& e) {
      throw BadTensor(index, e.what());
    }
    for (float f : v)
      if (!std::isfinite(f)) throw BadTensor(index, "non-finite values in a parameter tensor");
    return v;
  }

  // The flat range of the round's fragment (all parameters when the job does not stream).
  std::pair<size_t, size_t> fragment(const msg::RoundRef& r) const {
    if (r.fragment >= r.fragments) throw WireError(WireErrc::kMalformed, "fragment " + std::to_string(r.fragment) + " of " + std::to_string(r.fragments));
    if (r.shard >= r.shards) throw WireError(WireErrc::kMalformed, "part " + std::to_string(r.shard) + " of " + std::to_string(r.shards));
    return diloco::fragment_range(theta_g_.size(), r.fragments, r.fragment);
  }

  // The round's n values cut into `shards` contiguous parts (peer to peer, one owner each):
  // part j is [bounds[j], bounds[j + 1]).
  static std::vector<int64_t> part_bounds(size_t n, int shards) {
    std::vector<int64_t> b;
    for (int j = 0; j < shards; ++j) b.push_back(int64_t(diloco::fragment_range(n, shards, j).first));
    b.push_back(int64_t(n));
    return b;
  }

  // ROUND_BEGIN. "delta" (DiLoCo): the outer gradient theta_g - theta over the fragment's range.
  // "grad" (sync every_step): the gradient sums since the last step. Both travel through the
  // outer codec; a lossy one keeps what it could not send (error feedback) for the next round.
  Message round_begin(Message& req) {
    const msg::RoundBegin b = msg::read<msg::RoundBegin>(req);
    check_job(b.job_id);
    // async, a round alongside training: the gradients held for a job step the round covers
    // (no more backwards of it are coming) go into the weights the delta is taken from, as the
    // STEP of a barrier would have put them.
    if (b.step && spec_.schedule == Schedule::kAsync && accum_samples_ > 0 && uint64_t(held_step_) <= *b.step &&
        !dense_step(spec_, held_step_))
      take_step();
    const auto [lo, hi] = fragment(b);
    std::vector<float> v;
    msg::RoundDelta d;
    d.round = b.round;
    d.stage = stage_;
    d.what = b.what;
    if (b.what == msg::RoundWhat::kGrad) {
      v = flat_grads();
      d.samples = accum_samples_;
      if (prec_.scaling()) {  // unscaled; an overflowed peer contributes nothing this step
        const float inv = float(1.0 / prec_.scale());  // a power of two: exact
        if (prec_.skip_step(false)) {
          std::fill(v.begin(), v.end(), 0.f);
          d.samples = 0;
        } else {
          for (float& x : v) x *= inv;
        }
        publish_scale();
      }
    } else {
      const std::vector<float> theta = flatten();
      v.resize(hi - lo);
      for (size_t i = lo; i < hi; ++i) v[i - lo] = theta_g_[i] - theta[i];
      sent_[b.fragment].assign(theta.begin() + long(lo), theta.begin() + long(hi));
    }
    Message rep = msg::make(d, req.id, req.attempt);
    // One tensor per part; the residual of a lossy codec spans the whole, whatever the cut.
    rep.tensors = outer_encode(std::string(msg::round_what_name(b.what)) + ":" + std::to_string(b.fragment), v,
                               part_bounds(v.size(), b.shards));
    return rep;
  }

  // ROUND_REDUCE: this peer reduces its group's round. "delta": the weighted mean
  // sum(w_i d_i) / sum(w_i); "grad": the sum. In fp32, in the order the router listed them,
  // encoded through the outer codec with this peer's error feedback for the group's mean.
  Message round_reduce(Message& req) {
    const msg::RoundReduce b = msg::read<msg::RoundReduce>(req);
    check_job(b.job_id);
    if (req.tensors.empty() || b.weights.size() != req.tensors.size())
      throw WireError(WireErrc::kMalformed, "ROUND_REDUCE carries one weight per tensor (" + std::to_string(b.weights.size()) +
                                                " weights, " + std::to_string(req.tensors.size()) + " tensors)");
    const auto [lo, hi] = fragment(b);
    // This reducer's part of the round's values (all of them unless the round is cut in parts).
    const std::vector<int64_t> bounds = part_bounds(b.what == msg::RoundWhat::kGrad ? theta_g_.size() : hi - lo, b.shards);
    const size_t n = size_t(bounds[size_t(b.shard) + 1] - bounds[size_t(b.shard)]);
    std::vector<std::vector<float>> ds;
    for (size_t k = 0; k < req.tensors.size(); ++k) ds.push_back(flat_from_wire(req.tensors[k], int(k), n));
    // No contribution steers the round: one over diloco::kOutlierFactor times the group's (lower)
    // median, or not finite, is left out of the sum and reported. In a "grad" round the weights
    // are the samples the router counted, for the outlier test only: the sum is plain.
    const bool grad = b.what == msg::RoundWhat::kGrad;
    const diloco::Outliers found = diloco::outliers(ds, b.weights, grad);
    const std::vector<size_t>& out = found.left_out;
    std::vector<float> sum;
    double total = 0;
    for (size_t k = 0; k < ds.size(); ++k) {
      if (std::find(out.begin(), out.end(), k) != out.end()) continue;
      diloco::accumulate(sum, ds[k].data(), n, grad ? 1.f : float(b.weights[k]));
      total += b.weights[k];
    }
    if (b.what == msg::RoundWhat::kDelta) {
      if (!(total > 0)) throw WireError(WireErrc::kMalformed, "ROUND_REDUCE weights sum to zero");
      const float inv = float(1.0 / total);
      for (float& v : sum) v *= inv;
    }
    msg::RoundReduced r;
    r.round = b.round;
    r.stage = stage_;
    r.outliers.assign(out.begin(), out.end());
    r.far.assign(found.far.begin(), found.far.end());
    Message rep = msg::make(r, req.id, req.attempt);
    std::string key = std::string("mean:") + msg::round_what_name(b.what) + ":" + std::to_string(b.fragment);
    if (b.shards > 1) key += ":" + std::to_string(bounds[size_t(b.shard)]) + "-" + std::to_string(bounds[size_t(b.shard) + 1]);
    rep.tensors = outer_encode(key, sum, {0, int64_t(sum.size())});
    return rep;
  }

  // ROUND_APPLY. "delta": the group's mean outer gradient d for the fragment; theta_g and the
  // momentum take the outer step (diloco::outer_step: the same fp32 loop on every peer) and
  // the local weights become theta_g plus whatever this peer learned since it sent its delta
  // (nothing, unless the exchange overlapped inner steps). "grad": the group's gradient sum
  // over {samples}; one inner optimizer step with it, identical on every peer.
  Message round_apply(Message& req) {
    const msg::RoundApply b = msg::read<msg::RoundApply>(req);
    check_job(b.job_id);
    need_tensors(req, size_t(b.shards));
    const auto [lo, hi] = fragment(b);
    // The group's result, from its parts (one tensor each, in order).
    auto whole = [&](size_t n) {
      const std::vector<int64_t> bounds = part_bounds(n, b.shards);
      std::vector<float> v;
      v.reserve(n);
      for (size_t j = 0; j < req.tensors.size(); ++j) {
        const std::vector<float> part = flat_from_wire(req.tensors[j], int(j), size_t(bounds[j + 1] - bounds[j]));
        v.insert(v.end(), part.begin(), part.end());
      }
      return v;
    };
    if (b.what == msg::RoundWhat::kGrad) {
      const std::vector<float> g = whole(theta_g_.size());
      set_grads(g);
      before_weights_change();
      if (b.samples > 0) optim_->step(b.samples);
      optim_->zero_grad();
      accum_samples_ = 0;
      stale_samples_ = 0;
      stats_.steps++;
      theta_g_ = flatten();
    } else {
      const std::vector<float> d = whole(hi - lo);
      diloco::outer_step(theta_g_.data() + lo, momentum_.data() + lo, d.data(), hi - lo, float(spec_.diloco.outer_lr),
                         float(spec_.diloco.outer_momentum), spec_.diloco.nesterov);
      // A lossy outer codec moves theta_g off the subspace codec's constraint; the same
      // deterministic projection on every peer puts it back, bit for bit.
      if (subspace_) subspace_->project_flat(model_->named_parameters(), theta_g_);
      std::vector<float> theta = flatten();
      auto sent = sent_.find(b.fragment);
      for (size_t i = lo; i < hi; ++i) {
        const float progress = sent != sent_.end() ? theta[i] - sent->second[i - lo] : 0.f;
        theta[i] = theta_g_[i] + progress;
      }
      if (sent != sent_.end()) sent_.erase(sent);
      before_weights_change();
      load_flat(theta);
      if (subspace_) subspace_->project_params(model_->named_parameters());
    }
    msg::RoundDone r;
    r.round = b.round;
    r.stage = stage_;
    r.hash = state_hash();
    return msg::make(r, req.id, req.attempt);
  }

  // v through the outer codec, one tensor per part [bounds[j], bounds[j + 1]); a lossy codec
  // keeps what it could not send for the next call with the same key (error feedback).
  std::vector<wire::Tensor> outer_encode(const std::string& key, const std::vector<float>& v, const std::vector<int64_t>& bounds) {
    std::vector<wire::Tensor> parts;
    std::vector<uint8_t*> dst;
    for (size_t j = 0; j + 1 < bounds.size(); ++j) {
      const int64_t n = bounds[j + 1] - bounds[j];
      if (outer_codec_.lossless()) {
        parts.push_back(flat_tensor(std::vector<float>(v.begin() + bounds[j], v.begin() + bounds[j + 1]), outer_codec_));
        continue;
      }
      parts.push_back(wire::make_tensor(wire::DType::kF32, {n}, outer_codec_, compression::encoded_bytes(outer_codec_, n)));
      dst.push_back(static_cast<uint8_t*>(parts.back().data.data()));
    }
    if (!outer_codec_.lossless()) {
      outer_ef_->encode_parts(key, outer_codec_, v.data(), int64_t(v.size()), bounds, dst);
      for (auto& t : parts) wire::seal(t);
    }
    return parts;
  }

  // The accumulated gradient sums, flat (zeros where a parameter has none).
  std::vector<float> flat_grads() {
    std::vector<float> flat;
    flat.reserve(theta_g_.size());
    for (const auto& [name, p] : model_->named_parameters()) {
      torch::Tensor g = p.grad().defined() ? p.grad().detach().to(torch::kCPU).to(torch::kFloat32).contiguous()
                                           : torch::zeros({p.numel()}, torch::kFloat32);
      flat.insert(flat.end(), g.data_ptr<float>(), g.data_ptr<float>() + g.numel());
    }
    return flat;
  }

  void set_grads(const std::vector<float>& flat) {
    size_t off = 0;
    for (const auto& [name, p] : model_->named_parameters()) {
      torch::Tensor g = torch::from_blob(const_cast<float*>(flat.data() + off), p.sizes(), torch::kFloat32).clone();
      p.mutable_grad() = g.to(p.device());
      off += size_t(p.numel());
    }
  }

  // STATE_REQUEST: theta_g and the outer momentum; with {full} also this peer's local weights
  // and AdamW moments (flat, named_parameters order) and its step count: a stage snapshot or
  // checkpoint.
  Message state_request(Message& req) {
    const msg::StateRequest b = msg::read<msg::StateRequest>(req);
    check_job(b.job_id);
    msg::StateReply r;
    r.stage = stage_;
    r.hash = state_hash();
    r.full = b.full;
    std::vector<wire::Tensor> tensors;
    tensors.push_back(flat_tensor(theta_g_, compression::CodecSpec{}));
    tensors.push_back(flat_tensor(momentum_, compression::CodecSpec{}));
    if (b.full) {
      std::vector<float> m, v;
      int64_t step = 0;
      optimizer_flat(&m, &v, &step);
      tensors.push_back(flat_tensor(flatten(), compression::CodecSpec{}));
      tensors.push_back(flat_tensor(m, compression::CodecSpec{}));
      tensors.push_back(flat_tensor(v, compression::CodecSpec{}));
      r.adam_step = step;
      r.steps = optim_->steps_taken();
      const StagePrecision::ScaleState sc = prec_.state();
      r.loss_scale = sc.loss_scale;
      r.loss_scale_good_steps = sc.good_steps;
    }
    Message rep = msg::make(r, req.id, req.attempt);
    rep.tensors = std::move(tensors);
    return rep;
  }

  // STATE_LOAD: tensors [theta_g, momentum] (a donor's) set theta = theta_g; with
  // [theta_g, momentum, theta, adam_m, adam_v] and {adam_step} (a snapshot or checkpoint) the
  // local weights and the optimizer continue exactly where they were. Every array is checked
  // (size, finite; second moments not negative) before anything is loaded.
  Message state_load(Message& req) {
    const msg::StateLoad b = msg::read<msg::StateLoad>(req);
    check_job(b.job_id);
    if (req.tensors.size() != 2 && req.tensors.size() != 5)
      throw WireError(WireErrc::kMalformed, "STATE_LOAD carries 2 or 5 tensors, got " + std::to_string(req.tensors.size()));
    std::vector<float> tg = flat_from_wire(req.tensors[0], 0);
    std::vector<float> m = flat_from_wire(req.tensors[1], 1);
    if (req.tensors.size() == 5) {
      if (!b.adam_step) throw WireError(WireErrc::kMalformed, "STATE_LOAD with 5 tensors needs adam_step");
      std::vector<float> theta = flat_from_wire(req.tensors[2], 2);
      std::vector<float> am = flat_from_wire(req.tensors[3], 3);
      std::vector<float> av = flat_from_wire(req.tensors[4], 4);
      for (float x : av)
        if (x < 0) throw BadTensor(4, "negative AdamW second moments");
      // The donor's loss scale, when it sent one (checked first: throws before any change).
      prec_.restore({b.loss_scale, b.loss_scale_good_steps});
      publish_scale();
      load_optimizer_flat(am, av, *b.adam_step);
      before_weights_change();
      load_flat(theta);
    } else {
      before_weights_change();
      load_flat(tg);
    }
    theta_g_ = std::move(tg);
    momentum_ = std::move(m);
    sent_.clear();
    accum_samples_ = 0;
    stale_samples_ = 0;
    optim_->zero_grad();
    prec_.drop_pending();  // an overflow in the dropped gradients no longer matters
    msg::RoundDone r;
    r.stage = stage_;
    r.hash = state_hash();
    return msg::make(r, req.id, req.attempt);
  }

  void optimizer_flat(std::vector<float>* m, std::vector<float>* v, int64_t* step) {
    std::map<std::string, torch::Tensor> st;
    for (auto& [name, t] : optim_->state()) st[name] = t;
    for (const auto& [name, p] : model_->named_parameters()) {
      for (auto [suffix, out] : {std::make_pair(".exp_avg", m), std::make_pair(".exp_avg_sq", v)}) {
        torch::Tensor c = st.at(name + suffix).detach().to(torch::kCPU).to(torch::kFloat32).contiguous();
        out->insert(out->end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
      }
    }
    *step = st.at("step").item<int64_t>();
  }

  void load_optimizer_flat(const std::vector<float>& m, const std::vector<float>& v, int64_t step) {
    std::vector<std::pair<std::string, torch::Tensor>> st;
    size_t off = 0;
    for (const auto& [name, p] : model_->named_parameters()) {
      const auto n = size_t(p.numel());
      st.emplace_back(name + ".exp_avg", torch::from_blob(const_cast<float*>(m.data() + off), p.sizes(), torch::kFloat32).clone());
      st.emplace_back(name + ".exp_avg_sq", torch::from_blob(const_cast<float*>(v.data() + off), p.sizes(), torch::kFloat32).clone());
      off += n;
    }
    st.emplace_back("step", torch::full({}, step, torch::kLong));
    optim_->load_state(st);
  }

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
  torch::Tensor ids_;                   // token ids [B, T] of the request at hand (subspace codec)
  const DeviceCaps& caps_;  // what the device computes in (probed at start)
  StagePrecision prec_;
  std::vector<float> theta_g_, momentum_;  // the group's global weights and outer momentum (fp32, CPU)
  int64_t accum_samples_ = 0;              // samples in the gradients since the last inner step
  bool step_due_ = false;                   // async: the held step is to be taken after this reply
  int held_step_ = 0;                      // the latest job step (1-based) whose microbatches this peer ran a backward of
  std::map<int, std::vector<float>> sent_;  // local weights of a fragment when its delta left
  std::unique_ptr<compression::ErrorFeedback> outer_ef_ = std::make_unique<compression::ErrorFeedback>();  // what a lossy outer codec has not sent yet
  std::list<CacheEntry> cache_;   // oldest first
  GraphCacheRule graph_rule_{opt_.cache_entries, opt_.cache_ttl_s};
  int64_t stale_samples_ = 0;  // sum over the held samples of the steps between their forward and now
  WeightVersions versions_;   // async: the weights each version's forwards ran on
};

Worker::Worker(const StageOptions& opt, SharedStats& stats, StageFaults& faults, const DeviceCaps& caps)
    : impl_(std::make_unique<Impl>(opt, stats, faults, caps)) {}
Worker::~Worker() = default;
wire::Message Worker::handle(wire::Message& req, uint64_t seq) { return impl_->handle(req, seq); }
void Worker::after_reply() { impl_->after_reply(); }

}  // namespace swarm
