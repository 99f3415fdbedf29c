// fake_swarm.cpp: implements fake_swarm.h.
#include "tests/support/fake_swarm.h"

#include <unistd.h>

#include <algorithm>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>


namespace swarm::router::testing {

namespace {

// The folder make_data_file made, removed when the test program ends.
std::string& data_dir() {
  static std::string dir;
  return dir;
}
void remove_data_dir() {
  std::error_code ec;
  if (!data_dir().empty()) std::filesystem::remove_all(data_dir(), ec);
}

// A few KB of text: the data every fake job trains on (the core samples microbatches from it).
std::string make_data_file() {
  char tmpl[] = "/tmp/swarm-core-test-XXXXXX";
  if (!mkdtemp(tmpl)) throw std::runtime_error("cannot make a folder under /tmp");
  data_dir() = tmpl;
  std::atexit(remove_data_dir);   // registered after data_dir's string: it runs first
  const std::string path = data_dir() + "/text.txt";
  std::ofstream f(path);
  for (int i = 0; i < 200; ++i) f << "The quick brown fox jumps over the lazy dog; a swarm trains one model across many machines. ";
  return path;
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
  p.book.has_data = peers_have_data;
  peers.erase(id);
  peers.emplace(id, std::move(p));
  msg::Hello h;
  h.role = msg::Role::kStage;
  h.version = wire::kVersion;
  h.name = name;
  h.stage = stage;
  h.prefer_stage = prefer;
  h.emulate = emulate;
  if (peers_memory_bytes >= 0) h.device_memory_bytes = h.device_memory_free_bytes = peers_memory_bytes;
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
      r.data = std::make_shared<TokenData>(TokenData::load(l.spec->data, l.spec->model.seq_len, l.spec->model.vocab_size));
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
        p.received.back().fetch_within_ms = s->msg.fetch_within_ms;
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
  for (const wire::TensorRef* ref : sim::to_fetch(p.book, m)) {
    FakePeer* h = nullptr;
    for (auto& [id, q] : peers)
      if (!q.listen.empty() && q.listen == ref->from) h = &q;
    sim::FetchFailure why = sim::FetchFailure::kUnreachable;
    if (h && h->alive && h->busy_link) {
      why = sim::FetchFailure::kBusyLink;
    } else if (h && h->alive && !h->unreachable) {
      if (h->book.held.count(ref->key)) {
        fetched[ref->slot] = int64_t(ref->desc.wire_bytes());
        p.fetched_bytes += ref->desc.wire_bytes();
        if (msg::Hop::keeps_copies(m.type)) sim::keep_copy(p.book, ref->key, ref->desc.nbytes);   // as a stage server does
        continue;
      }
      why = sim::FetchFailure::kNotHeld;
    }
    return sim::fetch_error(m, ref->slot, why, ref->from);
  }
  return std::nullopt;
}

// Answers at once (the reply arrives at the next tick): a hop's compute_ms is 1 ms per unit.
void FakeSwarm::answer(FakePeer& p, wire::Message& m) {
  using wire::MsgType;
  if (m.type == MsgType::kBye) {
    p.alive = false;
    return;
  }
  if (m.type == MsgType::kFetch) {
    inbox_.emplace_back(p.id, sim::answer_fetch(p.book, m));
    return;
  }
  // A hop without its tokens is made whole first, as a stage server's I/O thread does.
  std::optional<wire::Message> whole;
  const wire::Message* req = &m;
  if (std::find(std::begin(msg::Hop::kTypes), std::end(msg::Hop::kTypes), m.type) != std::end(msg::Hop::kTypes)) {
    const msg::Hop h = msg::read<msg::Hop>(m);
    if (h.own_tokens.value_or(false)) {
      whole.emplace(m.type, m.id, m.attempt, m.body);
      for (auto& t : m.tensors) whole->tensors.push_back(wire::share(t));
      whole->refs = m.refs;
      whole->hold = m.hold;
      if (std::optional<wire::Message> e = sim::own_tokens(p.book, *whole, h, payloads_)) {
        inbox_.emplace_back(p.id, std::move(*e));
        return;
      }
      req = &*whole;
    }
  }
  std::vector<int64_t> fetched;
  if (std::optional<wire::Message> e = fetch(p, *req, fetched)) {
    inbox_.emplace_back(p.id, std::move(*e));
    return;
  }
  const double ms = sim::work_units(req->type, sim::has_graph(p.book, *req));
  std::optional<wire::Message> r = sim::reply(p.book, *req, fetched, ms, now, p.quirks, payloads_);
  if (!r) return;
  if ((p.pushes_late || p.fetch_s_per_mb > 0) && r->type == MsgType::kResult) {
    int64_t late = 0, bytes = 0;
    for (const auto& ref : req->refs) late += ref.pushed;
    for (int64_t b : fetched) bytes += b;
    msg::Result res = msg::read<msg::Result>(*r);
    if (p.pushes_late && late > 0) res.push_late = late;
    if (p.fetch_s_per_mb > 0 && bytes > 0) res.fetch_ms = double(bytes) / 1e6 * p.fetch_s_per_mb * 1000.0;
    r->body = msg::pack(res);
  }
  if (auto it = p.reply_after_s.find(m.type); it != p.reply_after_s.end())
    later_.emplace(now + it->second, std::make_pair(p.id, std::move(*r)));
  else
    inbox_.emplace_back(p.id, std::move(*r));
}

bool FakeSwarm::run(double seconds, const std::function<bool()>& until) {
  const double end = now + seconds;
  const double beat_s = 0.5;
  while (now < end) {
    now += tick_s;
    std::deque<std::pair<PeerId, wire::Message>> due;
    due.swap(inbox_);
    for (auto it = later_.begin(); it != later_.end() && it->first <= now; it = later_.erase(it)) due.push_back(std::move(it->second));
    for (auto& [id, m] : due) {
      const FakePeer& p = peers.at(id);
      if (p.alive && !p.silent) deliver(id, std::move(m));
    }
    for (const auto& [t, reply] : later_) {
      FakePeer& p = peers.at(reply.first);
      if (!p.alive || p.silent || !p.parts || now - p.last_part_s < 0.25) continue;
      p.last_part_s = now;
      deliver(p.id, wire::Message(wire::MsgType::kPart));
    }
    if (now - last_beat_ >= beat_s) {
      last_beat_ = now;
      for (auto& [id, p] : peers) {
        if (!p.alive) continue;
        msg::Heartbeat hb;
        hb.stage = p.book.stage;
        hb.job_id = p.book.job;
        hb.ms_per_unit = p.claims_ms_per_unit;
        if (p.receiving)
          for (const auto& [t, reply] : later_) hb.receiving |= reply.first == id;
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
