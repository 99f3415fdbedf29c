// core.h: the router's decisions, as a state machine with no I/O (docs/architecture.md).
//
// Defines swarm::router::RouterCore, every event it takes and every action it returns.
// The core never reads a clock, a socket, a file or a random device: the time comes in as
// `now` (seconds on any monotonic clock), randomness from job seeds, and every effect goes out
// as an Action for the caller to carry out, in order: router/server.cpp does it with ZeroMQ and
// the filesystem, the simulator and the tests with nothing at all. The same events in the same
// order give the same actions.
//
// Events in:                                   Actions out:
//   restore(stored jobs)      at start           Send{to, message}
//   on_message(peer, message, who) a decoded one  Log{level, text, job, peer}
//   on_undecodable(peer, ...) one that was not    WriteFile{path, content}      (atomic, fsynced)
//   on_unreachable(peer)      a send failed       LoadJob{job, spec, resume...} (-> on_job_loaded)
//   on_job_loaded(result)     after LoadJob       WriteCheckpoint{job, dir, ...} (-> on_checkpoint_written)
//   on_checkpoint_written(r)  after WriteCheckpoint
//   tick(now)                 every few ms
//   shutdown(now)             before the server stops
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "router/events.h"
#include "router/metrics.h"
#include "router/registry.h"
#include "runtime/checkpoint.h"
#include "runtime/data.h"
#include "runtime/job_spec.h"
#include "runtime/keys.h"
#include "runtime/log.h"
#include "runtime/wire.h"

namespace swarm::router {

struct CoreOptions {
  int heartbeat_ms = 500;      // the router heartbeats peers this often; they must do the same
  int liveness = 3;            // heartbeats missed before a peer is dead (1.5 s)
  int quarantine_after = 3;    // integrity failures (corrupt, misshapen, non-finite) before quarantine
  std::string state_dir;       // jobs and their checkpoints; "" keeps nothing on disk
  size_t max_peers = limits::kMaxPeers;
  double client_idle_s = 300;  // a client session not heard from this long is forgotten
};

// ---- actions ---------------------------------------------------------------------------------

struct Send {
  PeerId to;
  wire::Message msg;
};
struct Log {
  LogLevel level = LogLevel::kInfo;
  std::string text;
  uint64_t job = 0;       // the job it is about (0: the running one, if any)
  std::string peer;       // the peer's name it is about ("" for none)
};
// Write `content` to `path` atomically (runtime/fs.h); a failure is logged by the server.
struct WriteFile {
  std::string path, content;
};
// Validate and load a job's data (and, with `resume` or `checkpoint_dir`, its checkpoint), then
// call on_job_loaded. `resume`: a path the user gave (it must hold a valid checkpoint);
// `checkpoint_dir`: the job's own dir, whose newest valid checkpoint, if any, is taken.
struct LoadJob {
  uint64_t job = 0;
  std::shared_ptr<JobSpec> spec;   // on the heap: Action stays small (it is moved on every event)
  std::string resume, checkpoint_dir;
  bool remote = false;   // submitted from another host: its files are confined to the router's roots
};
// Write a checkpoint (runtime/checkpoint.h), then call on_checkpoint_written.
struct WriteCheckpoint {
  uint64_t job = 0;
  std::string dir;
  std::shared_ptr<const Checkpoint> checkpoint;
  int keep = 3;
};
using Action = std::variant<Send, Log, WriteFile, LoadJob, WriteCheckpoint>;
using Actions = std::vector<Action>;

// ---- results of actions, and stored state ----------------------------------------------------

struct JobLoaded {
  uint64_t job = 0;
  std::shared_ptr<const TokenData> data;      // null when loading failed
  std::optional<LoadedCheckpoint> checkpoint; // the checkpoint to continue from, if any
  int64_t redone = 0;                         // microbatches taken after it (its progress.json)
  std::vector<std::string> skipped;           // damaged newer checkpoints, "PATH: why"
  std::string error;                          // what went wrong, for the person who submitted it
};
struct CheckpointWritten {
  uint64_t job = 0;
  int step = 0;
  std::string path, error;                    // error empty: written to path
  double write_s = 0;                         // how long the write took on the disk thread [s]
};
// A job of the state dir (<state dir>/jobs/<id>/job.json), as the server read it.
struct StoredJob {
  uint64_t id = 0;
  std::string state;                          // "queued", "running", "done", ...
  nlohmann::json spec;
  std::string checkpoint_dir;
};

class RouterCore {
 public:
  explicit RouterCore(CoreOptions opt);
  ~RouterCore();
  RouterCore(const RouterCore&) = delete;
  RouterCore& operator=(const RouterCore&) = delete;

  Actions restore(std::vector<StoredJob> jobs, double now);
  // `who`: the sender as the transport authenticated it (CURVE: its key and role, from the
  // router's authorized file); Identity::anyone() on a router without keys.
  Actions on_message(const PeerId& from, wire::Message m, double now, const Identity& who = Identity::anyone());
  Actions on_undecodable(const PeerId& from, const WireError& e, std::optional<uint64_t> id, double now);
  Actions on_unreachable(const PeerId& peer, double now);
  Actions on_job_loaded(JobLoaded r, double now);
  Actions on_checkpoint_written(CheckpointWritten r, double now);
  Actions tick(double now);
  Actions shutdown(double now);

  // Whether `from` may send a message of this type: anything from a registered stage server or
  // client, only HELLO from anyone else. The server asks before it decodes a body or a tensor.
  bool accepts(const PeerId& from, wire::MsgType type) const;
  // Whether `to` said in its HELLO that it takes a large message in PARTs (wire::split_parts):
  // the server sends it so, and anyone else whole.
  bool takes_parts(const PeerId& to) const;
  // `swarm status --json` and `swarm peers --json` as the core sees them now.
  nlohmann::json status_json(std::optional<uint64_t> job, double now) const;
  nlohmann::json peers_json(size_t offset, size_t limit, double now) const;
  // What /metrics shows, as plain data (router/metrics.h): the router, its peers, and the job
  // `swarm status` shows by default.
  RouterMetrics metrics(double now) const;
  // The kept events after `seq` (router/events.h), oldest first, at most `max` of the newest.
  std::vector<Event> events_since(uint64_t seq, size_t max) const;
  // The job that is loading or running (0: none): the job a log line is about by default.
  uint64_t active_job() const;
  const Registry& registry() const;
  uint64_t bad_messages() const;
  // Checks every invariant of the core's state with SWARM_CHECK (tests and fuzzing): every
  // microbatch waiting on a request has that request pending, no job has more microbatches in
  // flight than its max_inflight, no request is held by a peer that is gone, sizes are bounded.
  void check_invariants() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace swarm::router
