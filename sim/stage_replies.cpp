// stage_replies.cpp: implements sim/stage_replies.h.
#include "sim/stage_replies.h"

#include <algorithm>
#include <cstdlib>
#include <new>

#include "runtime/diloco.h"
#include "runtime/memory_estimate.h"

namespace swarm::sim {

using wire::MsgType;

wire::Tensor Payloads::zeros(wire::DType dtype, const wire::Shape& shape, const compression::CodecSpec& codec) {
  for (wire::Tensor& t : cache_)   // the hops' few payloads came first
    if (t.desc.dtype == dtype && t.desc.shape == shape && t.desc.codec == codec) return wire::share(t);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const size_t bytes = dtype == wire::DType::kF32 ? compression::encoded_bytes(codec, n) : size_t(n) * wire::dtype_bytes(dtype);
  wire::Tensor t = wire::make_tensor(dtype, shape, codec, 0);
  t.desc.nbytes = bytes;
  if (bytes) {
    void* zero = std::calloc(1, bytes);
    if (!zero) throw std::bad_alloc();
    t.data = zmq::message_t(zero, bytes, [](void* d, void*) { std::free(d); }, nullptr);
  }
  t.desc.checksum = wire::zeros_checksum(bytes);   // as seal() would find, without reading the pages
  cache_.push_back(std::move(t));
  return wire::share(cache_.back());
}

double work_units(MsgType t, bool cached) {
  switch (t) {
    case MsgType::kForward: case MsgType::kEval: return 1;
    case MsgType::kForwardLoss: return 3;
    case MsgType::kBackward: return cached ? 2 : 3;
    default: return 0;
  }
}

std::vector<const wire::TensorRef*> to_fetch(const StageBook& b, const wire::Message& m) {
  std::vector<const wire::TensorRef*> out;
  for (const wire::TensorRef& r : m.refs) {
    const bool mine = b.listen.empty() || r.from == b.listen;   // only what it made can be among what it holds
    if (!(mine && b.held.count(r.key)) && !b.copies.count(r.key)) out.push_back(&r);  // what it made or fetched before is at hand
  }
  return out;
}

void keep_copy(StageBook& b, uint64_t key, uint64_t bytes) {
  if (!b.copies.emplace(key, bytes).second) return;
  b.copy_bytes += bytes;
  b.copy_order.push_back(key);
  while (b.held_bytes + b.copy_bytes > b.hold_bytes && b.copy_head < b.copy_order.size()) drop_copy(b, b.copy_order[b.copy_head++]);
  if (b.copy_order.size() - b.copy_head > 2 * b.copies.size() + 64 || b.copy_head > b.copy_order.size() / 2 + 64) {
    // Mostly keys gone since: keep those still copied, in their order.
    std::vector<uint64_t> live;
    for (size_t i = b.copy_head; i < b.copy_order.size(); ++i)
      if (b.copies.count(b.copy_order[i])) live.push_back(b.copy_order[i]);
    b.copy_order.swap(live);
    b.copy_head = 0;
  }
}

void drop_copy(StageBook& b, uint64_t key) {
  const uint64_t* bytes = b.copies.find(key);
  if (!bytes) return;
  b.copy_bytes -= *bytes;
  b.copies.erase(key);
}

wire::Message fetch_error(const wire::Message& req, uint32_t slot, FetchFailure why, const std::string& from) {
  const WireErrc code = why == FetchFailure::kNotHeld ? WireErrc::kNotHeld : WireErrc::kUnreachable;
  wire::Message e = msg::error_reply(&req, code, "cannot fetch tensor " + std::to_string(slot) + " from " + from);
  msg::Error body = msg::read<msg::Error>(e);
  body.tensor = int32_t(slot);
  body.reached = why == FetchFailure::kBusyLink;
  e.body = msg::pack(body);
  return e;
}

bool has_graph(const StageBook& b, MsgType t, uint64_t mb) { return t == MsgType::kBackward && b.graphs.count(mb) > 0; }

bool has_graph(const StageBook& b, const wire::Message& m) {
  return m.type == MsgType::kBackward && has_graph(b, m.type, msg::read<msg::Hop>(m).mb);
}

namespace {

void drop_oldest_graph(StageBook& b) {
  b.graphs.erase(b.graph_order.front().first);
  b.graph_order.erase(b.graph_order.begin());
}

void keep_graph(StageBook& b, uint64_t mb, double now) {
  if (b.graphs.count(mb)) return;
  while (!b.graph_order.empty() && b.graph_rule.expired(now - b.graph_order.front().second)) drop_oldest_graph(b);
  switch (b.graph_rule.admit(b.graph_order.size(), b.graph_order.empty() ? 0.0 : now - b.graph_order.front().second)) {
    case GraphCacheRule::Admit::kSkip: return;
    case GraphCacheRule::Admit::kEvictOldest: drop_oldest_graph(b); break;
    case GraphCacheRule::Admit::kKeep: break;
  }
  b.graphs.emplace(mb, true);
  b.graph_order.emplace_back(mb, now);
}

// A backward of `mb`: whether its graph was kept; a used graph leaves the cache.
bool use_graph(StageBook& b, uint64_t mb, double now) {
  if (!b.graphs.erase(mb)) return false;
  const auto it = std::find_if(b.graph_order.begin(), b.graph_order.end(), [&](const auto& e) { return e.first == mb; });
  b.graph_rule.used(now - it->second);
  b.graph_order.erase(it);
  return true;
}

void load(StageBook& b, const wire::Message& m) {
  const msg::LoadStage l = msg::read<msg::LoadStage>(m);
  b.spec = parse_job_spec(l.spec, false);
  b.loaded = true;
  b.stage = l.stage;
  b.job = l.job_id;
  b.samples_tokens = b.has_data && l.data_hash && (b.stage == 0 || b.stage == b.spec.partition.stages - 1);
  b.graphs.clear();
  b.graph_order.clear();
  const Precision pin = b.spec.model.precision_pin();
  b.cache_entries = graph_cache_entries(b.spec, b.stage, pin == Precision::kAuto ? b.precision : pin, b.cuda, b.cuda, b.memory_bytes);
  b.graph_rule = GraphCacheRule(b.cache_entries, kGraphCacheTtlS);
  // The codecs its hops answer in; the subspace codec travels bound to the model, as a stage binds it.
  b.act_codec = compression::parse_codec(b.spec.compression.activations);
  b.grad_codec = compression::parse_codec(b.spec.compression.gradients);
  if (const auto sub = compression::subspace_job(b.spec.compression.activations, b.spec.compression.gradients,
                                                 b.spec.compression.outer, b.spec.model.d_model, b.spec.model.vocab_size)) {
    if (sub->activations) b.act_codec = *sub->activations;
    if (sub->gradients) b.grad_codec = *sub->gradients;
  }
}

wire::Message hop(StageBook& b, const wire::Message& m, const std::vector<int64_t>& fetched, double compute_ms, double now, Quirks& q,
                  Payloads& pay) {
  const JobSpec& s = b.spec;
  const msg::Hop h = msg::read<msg::Hop>(m);
  if (q.bad_input_reports > 0 && h.stage > 0 && m.type != MsgType::kBackward) {
    q.bad_input_reports--;
    wire::Message e = msg::error_reply(&m, WireErrc::kBadTensor, "non-finite values in the stage input");
    msg::Error body = msg::read<msg::Error>(e);
    body.tensor = 0;
    e.body = msg::pack(body);
    return e;
  }
  auto act = [&](const compression::CodecSpec& codec) {
    const wire::Shape shape =
        q.wrong_shape.empty() ? wire::Shape{s.batch.microbatch_size, s.model.seq_len, s.model.d_model} : q.wrong_shape;
    return pay.zeros(wire::DType::kF32, shape, codec);
  };
  msg::Result r;
  r.mb = h.mb;
  r.stage = h.stage;
  if (std::any_of(fetched.begin(), fetched.end(), [](int64_t n) { return n > 0; })) r.fetched = fetched;
  r.compute_ms = compute_ms / std::max(1e-9, q.claim_factor);
  const bool last = h.stage == s.partition.stages - 1;
  wire::Message rep;
  if (m.type == MsgType::kForward || (m.type == MsgType::kEval && !last)) {
    if (m.type == MsgType::kForward) keep_graph(b, h.mb, now);
    rep = msg::make(r, m.id, m.attempt);
    rep.tensors.push_back(act(b.act_codec));
  } else if (m.type == MsgType::kEval) {
    r.loss = 2.0;
    rep = msg::make(r, m.id, m.attempt);
  } else {
    if (m.type == MsgType::kForwardLoss) {
      r.loss = 2.0;
    } else {
      r.cached = use_graph(b, h.mb, now);
    }
    r.samples = s.batch.microbatch_size;
    rep = msg::make(r, m.id, m.attempt);
    if (h.stage > 0) rep.tensors.push_back(act(b.grad_codec));
  }
  return rep;
}

wire::Message round_part(StageBook& b, const wire::Message& m, Payloads& pay) {
  const JobSpec& s = b.spec;
  const msg::RoundRef ref = msg::read<msg::RoundBegin>(m);
  const size_t P = size_t(stage_parameter_counts(s)[size_t(b.stage)]);
  const auto [lo, hi] = diloco::fragment_range(P, ref.fragments, ref.fragment);
  const size_t all = ref.what == msg::RoundWhat::kGrad ? P : hi - lo;
  const compression::CodecSpec outer = compression::parse_codec(s.compression.outer);
  auto part = [&](int j) {
    const auto [plo, phi] = diloco::fragment_range(all, ref.shards, j);
    return pay.zeros(wire::DType::kF32, {int64_t(phi - plo)}, outer);
  };
  wire::Message rep;
  if (m.type == MsgType::kRoundBegin) {
    msg::RoundDelta d;
    d.round = ref.round;
    d.stage = b.stage;
    d.what = ref.what;
    rep = msg::make(d, m.id, m.attempt);
    for (int j = 0; j < ref.shards; ++j) rep.tensors.push_back(part(j));
  } else {
    msg::RoundReduced d;
    d.round = ref.round;
    d.stage = b.stage;
    rep = msg::make(d, m.id, m.attempt);
    rep.tensors.push_back(part(ref.shard));
  }
  return rep;
}

}  // namespace

std::optional<wire::Message> own_tokens(const StageBook& b, wire::Message& m, const msg::Hop& h, Payloads& pay) {
  if (!h.own_tokens.value_or(false)) return std::nullopt;
  if (!b.samples_tokens || h.job_id != b.job)
    return msg::error_reply(&m, WireErrc::kOutOfOrder, "a hop without its tokens, but this peer holds no copy of the job's data");
  const JobSpec& s = b.spec;
  auto zeros = [&] { return pay.zeros(wire::DType::kU16, {s.batch.microbatch_size, s.model.seq_len}, compression::CodecSpec{}); };
  std::optional<wire::Tensor> tokens, targets;
  if (msg::Hop::takes_tokens(b.stage)) tokens = zeros();
  if (msg::Hop::takes_targets(m.type, b.stage, s.partition.stages)) targets = zeros();
  msg::Hop::put_own(m, std::move(tokens), std::move(targets));
  return std::nullopt;
}

std::optional<wire::Message> reply(StageBook& b, const wire::Message& m, const std::vector<int64_t>& fetched, double compute_ms, double now,
                                   Quirks& q, Payloads& pay) {
  wire::Message rep;
  switch (m.type) {
    case MsgType::kLoadStage: {
      load(b, m);
      msg::StageReady r;
      r.job_id = b.job;
      r.stage = b.stage;
      r.params = q.params >= 0 ? q.params : stage_parameter_counts(b.spec)[size_t(b.stage)];
      r.hash = q.hash;
      if (b.samples_tokens) r.data = true;
      rep = msg::make(r, m.id, m.attempt);
      break;
    }
    case MsgType::kForward: case MsgType::kForwardLoss: case MsgType::kBackward: case MsgType::kEval:
      if (!b.loaded) return msg::error_reply(&m, WireErrc::kOutOfOrder, "no stage loaded");
      rep = hop(b, m, fetched, compute_ms, now, q, pay);
      break;
    case MsgType::kStep: {
      msg::Result r;
      r.stage = b.stage;
      r.steps = 1;
      rep = msg::make(r, m.id, m.attempt);
      break;
    }
    case MsgType::kRoundBegin: case MsgType::kRoundReduce:
      if (!b.loaded) return msg::error_reply(&m, WireErrc::kOutOfOrder, "no stage loaded");
      rep = round_part(b, m, pay);
      break;
    case MsgType::kRoundApply: case MsgType::kStateLoad: {
      msg::RoundDone d;
      if (m.type == MsgType::kRoundApply) d.round = msg::read<msg::RoundApply>(m).round;
      d.stage = b.stage;
      d.hash = q.hash;
      rep = msg::make(d, m.id, m.attempt);
      break;
    }
    case MsgType::kStateRequest: {
      if (!b.loaded) return msg::error_reply(&m, WireErrc::kOutOfOrder, "no stage loaded");
      const msg::StateRequest sr = msg::read<msg::StateRequest>(m);
      const int64_t P = stage_parameter_counts(b.spec)[size_t(b.stage)];
      msg::StateReply r;
      r.stage = b.stage;
      r.hash = q.hash;
      r.full = sr.full;
      if (sr.full) r.adam_step = 1;
      rep = msg::make(r, m.id, m.attempt);
      for (int k = 0; k < (sr.full ? 5 : 2); ++k) rep.tensors.push_back(pay.zeros(wire::DType::kF32, {P}, compression::CodecSpec{}));
      break;
    }
    case MsgType::kRelease:
      for (int64_t key : msg::read<msg::Release>(m).keys) {
        const std::vector<wire::Tensor>* held = b.held.find(uint64_t(key));
        if (!held) {
          drop_copy(b, uint64_t(key));   // its copy_order entry goes when it comes up
          continue;
        }
        // What it made was never fetched here, so no copy of it is kept.
        for (const wire::Tensor& t : *held) b.held_bytes -= std::min<uint64_t>(b.held_bytes, t.desc.nbytes);
        b.held.erase(uint64_t(key));
        b.released++;
      }
      return std::nullopt;
    default:
      return std::nullopt;
  }
  // A reply to a request that asked it to hold keeps its tensors here, referenced.
  if (m.hold && !rep.tensors.empty() && rep.type != MsgType::kError) {
    for (size_t i = 0; i < rep.tensors.size(); ++i) {
      wire::TensorRef ref;
      ref.slot = ref.part = uint32_t(i);
      ref.key = m.id;
      ref.desc = rep.tensors[i].desc;
      b.held_bytes += ref.desc.nbytes;
      rep.refs.push_back(std::move(ref));
    }
    b.held[m.id] = std::move(rep.tensors);
    rep.tensors.clear();
  }
  return rep;
}

wire::Message answer_fetch(StageBook& b, const wire::Message& m) {
  const msg::Fetch f = msg::read<msg::Fetch>(m);
  std::vector<wire::Tensor>* held = b.held.find(f.key);
  if (!held || size_t(f.part) >= held->size()) return msg::error_reply(&m, WireErrc::kNotHeld, "not held");
  wire::Message r = msg::make(MsgType::kFetched, f, m.id, m.attempt);
  r.tensors.push_back(wire::share((*held)[size_t(f.part)]));
  return r;
}

}  // namespace swarm::sim
