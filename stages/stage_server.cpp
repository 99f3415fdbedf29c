// stage_server.cpp: the stage server (see stage_server.h).
//
// Two threads. The I/O thread owns the DEALER socket to the router: it sends HELLO and
// heartbeats, decodes and validates every incoming message, answers session messages itself
// and queues work for the compute thread; it reconnects when the router goes silent. The
// compute thread owns the model: it runs forwards and backwards, the inner optimizer and the
// peer's side of the within-stage round, and sends its replies back through an inproc pipe so
// that only the I/O thread touches the network socket. Injected faults (stages/stage_faults.h,
// inert unless configured) see every message the I/O thread passes and every request the
// compute thread handles.
#include "stages/stage_server.h"

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cmath>
#include <deque>
#include <limits>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

#include "compression/codec.h"
#include "runtime/diloco.h"
#include "runtime/job_spec.h"
#include "runtime/log.h"
#include "runtime/wire.h"
#include "stages/compute_threads.h"
#include "stages/model.h"
#include "stages/optim.h"
#include "stages/stage_faults.h"
#include "stages/subspace.h"
#include "stages/tensor_codec.h"

namespace swarm {

using nlohmann::json;
using wire::Message;
using wire::MsgType;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// What the compute thread tells the I/O thread for heartbeats.
struct SharedStats {
  std::atomic<int> stage{-1};
  std::atomic<uint64_t> job_id{0};
  std::atomic<bool> ready{false};
  std::atomic<double> ms_per_unit{0};
  std::atomic<uint64_t> forwards{0}, backwards{0}, cache_hits{0}, recomputes{0}, steps{0}, errors{0};
};

// Work queue from the I/O thread to the compute thread.
class Inbox {
 public:
  struct Work {
    Message msg;
    uint64_t seq = 0;  // the request's number since the process started (fault triggers)
  };
  void push(Message m, uint64_t seq) {
    { std::lock_guard<std::mutex> l(mu_); q_.push_back(Work{std::move(m), seq}); }
    cv_.notify_one();
  }
  bool pop(Work* out, std::atomic<bool>& stop) {
    std::unique_lock<std::mutex> l(mu_);
    while (q_.empty()) {
      if (stop) return false;
      cv_.wait_for(l, std::chrono::milliseconds(100));
    }
    *out = std::move(q_.front());
    q_.pop_front();
    return true;
  }
  void clear() { std::lock_guard<std::mutex> l(mu_); q_.clear(); }
  size_t size() { std::lock_guard<std::mutex> l(mu_); return q_.size(); }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Work> q_;
};

// A forward's autograd graph, kept so the BACKWARD of the same microbatch skips the recompute.
struct CacheEntry {
  uint64_t mb = 0;
  uint64_t input_checksum = 0;  // the backward must carry exactly the input this graph saw
  torch::Tensor input, output;
  Clock::time_point at;
};

// The compute side: model, optimizer, round state.
class Worker {
 public:
  Worker(const StageOptions& opt, SharedStats& stats, StageFaults& faults) : opt_(opt), stats_(stats), faults_(faults) {}

  // Handles one request (number `seq`); returns the reply (an ERROR for bad input).
  Message handle(Message& req, uint64_t seq = 0) {
    begin_faults(req, seq);  // may crash or freeze here, before the clock starts
    const auto t0 = Clock::now();
    codec_time_ = CodecTime{};
    try {
      Message rep = dispatch(req);
      end_faults(rep);
      if (codec_time_.any())
        rep.body["codec_us"] = {codec_time_.act_enc, codec_time_.act_dec, codec_time_.grad_enc, codec_time_.grad_dec};
      double units = work_units(req.type, rep);
      if (units > 0) {
        pad_for_emulation(t0);
        const double ms = ms_since(t0);
        rep.body["compute_ms"] = ms;
        const double per = ms / units;
        const double old = stats_.ms_per_unit.load();
        stats_.ms_per_unit = old == 0 ? per : 0.9 * old + 0.1 * per;
      }
      return rep;
    } catch (const WireError& e) {
      stats_.errors++;
      return wire::error_reply(&req, e.code(), e.what());
    } catch (const InputError& e) {
      stats_.errors++;
      return wire::error_reply(&req, WireErrc::kBadTensor, e.what());
    } catch (const std::exception& e) {
      // A torch error on a tensor a peer sent us (shape mismatch, ...): the request is bad,
      // the process is fine.
      stats_.errors++;
      return wire::error_reply(&req, WireErrc::kBadTensor, std::string("compute failed: ") + e.what());
    }
  }

 private:
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
    switch (req.type) {
      case MsgType::kLoadStage: return load(req);
      default: break;
    }
    if (!model_) throw WireError(WireErrc::kOutOfOrder, std::string(wire::msg_type_name(req.type)) + " before LOAD_STAGE");
    check_job(req);
    switch (req.type) {
      case MsgType::kForward: return forward(req, /*eval=*/false);
      case MsgType::kEval: return forward(req, /*eval=*/true);
      case MsgType::kForwardLoss: return forward_loss(req);
      case MsgType::kBackward: return backward(req);
      case MsgType::kStep: return step(req);
      case MsgType::kRoundBegin: return round_begin(req);
      case MsgType::kRoundApply: return round_apply(req);
      case MsgType::kStateRequest: return state_request(req);
      case MsgType::kStateLoad: return state_load(req);
      default:
        throw WireError(WireErrc::kOutOfOrder, std::string("a stage server does not take ") + wire::msg_type_name(req.type));
    }
  }

  static double work_units(MsgType t, const Message& rep) {
    if (rep.type == MsgType::kError) return 0;
    switch (t) {
      case MsgType::kForward: case MsgType::kEval: return 1;
      case MsgType::kForwardLoss: return 3;
      case MsgType::kBackward: return rep.body.value("cached", false) ? 2 : 3;
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
  }

  void end_faults(Message& rep) {
    after_compute();
    if (fault_.nan && rep.body.contains("loss")) rep.body["loss"] = std::numeric_limits<double>::quiet_NaN();
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

  Message echo(Message& req) {
    if (req.type == MsgType::kLoadStage) return Message(MsgType::kStageReady, req.id, req.attempt, json{{"echo", true}});
    Message rep(MsgType::kResult, req.id, req.attempt, json{{"mb", req.body.value("mb", uint64_t(0))}});
    rep.tensors = std::move(req.tensors);  // the very bytes that came in
    return rep;
  }

  void check_job(const Message& req) {
    const uint64_t job = req.body.value("job_id", uint64_t(0));
    if (job != job_id_) throw WireError(WireErrc::kOutOfOrder, "request for job " + std::to_string(job) + " but this peer serves job " + std::to_string(job_id_));
  }

  Message load(Message& req) {
    const uint64_t job = req.body.at("job_id").get<uint64_t>();
    const int stage = req.body.at("stage").get<int>();
    JobSpec spec = parse_job_spec(req.body.at("spec"), /*check_files=*/false);
    if (stage < 0 || stage >= spec.partition.stages) throw WireError(WireErrc::kMalformed, "stage out of range");
    stats_.ready = false;
    cache_.clear();
    spec_ = spec;
    job_id_ = job;
    stage_ = stage;
    act_codec_ = compression::parse_codec(spec.compression.activations);
    grad_codec_ = compression::parse_codec(spec.compression.gradients);
    outer_codec_ = compression::parse_codec(spec.compression.outer);
    torch::Device dev(opt_.device == "cuda" ? std::string("cuda:0") : opt_.device);
    model_ = std::make_unique<StageModel>(spec.model, stage, spec.partition.stages, spec.first_layer(stage),
                                          spec.partition.layers_per_stage[stage], spec.seed, dev);
    optim_ = std::make_unique<AdamW>(model_->named_parameters(), spec.optimizer, spec.steps);
    // SUBSPACE HOOK: the subspace codec's constraint holds from the first weights on, and every
    // optimizer step keeps it.
    subspace_ = Subspace::for_stage(spec, stage);
    if (subspace_) {
      subspace_->project_params(model_->named_parameters());
      optim_->set_constraint(subspace_.get());
    }
    theta_g_ = flatten();
    momentum_.assign(theta_g_.size(), 0.f);
    accum_samples_ = 0;
    frag_samples_.clear();
    sent_.clear();
    outer_ef_.reset();
    const double fwd_ms = measure();
    stats_.stage = stage;
    stats_.job_id = job;
    stats_.ready = true;
    log_info("stage", "loaded stage " + std::to_string(stage) + " of job " + std::to_string(job) + ": " +
                          std::to_string(model_->num_parameters()) + " parameters, " + std::to_string(fwd_ms) + " ms per forward");
    return Message(MsgType::kStageReady, req.id, req.attempt,
                   json{{"job_id", job}, {"stage", stage}, {"params", model_->num_parameters()}, {"fwd_ms", fwd_ms},
                        {"hash", state_hash()}});
  }

  // One forward and backward at the job's microbatch shape: the peer's first throughput figure.
  double measure() {
    const int B = spec_.batch.microbatch_size, T = spec_.model.seq_len;
    torch::Tensor in = model_->is_first()
                           ? torch::zeros({B, T}, torch::kInt64).to(model_->device())
                           : torch::zeros({B, T, spec_.model.d_model}).to(model_->device()).requires_grad_(true);
    const auto t0 = Clock::now();
    torch::Tensor out = model_->forward(in);
    const double fwd = ms_since(t0);
    out.sum().backward();
    optim_->zero_grad();
    const double ms = ms_since(t0) * opt_.emulate;
    stats_.ms_per_unit = ms / 3.0;
    return fwd * opt_.emulate;
  }

  torch::Tensor input_tensor(const wire::Tensor& t) {
    if (model_->is_first()) {
      torch::Tensor x = from_wire(t, 2);
      if (t.desc.dtype == wire::DType::kF32) throw WireError(WireErrc::kBadTensor, "stage 0 takes token ids, not floats");
      if (x.size(1) > spec_.model.max_seq_len) throw WireError(WireErrc::kBadTensor, "sequence longer than the model's maximum");
      if (x.numel() && (x.min().item<int64_t>() < 0 || x.max().item<int64_t>() >= spec_.model.vocab_size))
        throw WireError(WireErrc::kBadTensor, "token id outside the vocabulary");
      ids_ = x;  // SUBSPACE HOOK: the ids travel on with this stage's output
      return x.to(model_->device());
    }
    torch::Tensor a = timed(codec_time_.act_dec, [&] { return decode_input(t); });
    if (!torch::isfinite(a).all().item<bool>()) throw WireError(WireErrc::kBadTensor, "non-finite values in the stage input");
    return a.to(model_->device());
  }

  torch::Tensor targets_tensor(const wire::Tensor& t, const torch::Tensor& input) {
    torch::Tensor y = from_wire(t, 2);
    if (y.size(0) != input.size(0) || y.size(1) != input.size(1)) throw WireError(WireErrc::kBadTensor, "targets do not match the input's [B, T]");
    if (y.numel() && (y.min().item<int64_t>() < 0 || y.max().item<int64_t>() >= spec_.model.vocab_size))
      throw WireError(WireErrc::kBadTensor, "target id outside the vocabulary");
    return y.to(model_->device());
  }

  // --- SUBSPACE HOOKS (stages/subspace.h): the codec that needs the job's basis and the token ids ---

  // A stage input [B, T, C]; a subspace-coded one also sets ids_ (its token ids).
  torch::Tensor decode_input(const wire::Tensor& t) {
    if (t.desc.codec.codec != compression::Codec::kSubspace) {
      ids_ = torch::Tensor();  // no ids came with it
      return from_wire(t, 3, spec_.model.d_model);
    }
    if (!subspace_) throw WireError(WireErrc::kBadTensor, "a subspace-coded activation, but this job does not use the subspace codec");
    return subspace_->decode_activation(t, &ids_);
  }
  torch::Tensor decode_grad(const wire::Tensor& t) {
    if (t.desc.codec.codec != compression::Codec::kSubspace) return from_wire(t, 3, spec_.model.d_model);
    if (!subspace_) throw WireError(WireErrc::kBadTensor, "a subspace-coded gradient, but this job does not use the subspace codec");
    return subspace_->decode_gradient(t);
  }
  wire::Tensor encode_output(const torch::Tensor& out) {
    if (subspace_ && subspace_->codes_activations()) {
      if (!ids_.defined()) throw WireError(WireErrc::kBadTensor, "the stage input carried no token ids, which the subspace codec needs");
      return subspace_->encode_activation(out, ids_);
    }
    return to_wire(out, act_codec_);
  }
  wire::Tensor encode_grad(const torch::Tensor& g) {
    if (subspace_ && subspace_->codes_gradients()) return subspace_->encode_gradient(g);
    return to_wire(g, grad_codec_);
  }

  void need_tensors(const Message& req, size_t n) {
    if (req.tensors.size() != n)
      throw WireError(WireErrc::kMalformed, std::string(wire::msg_type_name(req.type)) + " carries " + std::to_string(n) + " tensor(s), got " + std::to_string(req.tensors.size()));
  }

  Message result(const Message& req, json body) {
    body["mb"] = req.body.value("mb", uint64_t(0));
    body["stage"] = stage_;
    return Message(MsgType::kResult, req.id, req.attempt, std::move(body));
  }

  Message forward(Message& req, bool eval) {
    const bool last = model_->is_last();
    need_tensors(req, eval && last ? 2 : 1);
    torch::Tensor x = input_tensor(req.tensors[0]);
    if (eval) {
      torch::NoGradGuard ng;
      torch::Tensor out = model_->forward(x);
      if (last) {
        torch::Tensor y = targets_tensor(req.tensors[1], x);
        const double loss = StageModel::loss(out, y).item<double>();
        return result(req, json{{"loss", loss}});
      }
      Message rep = result(req, json::object());
      rep.tensors.push_back(timed(codec_time_.act_enc, [&] { return encode_output(emit(out)); }));
      return rep;
    }
    if (last) throw WireError(WireErrc::kOutOfOrder, "the last stage takes FORWARD_LOSS, not FORWARD");
    stats_.forwards++;
    if (!model_->is_first()) x.requires_grad_(true);
    torch::Tensor out = model_->forward(x);
    Message rep = result(req, json::object());
    rep.tensors.push_back(timed(codec_time_.act_enc, [&] { return encode_output(emit(out)); }));
    remember(req.body.value("mb", uint64_t(0)), req.tensors[0].desc.checksum, x, out);
    return rep;
  }

  void remember(uint64_t mb, uint64_t checksum, torch::Tensor x, torch::Tensor out) {
    const auto now = Clock::now();
    for (auto it = cache_.begin(); it != cache_.end();) {
      if (it->mb == mb || std::chrono::duration<double>(now - it->at).count() > opt_.cache_ttl_s) it = cache_.erase(it);
      else ++it;
    }
    while (cache_.size() >= opt_.cache_entries) cache_.pop_front();
    cache_.push_back(CacheEntry{mb, checksum, std::move(x), std::move(out), now});
  }

  Message forward_loss(Message& req) {
    if (!model_->is_last()) throw WireError(WireErrc::kOutOfOrder, "FORWARD_LOSS goes to the last stage");
    need_tensors(req, 2);
    torch::Tensor x = input_tensor(req.tensors[0]);
    torch::Tensor y = targets_tensor(req.tensors[1], x);
    const int64_t samples = x.size(0);
    if (!model_->is_first()) x.requires_grad_(true);
    torch::Tensor loss = StageModel::loss(model_->forward(x), y);
    (loss * double(samples)).backward();
    stats_.backwards++;
    Message rep = result(req, json{{"loss", loss.item<double>()}, {"samples", samples}});
    if (!model_->is_first()) rep.tensors.push_back(timed(codec_time_.grad_enc, [&] { return encode_grad(emit(x.grad())); }));
    accumulate(samples);
    return rep;
  }

  Message backward(Message& req) {
    if (model_->is_last()) throw WireError(WireErrc::kOutOfOrder, "the last stage runs its backward inside FORWARD_LOSS");
    need_tensors(req, 2);
    const uint64_t mb = req.body.value("mb", uint64_t(0));
    torch::Tensor g = timed(codec_time_.grad_dec, [&] { return decode_grad(req.tensors[1]); });
    if (!torch::isfinite(g).all().item<bool>()) throw WireError(WireErrc::kBadTensor, "non-finite values in the output gradient");
    torch::Tensor x, out;
    bool cached = false;
    for (auto it = cache_.begin(); it != cache_.end(); ++it) {
      if (it->mb == mb && it->input_checksum == req.tensors[0].desc.checksum) {
        x = it->input;
        out = it->output;
        cache_.erase(it);
        cached = true;
        break;
      }
    }
    if (!cached) {
      x = input_tensor(req.tensors[0]);
      if (!model_->is_first()) x.requires_grad_(true);
      out = model_->forward(x);
      stats_.recomputes++;
    } else {
      stats_.cache_hits++;
    }
    g = g.to(out.device());
    if (g.sizes() != out.sizes()) throw WireError(WireErrc::kBadTensor, "output gradient shape does not match the stage output");
    out.backward(g);
    stats_.backwards++;
    const int64_t samples = x.size(0);
    Message rep = result(req, json{{"cached", cached}, {"samples", samples}});
    if (!model_->is_first()) rep.tensors.push_back(timed(codec_time_.grad_enc, [&] { return encode_grad(emit(x.grad())); }));
    accumulate(samples);
    return rep;
  }

  // Async: a peer steps on its own once it has accumulated inner_batch samples.
  void accumulate(int64_t samples) {
    accum_samples_ += samples;
    for (int f = 0; f < spec_.diloco.fragments; ++f) frag_samples_[f] += samples;
    const int inner = spec_.batch.inner_batch > 0 ? spec_.batch.inner_batch : spec_.batch.batch_size;
    if (spec_.schedule == "async" && accum_samples_ >= inner) take_step();
  }

  void take_step() {
    if (accum_samples_ == 0) return;
    const double norm = optim_->step(accum_samples_);
    log_debug("stage", "inner step " + std::to_string(optim_->steps_taken()) + " on " + std::to_string(accum_samples_) +
                           " samples, gradient norm " + std::to_string(norm));
    accum_samples_ = 0;
    stats_.steps++;
  }

  Message step(Message& req) {
    take_step();
    return result(req, json{{"steps", optim_->steps_taken()}});
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
      p.detach().copy_(src.to(p.device()));
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

  // A flat fp32 tensor of n values (default: the whole stage), decoded and all finite.
  std::vector<float> flat_from_wire(const wire::Tensor& t, size_t n = 0) {
    if (n == 0) n = theta_g_.size();
    if (t.desc.dtype != wire::DType::kF32 || t.desc.shape.size() != 1 || t.desc.numel() != int64_t(n))
      throw WireError(WireErrc::kBadTensor, "flat parameter tensor of the wrong size for this stage");
    std::vector<float> v(n);
    try {
      compression::decode(t.desc.codec, static_cast<const uint8_t*>(t.data.data()), t.data.size(), int64_t(v.size()), v.data());
    } catch (const CodecError& e) {
      throw WireError(WireErrc::kBadTensor, e.what());
    }
    for (float f : v)
      if (!std::isfinite(f)) throw WireError(WireErrc::kBadTensor, "non-finite values in a parameter tensor");
    return v;
  }

  // ROUND_BEGIN {round, what, fragment, fragments}. "delta" (DiLoCo): the outer gradient
  // theta_g - theta over the fragment's range, and the samples this peer trained on since that
  // fragment last synced. "grad" (sync every_step): the gradient sums since the last step and
  // their samples. Both travel through the outer codec; a lossy one keeps what it could not
  // send (error feedback) for the next round.
  Message round_begin(Message& req) {
    const std::string what = req.body.value("what", std::string("delta"));
    const int f = req.body.value("fragment", 0);
    const auto [lo, hi] = fragment(req);
    std::vector<float> v;
    int64_t samples = 0;
    if (what == "grad") {
      v = flat_grads();
      samples = accum_samples_;
    } else {
      const std::vector<float> theta = flatten();
      v.resize(hi - lo);
      for (size_t i = lo; i < hi; ++i) v[i - lo] = theta_g_[i] - theta[i];
      sent_[f].assign(theta.begin() + long(lo), theta.begin() + long(hi));
      samples = frag_samples_[f];
    }
    Message rep(MsgType::kRoundDelta, req.id, req.attempt,
                json{{"round", req.body.value("round", uint64_t(0))}, {"stage", stage_}, {"samples", samples}, {"what", what}});
    rep.tensors.push_back(outer_encode(what + ":" + std::to_string(f), v));
    return rep;
  }

  // ROUND_APPLY. "delta": the group's mean outer gradient d for the fragment; theta_g and the
  // momentum take the outer step (diloco::outer_step: the same fp32 loop on every peer) and
  // the local weights become theta_g plus whatever this peer learned since it sent its delta
  // (nothing, unless the exchange overlapped inner steps). "grad": the group's gradient sum
  // over {samples}; one inner optimizer step with it, identical on every peer.
  Message round_apply(Message& req) {
    need_tensors(req, 1);
    const std::string what = req.body.value("what", std::string("delta"));
    const int f = req.body.value("fragment", 0);
    const auto [lo, hi] = fragment(req);
    if (what == "grad") {
      const std::vector<float> g = flat_from_wire(req.tensors[0], theta_g_.size());
      const int64_t samples = req.body.at("samples").get<int64_t>();
      set_grads(g);
      if (samples > 0) optim_->step(samples);
      optim_->zero_grad();
      accum_samples_ = 0;
      frag_samples_.clear();  // a warm start's steps are no round's samples
      stats_.steps++;
      theta_g_ = flatten();
    } else {
      const std::vector<float> d = flat_from_wire(req.tensors[0], hi - lo);
      diloco::outer_step(theta_g_.data() + lo, momentum_.data() + lo, d.data(), hi - lo, float(spec_.diloco.outer_lr),
                         float(spec_.diloco.outer_momentum), spec_.diloco.nesterov);
      // SUBSPACE HOOK: a lossy outer codec moves theta_g off the constraint; the same
      // deterministic projection on every peer puts it back, bit for bit.
      if (subspace_) subspace_->project_flat(model_->named_parameters(), theta_g_);
      std::vector<float> theta = flatten();
      auto sent = sent_.find(f);
      for (size_t i = lo; i < hi; ++i) {
        const float progress = sent != sent_.end() ? theta[i] - sent->second[i - lo] : 0.f;
        theta[i] = theta_g_[i] + progress;
      }
      if (sent != sent_.end()) sent_.erase(sent);
      load_flat(theta);
      if (subspace_) subspace_->project_params(model_->named_parameters());  // SUBSPACE HOOK
      frag_samples_[f] = 0;
    }
    return Message(MsgType::kRoundDone, req.id, req.attempt,
                   json{{"round", req.body.value("round", uint64_t(0))}, {"stage", stage_}, {"hash", state_hash()}});
  }

  // The flat range of the round's fragment (all parameters when the job does not stream).
  std::pair<size_t, size_t> fragment(const Message& req) {
    const int F = req.body.value("fragments", 1), f = req.body.value("fragment", 0);
    if (F < 1 || f < 0 || f >= F) throw WireError(WireErrc::kMalformed, "fragment " + std::to_string(f) + " of " + std::to_string(F));
    return diloco::fragment_range(theta_g_.size(), F, f);
  }

  wire::Tensor outer_encode(const std::string& key, const std::vector<float>& v) {
    if (outer_codec_.lossless()) return flat_tensor(v, outer_codec_);
    const auto n = int64_t(v.size());
    wire::Tensor t = wire::make_tensor(wire::DType::kF32, {n}, outer_codec_, compression::encoded_bytes(outer_codec_, n));
    outer_ef_.encode(key, outer_codec_, v.data(), n, static_cast<uint8_t*>(t.data.data()));
    wire::seal(t);
    return t;
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

  // STATE_REQUEST: theta_g and the outer momentum; with {"full": true} also this peer's local
  // weights and AdamW moments (flat, named_parameters order) and its step count: a stage
  // snapshot or checkpoint.
  Message state_request(Message& req) {
    const bool full = req.body.value("full", false);
    Message rep(MsgType::kStateReply, req.id, req.attempt, json{{"stage", stage_}, {"hash", state_hash()}, {"full", full}});
    rep.tensors.push_back(flat_tensor(theta_g_, compression::CodecSpec{}));
    rep.tensors.push_back(flat_tensor(momentum_, compression::CodecSpec{}));
    if (full) {
      std::vector<float> m, v;
      int64_t step = 0;
      optimizer_flat(&m, &v, &step);
      rep.tensors.push_back(flat_tensor(flatten(), compression::CodecSpec{}));
      rep.tensors.push_back(flat_tensor(m, compression::CodecSpec{}));
      rep.tensors.push_back(flat_tensor(v, compression::CodecSpec{}));
      rep.body["adam_step"] = step;
      rep.body["steps"] = optim_->steps_taken();
    }
    return rep;
  }

  // STATE_LOAD: tensors [theta_g, momentum] (a donor's) set theta = theta_g; with
  // [theta_g, momentum, theta, adam_m, adam_v] and {adam_step} (a snapshot or checkpoint) the
  // local weights and the optimizer continue exactly where they were.
  Message state_load(Message& req) {
    if (req.tensors.size() != 2 && req.tensors.size() != 5)
      throw WireError(WireErrc::kMalformed, "STATE_LOAD carries 2 or 5 tensors, got " + std::to_string(req.tensors.size()));
    std::vector<float> tg = flat_from_wire(req.tensors[0]);
    std::vector<float> m = flat_from_wire(req.tensors[1]);
    if (req.tensors.size() == 5) {
      std::vector<float> theta = flat_from_wire(req.tensors[2]);
      std::vector<float> am = flat_from_wire(req.tensors[3]);
      std::vector<float> av = flat_from_wire(req.tensors[4]);
      load_optimizer_flat(am, av, req.body.at("adam_step").get<int64_t>());
      load_flat(theta);
    } else {
      load_flat(tg);
    }
    theta_g_ = std::move(tg);
    momentum_ = std::move(m);
    frag_samples_.clear();
    sent_.clear();
    accum_samples_ = 0;
    optim_->zero_grad();
    return Message(MsgType::kRoundDone, req.id, req.attempt, json{{"stage", stage_}, {"hash", state_hash()}});
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
    if (step < 0) throw WireError(WireErrc::kMalformed, "adam_step is negative");
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
  std::unique_ptr<Subspace> subspace_;     // the subspace codec's side of this stage, or null
  torch::Tensor ids_;                      // token ids [B, T] of the request at hand (subspace codec)
  std::vector<float> theta_g_, momentum_;  // the group's global weights and outer momentum (fp32, CPU)
  int64_t accum_samples_ = 0;              // samples in the gradients since the last inner step
  std::map<int, int64_t> frag_samples_;    // samples since each fragment last synced
  std::map<int, std::vector<float>> sent_;  // local weights of a fragment when its delta left
  compression::ErrorFeedback outer_ef_;     // what a lossy outer codec has not sent yet
  std::list<CacheEntry> cache_;
};

std::string default_name() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return std::string(host) + ":" + std::to_string(getpid());
}

std::string random_id() {
  static const char* hex = "0123456789abcdef";
  std::random_device rd;
  std::string s = "p-";
  for (int i = 0; i < 12; ++i) s += hex[rd() % 16];
  return s;
}

// What HELLO says about the device: a name and its memory [bytes], null when unknown. On CPU,
// "cpu" and the host's RAM. For CUDA, libtorch 1.13 and 2.x share no header-only query of the
// device's name or memory (both need the CUDA headers), so the device string and null.
std::pair<std::string, json> device_info(const std::string& device) {
  if (device.rfind("cuda", 0) == 0) return {device, nullptr};
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return {"cpu", pages > 0 && page > 0 ? json(int64_t(pages) * int64_t(page)) : json(nullptr)};
}

}  // namespace

int run_stage_server(const StageOptions& opt, std::atomic<bool>& stop) {
  set_compute_threads(opt.threads);
  if (opt.device.rfind("cuda", 0) == 0 && !torch::cuda::is_available()) {
    log_error("stage", "--device " + opt.device + " asked for, but this libtorch has no CUDA device available; use --device cpu");
    return 2;
  }
  const std::string name = opt.name.empty() ? default_name() : opt.name;
  const std::string routing_id = random_id();

  zmq::context_t ctx(1);
  zmq::socket_t to_io(ctx, zmq::socket_type::pair), from_worker(ctx, zmq::socket_type::pair);
  from_worker.bind("inproc://replies");
  to_io.connect("inproc://replies");

  SharedStats stats;
  Inbox inbox;
  std::atomic<bool> worker_stop{false};
  StageFaults faults(opt.faults, opt.fault_seed, stats.steps, stop);
  std::thread compute([&] {
    Worker w(opt, stats, faults);
    Inbox::Work work;
    while (inbox.pop(&work, worker_stop)) {
      faults.wait_while_frozen();
      Message rep = w.handle(work.msg, work.seq);
      faults.wait_while_frozen();  // a freeze holds the reply too
      wire::send(to_io, rep);
    }
  });

  auto make_socket = [&]() {
    auto s = std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::dealer);
    s->set(zmq::sockopt::routing_id, routing_id);
    s->set(zmq::sockopt::linger, 0);
    s->set(zmq::sockopt::sndhwm, 100000);
    s->set(zmq::sockopt::rcvhwm, 100000);
    s->connect(opt.router);
    return s;
  };
  std::unique_ptr<zmq::socket_t> sock = make_socket();
  auto send_frames = [&](Frames& frames) {
    for (size_t i = 0; i < frames.size(); ++i)
      sock->send(frames[i], i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  };
  // Replies and error answers: the injected faults decide what actually leaves.
  auto answer = [&](Message& m) {
    for (auto& f : faults.outgoing(wire::encode(m))) send_frames(f);
  };
  const std::pair<std::string, json> device = device_info(opt.device);
  auto hello = [&](zmq::socket_t& s) {
    if (faults.partitioned()) return;  // cut off: nothing goes out
    Message h(MsgType::kHello, 0, 0,
              json{{"role", "stage"}, {"version", wire::kVersion}, {"name", name}, {"device", opt.device},
                   {"device_name", device.first}, {"device_memory_bytes", device.second},
                   {"stage", opt.stage}, {"prefer_stage", opt.prefer_stage}, {"emulate", opt.emulate}, {"profile", opt.profile},
                   {"threads", opt.threads}, {"pid", int(getpid())}, {"echo", opt.echo}});
    wire::send(s, h);
  };

  hello(*sock);
  log_info("stage", name + " (" + routing_id + ") connecting to " + opt.router +
                        (opt.emulate > 1 ? " [emulated " + (opt.profile.empty() ? std::to_string(opt.emulate) + "x slower" : opt.profile) + "]" : ""));
  auto last_heard = Clock::now();
  auto last_beat = Clock::now();
  bool welcomed = false;
  double backoff_s = 0.5;
  int heartbeat_ms = opt.heartbeat_ms;
  double silent_s = opt.liveness * opt.heartbeat_ms / 1000.0;

  auto reconnect = [&](const std::string& why) {
    // The router is gone or cut off: reconnect with doubling backoff and say HELLO again.
    log_warn("stage", why + "; reconnecting");
    inbox.clear();
    sock = make_socket();
    hello(*sock);
    welcomed = false;
    last_heard = Clock::now();
    backoff_s = std::min(backoff_s * 2, 8.0);
  };

  // CHAOS from the router: a fault to add to this process's injector.
  auto add_fault = [&](Message& m) {
    try {
      faults.add_live(m.body);
    } catch (const InputError& e) {
      stats.errors++;
      log_error("fault", std::string("refused a CHAOS fault from the router: ") + e.what());
      Message err = wire::error_reply(&m, WireErrc::kMalformed, e.what());
      answer(err);
    }
  };

  auto handle_incoming = [&](StageFaults::Delivery& d) {
    Message m;
    try {
      m = wire::decode(d.frames);
    } catch (const WireError& e) {
      stats.errors++;
      log_warn("stage", std::string("dropped a bad message from the router: ") + e.what());
      Message err = wire::error_reply(nullptr, e.code(), e.what());
      // The request's id when its envelope survived: the router re-sends it at once.
      if (auto id = wire::peek_id(d.frames)) err.id = *id;
      answer(err);
      return;
    }
    switch (m.type) {
      case MsgType::kWelcome:
        // The router's liveness rule is the one that counts: heartbeat at its pace.
        heartbeat_ms = std::max(10, m.body.value("heartbeat_ms", heartbeat_ms));
        silent_s = std::max(1, m.body.value("liveness", opt.liveness)) * heartbeat_ms / 1000.0;
        welcomed = true;
        backoff_s = 0.5;
        log_info("stage", "registered with the router as " + m.body.value("peer_id", routing_id));
        break;
      case MsgType::kHeartbeat: break;
      case MsgType::kError:
        log_warn("stage", "router says: " + m.body.value("message", std::string("?")));
        if (m.body.value("code", 0) == int(WireErrc::kOutOfOrder) && m.body.value("request_type", 0) == int(MsgType::kHeartbeat)) {
          hello(*sock);  // the router does not know us (it restarted): introduce ourselves again
        }
        break;
      case MsgType::kBye:
        log_info("stage", "router said goodbye: " + m.body.value("reason", std::string("")));
        stop = true;
        break;
      case MsgType::kChaos: add_fault(m); break;
      default:
        inbox.push(std::move(m), d.seq);
    }
  };

  while (!stop) {
    if (faults.wait_while_frozen()) log_warn("fault", "freeze over: carrying on as before");
    zmq::pollitem_t items[] = {{sock->handle(), 0, ZMQ_POLLIN, 0}, {from_worker.handle(), 0, ZMQ_POLLIN, 0}};
    try {
      zmq::poll(items, 2, std::chrono::milliseconds(faults.poll_ms(std::max(10, heartbeat_ms / 4))));
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) continue;  // SIGTERM: the loop condition decides
      throw;
    }
    if (items[1].revents & ZMQ_POLLIN) {
      // Replies from the compute thread: forwarded frame by frame, untouched unless a fault fires.
      while (auto r = wire::recv_frames(from_worker, false, zmq::recv_flags::dontwait)) {
        for (auto& f : faults.outgoing(std::move(r->frames))) send_frames(f);
      }
    }
    if (items[0].revents & ZMQ_POLLIN) {
      std::vector<StageFaults::Delivery> deliveries;
      while (!faults.frozen()) {
        auto r = wire::recv_frames(*sock, false, zmq::recv_flags::dontwait);
        if (!r) break;
        if (faults.incoming(std::move(r->frames), deliveries)) last_heard = Clock::now();
        for (auto& d : deliveries) handle_incoming(d);
        deliveries.clear();
      }
    }
    for (auto& d : faults.due_incoming()) handle_incoming(d);
    for (auto& f : faults.due_outgoing()) send_frames(f);
    const auto now = Clock::now();
    if (std::chrono::duration<double, std::milli>(now - last_beat).count() >= heartbeat_ms) {
      last_beat = now;
      Message hb(MsgType::kHeartbeat, 0, 0,
                 json{{"stage", stats.stage.load()}, {"job_id", stats.job_id.load()}, {"ready", stats.ready.load()},
                      {"queue", inbox.size()}, {"ms_per_unit", stats.ms_per_unit.load()},
                      {"forwards", stats.forwards.load()}, {"backwards", stats.backwards.load()},
                      {"cache_hits", stats.cache_hits.load()}, {"recomputes", stats.recomputes.load()},
                      {"steps", stats.steps.load()}, {"errors", stats.errors.load()}});
      for (auto& f : faults.heartbeat(wire::encode(hb))) send_frames(f);
    }
    const double silence_s = std::chrono::duration<double>(now - last_heard).count();
    if (const auto cut_s = faults.partition_healed()) {
      // The router has declared us dead if the partition outlasted its window: rejoin at once.
      if (*cut_s > silent_s) reconnect("the partition outlasted the router's " + std::to_string(silent_s) + " s window");
    } else if (!faults.partitioned() && silence_s > silent_s + (welcomed ? 0 : backoff_s)) {
      reconnect(std::string("router silent for ") + std::to_string(silent_s) + " s");
    }
  }
  if (!faults.partitioned()) {
    Message bye(MsgType::kBye, 0, 0, json{{"reason", "shutting down"}});
    wire::send(*sock, bye);
  }
  worker_stop = true;
  compute.join();
  return 0;
}

}  // namespace swarm
