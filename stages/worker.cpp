// worker.cpp: implements stages/worker.h (Worker::Impl, stages/worker_impl.h): loading a stage,
// the hops, the affinity cache and the inner steps, on the compute thread of a stage server. The
// round and the state transfers are in worker_rounds.cpp.
#include "stages/worker_impl.h"

#include <filesystem>

#ifdef SWARM_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace swarm {

Message Worker::Impl::handle(Message& req, uint64_t seq) {
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
        const double ms = ms_since(t0) + step_ms_unreported_;
        step_ms_unreported_ = 0;
        r.compute_ms = ms;
        stats_.ms_per_unit = timing::ema(stats_.ms_per_unit.load(), ms / units);
        stats_.compute_s = stats_.compute_s.load() + ms / 1000;
      }
      rep.body = msg::pack(r);
    } else if (req.type == MsgType::kStep) {
      step_ms_unreported_ += ms_since(t0);
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

Message Worker::Impl::dispatch(Message& req) {
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

double Worker::Impl::work_units(MsgType t, bool cached) {
  switch (t) {
    case MsgType::kForward: case MsgType::kEval: return 1;
    case MsgType::kForwardLoss: return 3;
    case MsgType::kBackward: return cached ? 2 : 3;
    default: return 0;
  }
}

void Worker::Impl::pad_for_emulation(Clock::time_point t0) {
  const double factor = opt_.emulate * fault_.slow;
  if (factor <= 1.0) return;
  const double spent = ms_since(t0);
  std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(spent * (factor - 1.0)));
}

void Worker::Impl::begin_faults(const Message& req, uint64_t seq) {
  fault_type_ = req.type;
  fault_seq_ = seq;
  fault_after_done_ = !faults_.armed();
  fault_ = faults_.before_compute(int(req.type), seq, has_output(req.type));
}

void Worker::Impl::after_compute() {
  if (fault_after_done_) return;
  fault_after_done_ = true;
  const StageFaults::Compute c = faults_.after_compute(int(fault_type_), fault_seq_, has_output(fault_type_));
  fault_.slow *= c.slow;
  fault_.nan = fault_.nan || c.nan;
  fault_.lie = fault_.lie || c.lie;
}

torch::Tensor Worker::Impl::emit(const torch::Tensor& t) {
  after_compute();
  if (!fault_.nan) return t;
  torch::Tensor p = torch::full(t.sizes(), std::numeric_limits<float>::quiet_NaN(), t.options());
  if (p.numel() > 0) p.view(-1)[0].fill_(std::numeric_limits<float>::infinity());
  return p;
}

Message Worker::Impl::echo(Message& req) {
  if (req.type != MsgType::kLoadStage)
    throw WireError(WireErrc::kOutOfOrder, std::string("an echo peer answers LOAD_STAGE and FORWARD only, not ") + wire::msg_type_name(req.type));
  msg::StageReady r;
  r.echo = true;
  return msg::make(r, req.id, req.attempt);
}

void Worker::Impl::check_job(uint64_t job) const {
  if (job != job_id_) throw WireError(WireErrc::kOutOfOrder, "request for job " + std::to_string(job) + " but this peer serves job " + std::to_string(job_id_));
}

Message Worker::Impl::load(Message& req) {
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
  step_ms_unreported_ = 0;
  held_step_ = 0;
  sent_.clear();
  outer_ef_ = std::make_unique<compression::ErrorFeedback>();
  const bool ends = stage_ == 0 || stage_ == spec.partition.stages - 1;
  if (!b.data_hash || !ends) data_.reset();
  else if (!data_ || data_->hash() != *b.data_hash) data_ = own_data(spec, *b.data_hash);
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
  std::shared_ptr<const OwnTokens> own;
  if (data_) {
    r.data = true;
    own = std::make_shared<const OwnTokens>(OwnTokens{data_, job_id_, spec.seed, spec.batch.microbatch_size, spec.model.seq_len, stage_, spec.partition.stages});
  }
  {
    std::lock_guard<std::mutex> l(stats_.own_mu);
    stats_.own = std::move(own);
  }
  return msg::make(r, req.id, req.attempt);
}

std::shared_ptr<const TokenData> Worker::Impl::own_data(const JobSpec& spec, uint64_t want) {
  if (opt_.data_root.empty()) return nullptr;
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path root = fs::weakly_canonical(opt_.data_root, ec);
  for (const std::string& path : spec.data.paths) {
    const fs::path at = fs::weakly_canonical(path, ec);
    const fs::path rel = at.lexically_relative(root);
    if (ec || rel.empty() || *rel.begin() == "..") {
      log_info("stage", "the job's data " + path + " is not under --data-root " + opt_.data_root + ": the router sends its tokens");
      return nullptr;
    }
  }
  try {
    auto d = std::make_shared<TokenData>(TokenData::load(spec.data, spec.model.seq_len, spec.model.vocab_size));
    if (d->hash() != want) {
      log_warn("stage", "the job's data here differs from the router's copy (another file at the same path?): the router sends its tokens");
      return nullptr;
    }
    log_info("stage", "samples its own tokens from the job's data (" + std::to_string(d->train().size() + d->val().size()) + " tokens)");
    return d;
  } catch (const InputError& e) {
    log_info("stage", std::string("cannot read the job's data here (") + e.what() + "): the router sends its tokens");
    return nullptr;
  }
}

size_t Worker::Impl::cache_entries_for(const JobSpec& spec, const torch::Device& dev) {
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

double Worker::Impl::measure() {
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

torch::Tensor Worker::Impl::input_tensor(const wire::Tensor& t, int index) {
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

torch::Tensor Worker::Impl::decode_act(const wire::Tensor& t) {
  if (t.desc.codec.codec != compression::Codec::kSubspace) {
    ids_ = torch::Tensor();  // no ids came with it
    return decode_input(t, 3, spec_.model.d_model, model_->device());
  }
  if (!subspace_) throw WireError(WireErrc::kBadTensor, "a subspace-coded activation, but this job does not use the subspace codec");
  return subspace_->decode_activation(t, &ids_).to(model_->device());
}

torch::Tensor Worker::Impl::decode_grad(const wire::Tensor& t) {
  if (t.desc.codec.codec != compression::Codec::kSubspace) return decode_input(t, 3, spec_.model.d_model, model_->device());
  if (!subspace_) throw WireError(WireErrc::kBadTensor, "a subspace-coded gradient, but this job does not use the subspace codec");
  return subspace_->decode_gradient(t).to(model_->device());
}

wire::Tensor Worker::Impl::encode_act(const torch::Tensor& out) {
  if (subspace_ && subspace_->codes_activations()) {
    if (!ids_.defined()) throw WireError(WireErrc::kBadTensor, "the stage input carried no token ids, which the subspace codec needs");
    return subspace_->encode_activation(out, ids_);
  }
  return encode_output(out, act_codec_);
}

wire::Tensor Worker::Impl::encode_grad(const torch::Tensor& g) {
  if (subspace_ && subspace_->codes_gradients()) return subspace_->encode_gradient(g);
  return encode_output(g, grad_codec_);
}

torch::Tensor Worker::Impl::targets_tensor(const wire::Tensor& t, const torch::Tensor& input) {
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

void Worker::Impl::need_tensors(const Message& req, size_t n) {
  if (req.tensors.size() != n)
    throw WireError(WireErrc::kMalformed, std::string(wire::msg_type_name(req.type)) + " carries " + std::to_string(n) + " tensor(s), got " + std::to_string(req.tensors.size()));
}

Message Worker::Impl::result(const Message& req, const msg::Hop& h, msg::Result r) {
  r.mb = h.mb;
  r.stage = stage_;
  return msg::make(r, req.id, req.attempt);
}

Message Worker::Impl::forward(Message& req, bool eval) {
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

void Worker::Impl::remember(uint64_t mb, uint64_t checksum, torch::Tensor x, torch::Tensor out) {
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

Message Worker::Impl::forward_loss(Message& req) {
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

Message Worker::Impl::backward(Message& req) {
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

void Worker::Impl::drop_unused_snapshots() {
  versions_.drop_unused([this](uint64_t v) {
    for (const CacheEntry& e : cache_)
      if (e.version == v) return true;
    return false;
  });
}

torch::Tensor Worker::Impl::finish_backward(const torch::Tensor& x, msg::Result& r) {
  bool overflow = false;
  torch::Tensor gx = prec_.finish(model_->is_first() ? torch::Tensor() : x.grad(), model_->parameters(), &overflow);
  if (prec_.scaling()) r.overflow = overflow;
  if (overflow) stats_.overflows++;
  return gx;
}

void Worker::Impl::before_backward(uint64_t mb) {
  if (spec_.schedule != Schedule::kAsync || accum_samples_ == 0) return;
  if (job_step_of(mb) > held_step_ && !dense_step(spec_, held_step_)) take_step();
}

void Worker::Impl::accumulate(int64_t samples, uint64_t mb, bool closes) {
  accum_samples_ += samples;
  held_step_ = std::max(held_step_, job_step_of(mb));
  if (dense_step(spec_, held_step_)) return;
  const int inner = spec_.batch.inner_batch > 0 ? spec_.batch.inner_batch : spec_.batch.batch_size;
  if (spec_.schedule == Schedule::kAsyncLocal && accum_samples_ >= inner) take_step();
  if (spec_.schedule == Schedule::kAsync && closes && job_step_of(mb) == held_step_) step_due_ = true;
}

void Worker::Impl::after_reply() {
  if (!step_due_) return;
  const auto t0 = Clock::now();
  try {
    take_step();
  } catch (const std::exception& e) {
    // No reply to carry it: the next backward's step, or the barrier's STEP, tries again.
    log_warn("stage", std::string("the step a closing backward ended failed: ") + e.what());
  }
  step_ms_unreported_ += ms_since(t0);
}

bool Worker::Impl::take_step(bool skip) {
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
  const auto step_t0 = Clock::now();
  const double norm = optim_->step(accum_samples_, scale, lr_step, lr_factor);
  const double step_ms = ms_since(step_t0);
  versions_.after_step(*model_);
  drop_unused_snapshots();
  stale_samples_ = 0;
  log_debug("stage", "inner step " + std::to_string(optim_->steps_taken()) + " on " + std::to_string(accum_samples_) +
                         " samples, gradient norm " + std::to_string(norm) + ", " + std::to_string(step_ms) + " ms");
  accum_samples_ = 0;
  stale_samples_ = 0;
  stats_.steps++;
  return false;
}

Message Worker::Impl::step(Message& req) {
  const msg::Step b = msg::read<msg::Step>(req);
  check_job(b.job_id);
  msg::Result r;
  r.skipped = take_step(b.skip);
  r.stage = stage_;
  r.steps = optim_->steps_taken();
  if (prec_.scaling()) r.loss_scale = prec_.scale();
  return msg::make(r, req.id, req.attempt);
}
Worker::Worker(const StageOptions& opt, SharedStats& stats, StageFaults& faults, const DeviceCaps& caps)
    : impl_(std::make_unique<Impl>(opt, stats, faults, caps)) {}
Worker::~Worker() = default;
wire::Message Worker::handle(wire::Message& req, uint64_t seq) { return impl_->handle(req, seq); }
void Worker::after_reply() { impl_->after_reply(); }

}  // namespace swarm
