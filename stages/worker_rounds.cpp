// worker_rounds.cpp: the within-stage round (ROUND_BEGIN, ROUND_REDUCE, ROUND_APPLY: the DiLoCo
// outer step) and the state transfers (STATE_REQUEST, STATE_LOAD) of Worker::Impl
// (stages/worker_impl.h), with the flat views of the stage's weights, gradients and optimizer
// state they travel as.
#include "stages/worker_impl.h"

namespace swarm {

std::vector<float> Worker::Impl::flatten() {
  std::vector<float> flat;
  flat.reserve(size_t(model_->num_parameters()));
  for (const auto& [name, p] : model_->named_parameters()) {
    torch::Tensor c = p.detach().to(torch::kCPU).to(torch::kFloat32).contiguous();
    flat.insert(flat.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  return flat;
}

void Worker::Impl::load_flat(const std::vector<float>& flat) {
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

uint64_t Worker::Impl::state_hash() const {
  const uint64_t a = wire::checksum(theta_g_.data(), theta_g_.size() * sizeof(float));
  const uint64_t b = wire::checksum(momentum_.data(), momentum_.size() * sizeof(float));
  return a ^ (b * 0x9E3779B97F4A7C15ull);
}

wire::Tensor Worker::Impl::flat_tensor(const std::vector<float>& v, const compression::CodecSpec& codec) {
  torch::Tensor t = torch::from_blob(const_cast<float*>(v.data()), {int64_t(v.size())}, torch::kFloat32);
  return to_wire(t, codec);
}

std::vector<float> Worker::Impl::flat_from_wire(const wire::Tensor& t, int index, size_t n) {
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

std::pair<size_t, size_t> Worker::Impl::fragment(const msg::RoundRef& r) const {
  if (r.fragment >= r.fragments) throw WireError(WireErrc::kMalformed, "fragment " + std::to_string(r.fragment) + " of " + std::to_string(r.fragments));
  if (r.shard >= r.shards) throw WireError(WireErrc::kMalformed, "part " + std::to_string(r.shard) + " of " + std::to_string(r.shards));
  return diloco::fragment_range(theta_g_.size(), r.fragments, r.fragment);
}

std::vector<int64_t> Worker::Impl::part_bounds(size_t n, int shards) {
  std::vector<int64_t> b;
  for (int j = 0; j < shards; ++j) b.push_back(int64_t(diloco::fragment_range(n, shards, j).first));
  b.push_back(int64_t(n));
  return b;
}

Message Worker::Impl::round_begin(Message& req) {
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

Message Worker::Impl::round_reduce(Message& req) {
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

Message Worker::Impl::round_apply(Message& req) {
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

std::vector<wire::Tensor> Worker::Impl::outer_encode(const std::string& key, const std::vector<float>& v, const std::vector<int64_t>& bounds) {
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

std::vector<float> Worker::Impl::flat_grads() {
  std::vector<float> flat;
  flat.reserve(theta_g_.size());
  for (const auto& [name, p] : model_->named_parameters()) {
    torch::Tensor g = p.grad().defined() ? p.grad().detach().to(torch::kCPU).to(torch::kFloat32).contiguous()
                                         : torch::zeros({p.numel()}, torch::kFloat32);
    flat.insert(flat.end(), g.data_ptr<float>(), g.data_ptr<float>() + g.numel());
  }
  return flat;
}

void Worker::Impl::set_grads(const std::vector<float>& flat) {
  size_t off = 0;
  for (const auto& [name, p] : model_->named_parameters()) {
    torch::Tensor g = torch::from_blob(const_cast<float*>(flat.data() + off), p.sizes(), torch::kFloat32).clone();
    p.mutable_grad() = g.to(p.device());
    off += size_t(p.numel());
  }
}

Message Worker::Impl::state_request(Message& req) {
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

Message Worker::Impl::state_load(Message& req) {
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

void Worker::Impl::optimizer_flat(std::vector<float>* m, std::vector<float>* v, int64_t* step) {
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

void Worker::Impl::load_optimizer_flat(const std::vector<float>& m, const std::vector<float>& v, int64_t step) {
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

}  // namespace swarm
