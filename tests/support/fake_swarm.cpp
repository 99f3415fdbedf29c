// fake_swarm.cpp: implements fake_swarm.h.
#include "tests/support/fake_swarm.h"

#include <unistd.h>

#include <cstring>
#include <fstream>

#include "runtime/diloco.h"

namespace swarm::router::testing {

namespace {

// A few KB of text: the data every fake job trains on (the core samples microbatches from it).
std::string make_data_file() {
  char tmpl[] = "/tmp/swarm-core-test-XXXXXX";
  const char* dir = mkdtemp(tmpl);
  const std::string path = std::string(dir ? dir : "/tmp") + "/text.txt";
  std::ofstream f(path);
  for (int i = 0; i < 200; ++i) f << "The quick brown fox jumps over the lazy dog; a swarm trains one model across many machines. ";
  return path;
}

wire::Tensor zeros(std::vector<int64_t> shape, const compression::CodecSpec& codec) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const size_t bytes = compression::encoded_bytes(codec, n);
  wire::Tensor t = wire::make_tensor(wire::DType::kF32, std::move(shape), codec, bytes);
  if (bytes) std::memset(t.data.data(), 0, bytes);
  wire::seal(t);
  return t;
}

}  // namespace

FakeSwarm::FakeSwarm(CoreOptions opt) : core(opt) {
  static const std::string path = make_data_file();  // once per process
  data_path_ = path;
}

nlohmann::json FakeSwarm::tiny_spec(int stages, int steps) {
  return {{"name", "tiny"},
          {"steps", steps},
          {"schedule", "sync"},
          {"model", {{"d_model", 16}, {"n_head", 2}, {"n_layer", stages * 2}, {"seq_len", 8}}},
          {"partition", {{"stages", stages}}},
          {"data", {{"path", ""}}},
          {"batch", {{"batch_size", 4}, {"microbatch_size", 2}}},
          {"diloco", {{"inner_steps", 2}, {"deadline_s", 5}, {"warm_start_steps", 0}}},  // rounds counted from step 0
          {"eval", {{"every_steps", 0}, {"batches", 2}}},
          {"routing", {{"rebalance", false}}}};
}

PeerId FakeSwarm::join(const std::string& name, int stage, int prefer, double emulate) {
  const PeerId id = "p-" + name;
  FakePeer p;
  p.id = id;
  p.name = name;
  peers.erase(id);
  peers.emplace(id, std::move(p));
  msg::Hello h;
  h.role = msg::Role::kStage;
  h.version = wire::kVersion;
  h.name = name;
  h.stage = stage;
  h.prefer_stage = prefer;
  h.emulate = emulate;
  if (peers_listen) {
    h.listen = "tcp://" + name + ":6000";
    peers.at(id).listen = h.listen;
  }
  deliver(id, msg::make(h));
  return id;
}

PeerId FakeSwarm::client() {
  const PeerId id = "c-" + std::to_string(to_clients.size() + 1);
  to_clients[id];
  msg::Hello h;
  h.role = msg::Role::kClient;
  h.version = wire::kVersion;
  deliver(id, msg::make(h, 1));
  return id;
}

uint64_t FakeSwarm::submit(const PeerId& client, const nlohmann::json& spec_in) {
  nlohmann::json spec = spec_in;
  if (spec.contains("data") && spec["data"].value("path", std::string("x")).empty()) spec["data"]["path"] = data_path_;
  deliver(client, wire::json_message(wire::MsgType::kSubmit, 2, 0, {{"spec", spec}}));
  while (!loads.empty()) {
    LoadJob l = loads.front();
    loads.erase(loads.begin());
    JobLoaded r;
    r.job = l.job;
    try {
      r.data = std::make_shared<TokenData>(TokenData::load(l.spec.data, l.spec.model.seq_len, l.spec.model.vocab_size));
    } catch (const std::exception& e) {
      r.error = e.what();
    }
    const std::string dir = l.resume.empty() ? l.checkpoint_dir : l.resume;
    if (auto it = checkpoints.find(dir); it != checkpoints.end() && !it->second.empty()) {
      LoadedCheckpoint lc;
      lc.ckpt = it->second.back();
      lc.path = dir + "/step-" + std::to_string(lc.ckpt.step);
      r.checkpoint = lc;
    }
    take(core.on_job_loaded(std::move(r), now));
  }
  // A refusal stays for the test to read; an acceptance is taken.
  auto& replies = to_clients.at(client);
  if (replies.empty() || replies.back().type != wire::MsgType::kSubmitted) return 0;
  return msg::read<msg::Submitted>(last_reply(client)).job_id;
}

wire::Message FakeSwarm::last_reply(const PeerId& client) {
  auto& v = to_clients.at(client);
  if (v.empty()) return wire::Message(wire::MsgType::kHeartbeat);
  wire::Message m = std::move(v.back());
  v.pop_back();
  return m;
}

void FakeSwarm::deliver(const PeerId& from, wire::Message m) {
  take(core.on_message(from, std::move(m), now));
  core.check_invariants();
}

bool FakeSwarm::logged(const std::string& text) const {
  for (const auto& l : logs)
    if (l.text.find(text) != std::string::npos) return true;
  return false;
}

void FakeSwarm::take(Actions actions) {
  std::vector<PeerId> unreachable;
  std::vector<CheckpointWritten> written;
  for (Action& a : actions) {
    if (auto* s = std::get_if<Send>(&a)) {
      auto it = peers.find(s->to);
      if (it != peers.end()) {
        FakePeer& p = it->second;
        if (!p.alive) {
          unreachable.push_back(p.id);
          continue;
        }
        if (p.received.size() >= keep_received) p.received.erase(p.received.begin());
        p.received.push_back(wire::Message(s->msg.type, s->msg.id, s->msg.attempt, s->msg.body));
        for (auto& t : s->msg.tensors) p.received.back().tensors.push_back(wire::share(t));
        p.received.back().refs = s->msg.refs;
        p.received.back().hold = s->msg.hold;
        if (p.silent_from && *p.silent_from == s->msg.type) p.silent = true;
        if (p.auto_answer && !p.silent) answer(p, s->msg);
      } else if (to_clients.count(s->to)) {
        to_clients[s->to].push_back(std::move(s->msg));
      }
    } else if (auto* lg = std::get_if<Log>(&a)) {
      logs.push_back(*lg);
    } else if (auto* f = std::get_if<WriteFile>(&a)) {
      files[f->path] = f->content;
    } else if (auto* lj = std::get_if<LoadJob>(&a)) {
      loads.push_back(*lj);
    } else if (auto* w = std::get_if<WriteCheckpoint>(&a)) {
      checkpoints[w->dir].push_back(*w->checkpoint);
      written.push_back(CheckpointWritten{w->job, w->checkpoint->step, w->dir + "/step-" + std::to_string(w->checkpoint->step), ""});
    }
  }
  for (const PeerId& id : unreachable)
    if (core.registry().find(id)) take(core.on_unreachable(id, now));
  for (auto& w : written) take(core.on_checkpoint_written(w, now));
}

std::optional<wire::Message> FakeSwarm::fetch(FakePeer& p, const wire::Message& m, std::vector<int64_t>& fetched) {
  fetched.assign(m.tensors.size() + m.refs.size(), 0);
  for (const wire::TensorRef& ref : m.refs) {
    if (p.held.count(ref.key)) continue;  // its own
    FakePeer* h = nullptr;
    for (auto& [id, q] : peers)
      if (!q.listen.empty() && q.listen == ref.from) h = &q;
    WireErrc code = WireErrc::kUnreachable;
    if (h && h->alive && !h->unreachable) {
      if (h->held.count(ref.key)) {
        fetched[ref.slot] = int64_t(ref.desc.wire_bytes());
        p.fetched_bytes += ref.desc.wire_bytes();
        continue;
      }
      code = WireErrc::kNotHeld;
    }
    wire::Message e = msg::error_reply(&m, code, "cannot fetch tensor " + std::to_string(ref.slot) + " from " + ref.from);
    msg::Error body = msg::read<msg::Error>(e);
    body.tensor = int32_t(ref.slot);
    e.body = msg::pack(body);
    return e;
  }
  return std::nullopt;
}

void FakeSwarm::answer(FakePeer& p, const wire::Message& m) {
  using wire::MsgType;
  const JobSpec& s = p.spec;
  // A reply to a request that asked it to hold keeps its tensors here, referenced.
  auto reply = [&](wire::Message r) {
    if (m.hold && !r.tensors.empty() && r.type != MsgType::kError) {
      for (size_t i = 0; i < r.tensors.size(); ++i) {
        wire::TensorRef ref;
        ref.slot = ref.part = uint32_t(i);
        ref.key = m.id;
        ref.desc = r.tensors[i].desc;
        r.refs.push_back(std::move(ref));
      }
      p.held[m.id] = std::move(r.tensors);
      r.tensors.clear();
    }
    inbox_.emplace_back(p.id, std::move(r));
  };
  auto act = [&](const std::string& codec) {
    const auto shape = p.wrong_shape.empty() ? std::vector<int64_t>{s.batch.microbatch_size, s.model.seq_len, s.model.d_model} : p.wrong_shape;
    return zeros(shape, compression::parse_codec(codec));
  };
  const int S = s.partition.stages;
  switch (m.type) {
    case MsgType::kLoadStage: {
      const msg::LoadStage l = msg::read<msg::LoadStage>(m);
      p.spec = parse_job_spec(l.spec, false);
      p.stage = l.stage;
      p.job = l.job_id;
      msg::StageReady r;
      r.job_id = l.job_id;
      r.stage = l.stage;
      r.params = p.params >= 0 ? p.params : stage_parameter_counts(p.spec)[size_t(l.stage)];
      r.hash = p.hash;
      return reply(msg::make(r, m.id, m.attempt));
    }
    case MsgType::kForward: case MsgType::kForwardLoss: case MsgType::kBackward: case MsgType::kEval: {
      const msg::Hop h = msg::read<msg::Hop>(m);
      std::vector<int64_t> fetched;
      if (std::optional<wire::Message> e = fetch(p, m, fetched)) return reply(std::move(*e));
      if (p.bad_input_reports > 0 && h.stage > 0 && m.type != MsgType::kBackward) {
        p.bad_input_reports--;
        wire::Message e = msg::error_reply(&m, WireErrc::kBadTensor, "non-finite values in the stage input");
        msg::Error body = msg::read<msg::Error>(e);
        body.tensor = 0;
        e.body = msg::pack(body);
        return reply(std::move(e));
      }
      msg::Result r;
      r.mb = h.mb;
      r.stage = h.stage;
      for (int64_t b : fetched)
        if (b > 0) r.fetched = fetched;
      const bool last = h.stage == S - 1;
      wire::Message rep;
      if (m.type == MsgType::kForward || (m.type == MsgType::kEval && !last)) {
        r.compute_ms = 1.0;
        rep = msg::make(r, m.id, m.attempt);
        rep.tensors.push_back(act(s.compression.activations));
      } else if (m.type == MsgType::kEval) {
        r.loss = 2.0;
        rep = msg::make(r, m.id, m.attempt);
      } else {
        if (m.type == MsgType::kForwardLoss) r.loss = 2.0;
        else r.cached = false;
        r.samples = s.batch.microbatch_size;
        r.compute_ms = 3.0;
        rep = msg::make(r, m.id, m.attempt);
        if (h.stage > 0) rep.tensors.push_back(act(s.compression.gradients));
      }
      return reply(std::move(rep));
    }
    case MsgType::kStep: {
      msg::Result r;
      r.stage = p.stage;
      r.steps = 1;
      return reply(msg::make(r, m.id, m.attempt));
    }
    case MsgType::kRoundBegin: case MsgType::kRoundReduce: {
      const msg::RoundRef b = msg::read<msg::RoundBegin>(m);
      std::vector<int64_t> fetched;
      if (std::optional<wire::Message> e = fetch(p, m, fetched)) return reply(std::move(*e));
      const size_t P = size_t(stage_parameter_counts(s)[size_t(p.stage)]);
      const auto [lo, hi] = diloco::fragment_range(P, b.fragments, b.fragment);
      const size_t all = b.what == msg::RoundWhat::kGrad ? P : hi - lo;
      auto part = [&](int j) {
        const auto [plo, phi] = diloco::fragment_range(all, b.shards, j);
        return zeros({int64_t(phi - plo)}, compression::parse_codec(s.compression.outer));
      };
      wire::Message rep;
      if (m.type == MsgType::kRoundBegin) {
        msg::RoundDelta d;
        d.round = b.round;
        d.stage = p.stage;
        d.what = b.what;
        rep = msg::make(d, m.id, m.attempt);
      } else {
        msg::RoundReduced d;
        d.round = b.round;
        d.stage = p.stage;
        rep = msg::make(d, m.id, m.attempt);
      }
      if (m.type == MsgType::kRoundBegin)
        for (int j = 0; j < b.shards; ++j) rep.tensors.push_back(part(j));
      else
        rep.tensors.push_back(part(b.shard));
      return reply(std::move(rep));
    }
    case MsgType::kRoundApply: case MsgType::kStateLoad: {
      std::vector<int64_t> fetched;
      if (std::optional<wire::Message> e = fetch(p, m, fetched)) return reply(std::move(*e));
      msg::RoundDone d;
      if (m.type == MsgType::kRoundApply) d.round = msg::read<msg::RoundApply>(m).round;
      d.stage = p.stage;
      d.hash = p.hash;
      return reply(msg::make(d, m.id, m.attempt));
    }
    case MsgType::kStateRequest: {
      const msg::StateRequest q = msg::read<msg::StateRequest>(m);
      const int64_t P = stage_parameter_counts(s)[size_t(p.stage)];
      msg::StateReply r;
      r.stage = p.stage;
      r.hash = p.hash;
      r.full = q.full;
      if (q.full) r.adam_step = 1;
      wire::Message rep = msg::make(r, m.id, m.attempt);
      for (int k = 0; k < (q.full ? 5 : 2); ++k) rep.tensors.push_back(zeros({P}, compression::CodecSpec{}));
      return reply(std::move(rep));
    }
    case MsgType::kRelease:
      for (int64_t key : msg::read<msg::Release>(m).keys) p.released += p.held.erase(uint64_t(key));
      return;
    case MsgType::kFetch: {
      const msg::Fetch f = msg::read<msg::Fetch>(m);
      auto it = p.held.find(f.key);
      if (it == p.held.end() || size_t(f.part) >= it->second.size()) return reply(msg::error_reply(&m, WireErrc::kNotHeld, "not held"));
      wire::Message r = msg::make(MsgType::kFetched, f, m.id, m.attempt);
      r.tensors.push_back(wire::share(it->second[size_t(f.part)]));
      inbox_.emplace_back(p.id, std::move(r));
      return;
    }
    case MsgType::kBye: p.alive = false; return;
    default: return;
  }
}

bool FakeSwarm::run(double seconds, const std::function<bool()>& until) {
  const double end = now + seconds;
  const double beat_s = 0.5;
  while (now < end) {
    now += tick_s;
    std::deque<std::pair<PeerId, wire::Message>> due;
    due.swap(inbox_);
    for (auto& [id, m] : due) {
      const FakePeer& p = peers.at(id);
      if (p.alive && !p.silent) deliver(id, std::move(m));
    }
    if (now - last_beat_ >= beat_s) {
      last_beat_ = now;
      for (auto& [id, p] : peers) {
        if (!p.alive) continue;
        msg::Heartbeat hb;
        hb.stage = p.stage;
        hb.job_id = p.job;
        deliver(id, msg::make(hb));
      }
    }
    take(core.tick(now));
    core.check_invariants();
    if (until && until()) return true;
  }
  return !until;
}

}  // namespace swarm::router::testing
