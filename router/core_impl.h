// core_impl.h: the state of RouterCore (router/core.h), shared by the files that implement it:
// core.cpp (sessions, replies to the router's requests, deadlines, the job queue) and
// clients.cpp (SUBMIT, STATUS, CANCEL, CHAOS, PEERS and loading a job's data). Private to the
// router.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "router/core.h"
#include "router/job.h"

namespace swarm::router {

// Events a status carries (the dashboard's timeline); /api/events streams every kept one.
constexpr size_t kStatusEvents = 200;

struct RouterCore::Impl {
  CoreOptions opt;
  Registry peers;
  Requests requests;
  struct Session {
    double last_s = 0;                     // last heard [s]
    Identity who;                          // as authenticated when it said HELLO
    bool parts = false;                    // it takes a large reply in PARTs (HELLO.parts)
  };
  std::map<PeerId, Session> clients;       // client sessions
  std::map<uint64_t, std::string> owners;  // job id -> the key that submitted it ("" without keys)
  std::vector<std::unique_ptr<Job>> jobs;  // in submission order
  struct Submitter {
    PeerId client;                         // "" for a job restored from the state dir
    uint64_t id = 0;
    uint32_t attempt = 0;
    std::string resume;
    bool remote = false;
  };
  std::map<uint64_t, Submitter> loading;   // jobs whose data is being loaded
  uint64_t next_job_id = 1;
  uint64_t running = 0;                    // the job that was active after the last event
  uint64_t bad_messages = 0;
  double last_beat_s = -1e300;
  double last_release_s = -1e300;
  std::vector<PeerId> releasing;   // peers with keys to RELEASE (Peer::to_release), sent by tick in id order
  Events events;                           // the timeline: the status's `events`, /api/events

  explicit Impl(CoreOptions o) : opt(std::move(o)), peers(opt.heartbeat_ms, opt.liveness) {}
  Ctx ctx(double now, Actions& out) {
    out.reserve(4);   // most events send a request or two: one allocation, no moves
    return Ctx{now, opt, peers, requests, out, releasing, events};
  }

  Job* find_job(uint64_t id) {
    for (auto& j : jobs)
      if (j->id() == id) return j.get();
    return nullptr;
  }
  Job* active_job() {
    for (auto& j : jobs)
      if (j->active()) return j.get();
    return nullptr;
  }
  void reply_error(Ctx& c, const PeerId& to, const wire::Message* req, WireErrc code, const std::string& text) {
    c.send(to, msg::error_reply(req, code, text));
  }
  // A message that breaks the protocol: counted, answered, dropped.
  void bad(Ctx& c, const PeerId& from, const wire::Message* m, WireErrc code, const std::string& text) {
    bad_messages++;
    reply_error(c, from, m, code, text);
  }
  std::string name_of(const PeerId& id) const {
    const Peer* p = peers.find(id);
    return p ? p->hello.name : id;
  }

  // core.cpp: sessions, replies, the job queue.
  void peer_dead(Ctx& c, const PeerId& id, const std::string& why);
  void on_hello(Ctx& c, const PeerId& from, const wire::Message& m, const Identity& who);
  // The role check of a client request: false (and the sender told which role it needs) when
  // `who` may not do it.
  bool permitted(Ctx& c, const PeerId& from, const wire::Message& m, const Identity& who, bool client_ok);
  // Whether `who` may see or cancel job `id`: admins any, clients their own.
  bool owns(const Identity& who, uint64_t id) const;
  // PEER_KEYS: which stage servers may fetch from which (CURVE swarms).
  void share_keys(Ctx& c, const Peer& joined);
  void withdraw_key(Ctx& c, const Peer& gone);
  void on_reply(Ctx& c, Peer& p, wire::Message& m);
  void on_error_reply(Ctx& c, Peer& p, const Pending& pd, Job& j, const wire::Message& m);
  void end_job(Ctx& c, Job& j, JobState st, const std::string& why);
  void drop_requests(Ctx& c, const Job& j);
  void advance_jobs(Ctx& c, bool offer_idle = false);
  void send_releases(Ctx& c);

  // clients.cpp: client requests and job intake.
  void on_submit(Ctx& c, const PeerId& from, const wire::Message& m, const Identity& who);
  // A job is created now (its id fixes its place in the queue) and runs once its data is loaded.
  void queue_load(Ctx& c, uint64_t id, JobSpec spec, Submitter who, std::string checkpoint_dir);
  void on_loaded(Ctx& c, JobLoaded r);
  nlohmann::json status_of(const Job* j, double now) const;
  void on_status(Ctx& c, const PeerId& from, const wire::Message& m, const Identity& who);
  void on_cancel(Ctx& c, const PeerId& from, const wire::Message& m, const Identity& who);
  void on_chaos(Ctx& c, const PeerId& from, const wire::Message& m);
};

}  // namespace swarm::router
