// echo_job.h: the transport benchmark as a job: payloads that originate in the router's
// dispatcher go to echo stage servers (`swarm-stage --echo`) and back (swarm bench transport).
//
// Defines swarm::router::EchoJob: `count` FORWARDs of one f32 tensor of `bytes` bytes (every
// byte 0x3c), at most `inflight` at a time, through the same flights, dispatcher and deadlines
// as training hops; each echoed RESULT completes one.
#pragma once

#include "router/flights.h"

namespace swarm::router {

class EchoJob : public Job {
 public:
  EchoJob(uint64_t id, const msg::BenchTransport& t);

  bool wants(const Peer& p) const override { return p.hello.echo; }
  void start(Ctx& c) override;
  void offer(Ctx& c, Peer& p) override;
  void on_peer_gone(Ctx& c, const Peer& p) override {}
  void on_reply(Ctx& c, Peer& p, const Pending& pd, wire::Message& m) override;
  void on_failed(Ctx& c, const Pending& pd, bool error, int bad_tensor, const std::string& why) override;
  void advance(Ctx& c) override;
  nlohmann::json status(const Registry& peers, double now) const override;
  void metrics(JobMetrics& m, const Registry& peers, double now) const override;
  void duplicate(uint64_t request) override { flights_.duplicate(request); }
  void finish(Ctx& c, JobState st, const std::string& reason) override;
  void check(const Requests& r) const override;

 private:
  void load(Ctx& c, Peer& p);
  msg::BenchTransport bench_;
  Flights flights_;
  wire::Tensor payload_;
  int64_t taken_ = 0, done_ = 0;
};

}  // namespace swarm::router
