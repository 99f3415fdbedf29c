// fuzz_router_core.cpp: libFuzzer target for the router's core (router/core.h), stateful: the
// input is a program of up to 256 steps that joins, kills and silences stage servers, makes them
// lie, submits and cancels jobs, lets time pass, and sends the core arbitrary frames and
// arbitrary bodies under every message type, as any process that reaches the router's port
// could. The peers that are not told otherwise answer as real ones would (tests/support/
// fake_swarm.h), so the jobs really run.
//
// Checked after every step (FakeSwarm calls RouterCore::check_invariants after each event): no
// exception escapes the core; every microbatch marked as sent has its request pending, to the
// peer it names; no job has more microbatches in flight than max_inflight; no request is held
// by a peer that is gone or for a job that is not running; peers, clients, jobs and histories
// stay within their limits.
//
// Input: a sequence of steps, each an opcode byte and its operands (see the switch below).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "runtime/messages.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_frames.h"
#include "tests/support/fake_swarm.h"

using namespace swarm;
using router::testing::FakeSwarm;
using nlohmann::json;
using wire::MsgType;

namespace {

class Input {
 public:
  Input(const uint8_t* d, size_t n) : d_(d), n_(n) {}
  bool empty() const { return at_ >= n_; }
  uint8_t byte() { return at_ < n_ ? d_[at_++] : 0; }
  std::string bytes(size_t max) {
    const size_t k = std::min<size_t>(byte(), max);
    const size_t take = std::min(k, n_ - at_);
    std::string s(reinterpret_cast<const char*>(d_ + at_), take);
    at_ += take;
    return s;
  }

 private:
  const uint8_t* d_;
  size_t n_, at_ = 0;
};

const MsgType kTypes[] = {MsgType::kHello,       MsgType::kHeartbeat,   MsgType::kBye,        MsgType::kError,
                          MsgType::kStageReady,  MsgType::kResult,      MsgType::kRoundDelta, MsgType::kRoundReduced,
                          MsgType::kRoundDone,   MsgType::kStateReply,  MsgType::kSubmit,     MsgType::kStatus,
                          MsgType::kCancel,      MsgType::kPeers,       MsgType::kChaos,      MsgType::kForward,
                          MsgType::kFetched,     MsgType::kRelease,     MsgType::kFetch,      MsgType::kPush};

// A small job spec the fake peers can run, varied by one byte.
json spec_of(uint8_t b) {
  json s = FakeSwarm::tiny_spec(1 + b % 3, 1 + (b >> 2) % 4);
  if (b & 0x40) s["schedule"] = "async";
  if (b & 0x80) s["diloco"] = {{"inner_steps", 2}, {"deadline_s", 2}, {"streaming", {{"fragments", 2}, {"overlap_steps", 0}}}};
  if ((b & 0x30) == 0x30) s["checkpoint"] = {{"dir", "/ck"}, {"every_steps", 1}};
  if (b % 7 == 3) s["routing"]["hops"] = "hub";
  return s;
}

// The id of the newest request the router sent a peer (a reply the core will take seriously).
uint64_t last_request_id(const FakeSwarm& f, const router::PeerId& id) {
  const auto& v = f.peers.at(id).received;
  for (auto it = v.rbegin(); it != v.rend(); ++it)
    if (it->id) return it->id;
  return 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  router::CoreOptions opt;
  opt.max_peers = 6;
  FakeSwarm f(opt);
  f.tick_s = 0.025;          // coarser fake time: more steps a second, the same events
  f.keep_received = 16;
  std::vector<router::PeerId> peers;
  router::PeerId client = f.client();
  const bool verbose = std::getenv("SWARM_FUZZ_VERBOSE") != nullptr;
  size_t logged = 0;
  for (int step = 0; step < 256 && !in.empty(); ++step) {
    if (verbose)
      for (; logged < f.logs.size(); ++logged) std::fprintf(stderr, "  [%.3f] %s\n", f.now, f.logs[logged].text.c_str());
    const uint8_t op = in.byte();
    if (verbose) std::fprintf(stderr, "step %d: op %d\n", step, op % 12);
    const uint8_t w = in.byte();  // always read, so a program's bytes mean the same at every step
    const router::PeerId who = peers.empty() ? router::PeerId("p-nobody") : peers[w % peers.size()];
    switch (op % 12) {
      case 0: f.run(0.025 * (1 + in.byte() % 64)); break;                  // time passes: up to 1.6 s
      case 1: {  // a peer joins; with the high bit it takes fetches (peer to peer)
        const uint8_t b = in.byte();
        f.peers_listen = b & 0x80;
        peers.push_back(f.join("s" + std::to_string(peers.size()), int(b % 5) - 1));
        break;
      }
      case 2: f.submit(client, spec_of(in.byte())); break;
      case 3:
        if (f.peers.count(who)) f.kill(who);
        break;
      case 4:  // silent, or (high bit) unreachable for other peers' fetches
        if (f.peers.count(who) && (w & 0x80)) f.peers.at(who).unreachable = !f.peers.at(who).unreachable;
        else if (f.peers.count(who)) f.peers.at(who).silent = !f.peers.at(who).silent;
        break;
      case 5:
        if (f.peers.count(who)) f.peers.at(who).quirks.wrong_shape = {2, 8, int64_t(in.byte() % 20)};
        break;
      case 6:
        if (f.peers.count(who)) f.peers.at(who).quirks.bad_input_reports = in.byte() % 4;
        break;
      case 7: {  // raw frames, parsed as the server does: the envelope first, the rest for known senders
        const std::string raw = in.bytes(255);
        fuzz::FuzzFrames ff = fuzz::split_frames(reinterpret_cast<const uint8_t*>(raw.data()), raw.size(), 8);
        const router::PeerId from = in.byte() & 1 ? who : router::PeerId("stranger");
        try {
          const wire::Envelope env = wire::peek_envelope(ff.frames);
          if (!f.core.accepts(from, env.type)) {
            f.deliver(from, wire::Message(env.type, env.id, env.attempt));
            break;
          }
          f.deliver(from, wire::decode(ff.frames, ff.verify_checksums));
        } catch (const WireError& e) {
          (void)f.core.on_undecodable(from, e, wire::peek_id(ff.frames), f.now);
          f.core.check_invariants();
        }
        break;
      }
      case 8: {  // any body under any type, from a peer, replying to its newest request
        const MsgType t = kTypes[in.byte() % (sizeof kTypes / sizeof kTypes[0])];
        const router::PeerId from = in.byte() & 1 ? who : client;
        const uint64_t id = f.peers.count(from) ? last_request_id(f, from) : 7;
        f.deliver(from, wire::Message(t, id, 0, in.bytes(64)));
        break;
      }
      case 9: {  // a well-formed body with fuzzed numbers: the typed checks' edges
        const uint64_t id = f.peers.count(who) ? last_request_id(f, who) : 0;
        msg::Result r;
        r.compute_ms = double(in.byte()) * 1e-3;
        r.loss = double(in.byte());
        r.samples = in.byte();
        wire::Message m = msg::make(r, id);
        const uint8_t how = in.byte();
        if (how & 1) {
          const int64_t d = 1 + in.byte() % 32;
          wire::Tensor t = wire::make_tensor(wire::DType::kF32, {2, 8, d}, compression::CodecSpec{}, size_t(2 * 8 * d * 4));
          std::memset(t.data.data(), 0, t.data.size());
          wire::seal(t);
          if (how & 2) {
            // A reference instead: to this request (or another), from itself (or elsewhere).
            wire::TensorRef ref;
            ref.key = (how & 4) ? id : id + 1;
            ref.part = (how >> 3) & 1;
            ref.from = (how & 16) ? "tcp://elsewhere:1" : "";
            ref.desc = t.desc;
            m.refs.push_back(std::move(ref));
          } else {
            m.tensors.push_back(std::move(t));
          }
        }
        f.deliver(who, std::move(m));
        break;
      }
      case 10: {  // client requests
        const uint8_t b = in.byte();
        if (b % 3 == 0) f.deliver(client, wire::json_message(MsgType::kCancel, 9, 0, {{"job_id", b % 4}}));
        else if (b % 3 == 1) f.deliver(client, wire::json_message(MsgType::kStatus, 9, 0, {{"job_id", b % 4}}));
        else f.deliver(client, wire::json_message(MsgType::kChaos, 9, 0, {{"peer", who}, {"fault", "slow,factor=2"}}));
        break;
      }
      case 11: client = f.client(); break;
    }
    f.core.check_invariants();
    (void)f.core.status_json(std::nullopt, f.now);
    (void)f.core.peers_json(0, 1000, f.now);
  }
  FUZZ_CHECK(f.core.registry().size() <= opt.max_peers, "more peers than max_peers");
  // SWARM_FUZZ_VERBOSE=1: what the program did (for writing seeds).
  if (std::getenv("SWARM_FUZZ_VERBOSE")) {
    nlohmann::json st = f.core.status_json(std::nullopt, f.now);
    st.erase("history");
    std::fprintf(stderr, "%s\n", st.dump().c_str());
  }
  return 0;
}
