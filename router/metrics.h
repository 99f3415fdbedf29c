// metrics.h: what the router's /metrics page shows, as plain data the core fills, and the page.
//
// Defines swarm::router::HopCounts, HopMetrics (a job's hops by stage and kind, and their
// latency), JobMetrics (one job's counters, gauges and histograms), PeerMetrics, RouterMetrics
// (what RouterCore::metrics returns: no I/O, no clock of its own) and the two pure functions
// the server turns them into pages with: `exposition` (the Prometheus text format, names in
// docs/observability.md) and `http_targets` (Prometheus http_sd: the stage servers' own /metrics).
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/metrics.h"

namespace swarm::router {

struct HopCounts {
  uint64_t sent = 0, completed = 0, resent = 0, duplicated = 0, rejected = 0;
};

// A job's hops. Kinds: "forward", "forward_loss", "backward", "eval" ("echo" for the transport
// benchmark). `resent`: a hop that failed (error, deadline, its peer gone) and goes out again;
// `rejected`: the peer answered with an error or a result that was not acceptable;
// `duplicated`: a result for a request no longer pending (late, or sent twice).
class HopMetrics {
 public:
  HopMetrics() = default;
  // Remembers the request's labels (the newest kRecent) so that a late duplicate is counted
  // where it belongs.
  void sent(uint64_t request, int stage, const char* kind);
  void completed(int stage, const char* kind, double latency_s);
  void failed(int stage, const char* kind, bool rejected);
  void duplicate(uint64_t request);
  const std::map<std::pair<int, std::string>, HopCounts>& counts() const { return counts_; }
  const std::map<int, metrics::Histogram>& latency() const { return latency_; }   // by stage [s]
  static constexpr size_t kRecent = 8192;

 private:
  HopCounts& at(int stage, const char* kind);
  std::map<std::pair<int, std::string>, HopCounts> counts_;
  std::map<int, metrics::Histogram> latency_;
  // counts_ entries by (stage, kind pointer): kinds are static strings, so a hop finds its
  // counters with one hash lookup and builds no string. A cache: a copy starts it empty (its
  // pointers point into the original's counts_).
  struct Label {
    int stage = 0;
    const char* kind = nullptr;
    bool operator==(const Label& o) const { return stage == o.stage && kind == o.kind; }
  };
  struct LabelHash {
    size_t operator()(const Label& l) const { return std::hash<const void*>()(l.kind) ^ (size_t(l.stage) * 0x9e3779b97f4a7c15ull); }
  };
  struct ByLabel {
    std::unordered_map<Label, HopCounts*, LabelHash> at;
    ByLabel() = default;
    ByLabel(const ByLabel&) {}
    ByLabel& operator=(const ByLabel&) {
      at.clear();
      return *this;
    }
  } by_label_;
  // The labels of the newest requests, at request id % kRecent (a ring: no allocation per hop).
  struct Recent {
    uint64_t request = 0;
    Label label;
  };
  std::vector<Recent> recent_;
};

struct JobMetrics {
  uint64_t id = 0;
  std::string name;
  std::string state;                       // job_state_name
  std::string kind = "train";              // "train" or "transport"
  int step = 0, steps = 0;
  uint64_t taken = 0, completed = 0, resent = 0, duplicates = 0, rejected = 0, lost = 0;
  double train_loss = NAN, val_loss = NAN;
  double tokens_per_s = 0;                 // since the job ran, as the status says
  uint64_t tokens = 0;                     // training tokens completed since this router took the job
  uint64_t rounds = 0;
  // Wire bytes of training that crossed a link, by direction, and their codecs.
  uint64_t bytes_activations = 0, bytes_gradients = 0, bytes_outer = 0, bytes_through_router = 0;
  std::string codec_activations, codec_gradients, codec_outer;
  double codec_s[4] = {0, 0, 0, 0};        // activations encode, decode; gradients encode, decode [s], all peers
  uint64_t backward_cached = 0, backward_recomputed = 0;
  uint64_t fetch_failures = 0, relayed_by_router = 0, remade = 0;
  uint64_t integrity_failures = 0, timeouts = 0, quarantines = 0, skipped_steps = 0;
  std::map<std::tuple<int, int, std::string>, uint64_t> moves;   // (from, to, reason) -> rebalancer moves
  uint64_t checkpoints_written = 0, checkpoint_failures = 0;
  metrics::Histogram checkpoint_seconds{metrics::duration_buckets()};          // writing one, on the disk thread
  std::map<std::string, metrics::Histogram> round_seconds;                     // "delta" / "grad": begin to end
  std::vector<double> stage_samples_per_s;                                     // as the router models it
  HopMetrics hops;
};

struct PeerMetrics {
  std::string id, name, state, device, label;  // label: the emulation profile or factor, "" for none
  std::string metrics_url;                     // its own /metrics (swarm-stage --http), "" for none
  int stage = -1;
  double seconds_per_unit = 0;                 // measured (0: not yet)
  double queued_units = 0;                     // work sent and not answered
  uint64_t inbox = 0;                          // requests waiting in the peer, from its heartbeat
  double heartbeat_age_s = 0;                  // since the router last heard from it
  uint64_t results = 0, failures = 0, timeouts = 0, integrity_failures = 0;
  bool banned = false, relayed = false;
};

// What the server loop around the core counts (router/server.cpp): the messages it took in and
// sent, and the seconds spent inside the core's handlers; the rest of the process's CPU
// (process_cpu_seconds_total) is ZeroMQ, CURVE, framing and checksums.
struct ServerCounters {
  uint64_t messages_in = 0, messages_out = 0;
  double core_s = 0;
};

struct RouterMetrics {
  double uptime_s = 0;
  uint64_t bad_messages = 0, bans = 0, clients = 0, jobs = 0;
  ServerCounters server;
  std::vector<PeerMetrics> peers;
  bool has_job = false;
  JobMetrics job;                              // the job `swarm status` shows by default (the newest)
};

// The /metrics page (Prometheus text exposition, version 0.0.4), with the process's own figures.
std::string exposition(const RouterMetrics& m);
// http_sd targets of the stage servers that serve /metrics: [{"targets": ["HOST:PORT"],
// "labels": {"peer": NAME, "stage": "N", "__metrics_path__": PATH}}].
nlohmann::json http_targets(const std::vector<PeerMetrics>& peers);

}  // namespace swarm::router
