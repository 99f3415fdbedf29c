// fake_swarm.h: the router's core driven by hand, with a fake clock and no processes: stage
// servers that answer what a real one would (of the right sizes, without a model: the
// simulator's replies, sim/stage_replies.h), clients, and the disk kept in memory. Each test
// decides when time passes and which peer misbehaves; replies arrive at the next tick.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "router/core.h"
#include "runtime/messages.h"
#include "sim/stage_replies.h"

namespace swarm::router::testing {

struct FakePeer {
  PeerId id;
  std::string name;
  bool alive = true;      // dead peers receive nothing and answer nothing
  bool silent = false;    // alive (heartbeats) but answers nothing
  std::optional<wire::MsgType> silent_from;  // goes silent when it first receives this type
  bool auto_answer = true;
  // Its reply to a request of this type reaches the router this many seconds later (a large
  // reply on a slow link); every other reply arrives at the next tick.
  std::map<wire::MsgType, double> reply_after_s;
  // Such a reply comes in PARTs (docs/protocol.md#parts): one reaches the router every 0.25 s
  // while it is on its way, as a real large reply's would.
  bool parts = false;
  double last_part_s = -1e300;
  // Or its heartbeats say a large message from the router is still reaching it (receiving).
  bool receiving = false;
  double claims_ms_per_unit = 0;   // the speed its heartbeats report (0: none yet)
  // What it loaded and holds, and how it lies (wrong shapes, false bad-input reports, a wrong
  // parameter count, its state hash): the simulator's stage server, sim/stage_replies.h.
  sim::StageBook book;
  sim::Quirks quirks;
  // Peer to peer: where others fetch from it ("": relayed), whether they can reach it.
  std::string listen;
  bool unreachable = false;
  bool busy_link = false;   // reached, but what it holds never arrives within a receiver's window
  bool pushes_late = false; // no tensor pushed to it arrives in time: it fetches each, and its RESULTs say so (push_late)
  double fetch_s_per_mb = 0;  // its RESULTs say the tensors it fetched took this long a MB to come (fetch_ms)
  uint64_t fetched_bytes = 0;
  std::vector<wire::Message> received;  // everything the router sent it
};

class FakeSwarm {
 public:
  explicit FakeSwarm(CoreOptions opt = {});

  RouterCore core;
  double now = 0;
  std::map<PeerId, FakePeer> peers;
  std::vector<Log> logs;
  std::map<std::string, std::string> files;          // WriteFile, by path
  std::map<std::string, std::vector<Checkpoint>> checkpoints;  // WriteCheckpoint, by dir
  std::map<PeerId, std::vector<wire::Message>> to_clients;
  std::vector<LoadJob> loads;                        // LoadJob actions not answered yet
  double tick_s = 0.005;                             // fake time between ticks in run()
  size_t keep_received = 100000;                     // messages each peer keeps in `received`
  bool peers_listen = false;                         // peers that join from now on take fetches (peer to peer)
  bool peers_have_data = false;                      // peers that join from now on sample their own tokens at the first and last stages
  int64_t peers_memory_bytes = -1;                   // the free memory the HELLOs of peers that join from now on say (-1: none)

  // A stage server says HELLO (stage: --stage; prefer: --prefer-stage).
  PeerId join(const std::string& name, int stage = -1, int prefer = -1, double emulate = 1);
  PeerId client();
  // Submits a job spec (JSON) and answers its LoadJob with the bundled test text; returns the
  // job id (0 when refused; the refusal stays in to_clients for last_reply).
  uint64_t submit(const PeerId& client, const nlohmann::json& spec);
  // The bundled test text a spec with an empty data.path is given.
  const std::string& data_path() const { return data_path_; }
  // The last message the router sent a client (taken out).
  wire::Message last_reply(const PeerId& client);

  // Delivers a message from `from` and collects what the core does.
  void deliver(const PeerId& from, wire::Message m);
  // Runs ticks (every 5 ms of fake time) for `seconds`, heartbeating and answering as each peer
  // would, until `until` (if given) holds.
  bool run(double seconds, const std::function<bool()>& until = {});
  // A peer crashes: it stops answering and heartbeating.
  void kill(const PeerId& id) { peers.at(id).alive = false; }
  // The status of a job as `swarm status --json` shows it.
  nlohmann::json status(uint64_t job) const { return core.status_json(job, now); }
  bool logged(const std::string& text) const;

  static nlohmann::json tiny_spec(int stages = 2, int steps = 4);

 private:
  void take(Actions a);
  void answer(FakePeer& p, wire::Message& m);
  // The references of a request, fetched as a real peer would; the ERROR to answer when one fails.
  std::optional<wire::Message> fetch(FakePeer& p, const wire::Message& m, std::vector<int64_t>& fetched);
  sim::Payloads payloads_;
  std::deque<std::pair<PeerId, wire::Message>> inbox_;   // replies due at the next step
  std::multimap<double, std::pair<PeerId, wire::Message>> later_;   // replies due at a time (reply_after_s)
  double last_beat_ = -1;
  std::string data_path_;
};

}  // namespace swarm::router::testing
