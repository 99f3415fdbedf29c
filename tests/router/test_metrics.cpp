// test_metrics.cpp: what the router's core shows of itself (router/metrics.h, router/events.h):
// hop counts by stage and kind that agree with the status, latencies, round durations, the
// event timeline and its faults, log lines that name their job and peer, and an exposition
// page whose every family is declared once with its samples under it.
#include <gtest/gtest.h>

#include <regex>
#include <set>
#include <sstream>

#include "tests/support/fake_swarm.h"

namespace swarm::router {
namespace {

using nlohmann::json;
using testing::FakeSwarm;
using wire::MsgType;

std::vector<PeerId> two_by_two(FakeSwarm& f) { return {f.join("a0", 0), f.join("a1", 0), f.join("b0", 1), f.join("b1", 1)}; }
bool done(FakeSwarm& f, uint64_t job) { return f.status(job)["state"] == "done"; }

HopCounts hops(const JobMetrics& m, int stage, const std::string& kind) {
  auto it = m.hops.counts().find({stage, kind});
  return it == m.hops.counts().end() ? HopCounts{} : it->second;
}

TEST(Metrics, HopCountsAgreeWithTheStatus) {
  FakeSwarm f;
  two_by_two(f);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(2, 4));
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  const json st = f.status(job);
  const RouterMetrics m = f.core.metrics(f.now);
  ASSERT_TRUE(m.has_job);
  const JobMetrics& j = m.job;
  EXPECT_EQ(j.id, job);
  EXPECT_EQ(j.state, "done");
  EXPECT_EQ(j.completed, st["microbatches"]["completed"].get<uint64_t>());
  EXPECT_EQ(j.taken, st["microbatches"]["taken"].get<uint64_t>());
  EXPECT_EQ(j.lost, 0u);
  EXPECT_EQ(j.rounds, st["rounds"].get<uint64_t>());
  EXPECT_EQ(j.train_loss, st["train_loss"].get<double>());
  // Nothing failed: each microbatch crossed each stage once each way.
  const uint64_t mbs = j.completed;
  EXPECT_EQ(hops(j, 0, "forward").completed, mbs);
  EXPECT_EQ(hops(j, 1, "forward_loss").completed, mbs);
  EXPECT_EQ(hops(j, 0, "backward").completed, mbs);
  EXPECT_EQ(hops(j, 0, "forward").sent, mbs);
  EXPECT_EQ(hops(j, 0, "forward").resent, 0u);
  EXPECT_GT(hops(j, 1, "eval").completed, 0u);   // the final evaluation
  // Every accepted hop's latency is in its stage's histogram.
  for (int s = 0; s < 2; ++s) {
    uint64_t completed = 0;
    for (const auto& [k, c] : j.hops.counts())
      if (k.first == s) completed += c.completed;
    ASSERT_TRUE(j.hops.latency().count(s));
    EXPECT_EQ(j.hops.latency().at(s).count(), completed) << "stage " << s;
  }
  ASSERT_TRUE(j.round_seconds.count("delta"));
  EXPECT_EQ(j.round_seconds.at("delta").count(), j.rounds);
  EXPECT_EQ(m.peers.size(), 4u);
  for (const PeerMetrics& p : m.peers) {
    EXPECT_EQ(p.state, "ready");
    EXPECT_GT(p.seconds_per_unit, 0) << p.name;
  }
}

TEST(Metrics, ADeadPeerIsAFaultOnTheTimelineAndItsHopIsCountedResent) {
  FakeSwarm f;
  two_by_two(f);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(2, 2));
  f.peers.at("p-a0").silent_from = MsgType::kForward;
  ASSERT_TRUE(f.run(5, [&] {
    for (const auto& m : f.peers.at("p-a0").received)
      if (m.type == MsgType::kForward) return true;
    return false;
  }));
  f.kill("p-a0");
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  const RouterMetrics m = f.core.metrics(f.now);
  EXPECT_GE(hops(m.job, 0, "forward").resent, 1u);
  EXPECT_EQ(m.job.resent, f.status(job)["microbatches"]["resent"].get<uint64_t>());

  // The timeline: the peer joined, the job ran, the peer died, a hop went out again, the job ended.
  std::set<std::string> kinds;
  bool gone = false;
  for (const Event& e : f.core.events_since(0, Events::kKeep)) {
    kinds.insert(event_kind_name(e.kind));
    if (e.kind == EventKind::kFault && e.peer == "a0" && e.text.find("is gone") != std::string::npos) {
      gone = true;
      EXPECT_EQ(e.stage, 0);
      EXPECT_EQ(e.job, job);
    }
  }
  EXPECT_TRUE(gone);
  for (const char* k : {"peer", "job", "fault", "resend", "round", "eval"}) EXPECT_TRUE(kinds.count(k)) << k;
  // The status carries the newest events with the same fields.
  const json ev = f.status(job)["events"];
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev.back()["kind"], "job");
  EXPECT_TRUE(ev.back()["text"].get<std::string>().find("done") != std::string::npos);
  // The log line of the death names its peer and job, for a log collector.
  bool named = false;
  for (const Log& l : f.logs) named |= l.text.find("a0 (p-a0) is gone") != std::string::npos && l.peer == "a0" && l.job == job;
  EXPECT_TRUE(named);
}

TEST(Metrics, ALateResultIsCountedWhereItsRequestBelongs) {
  HopMetrics h;
  h.sent(41, 1, "backward");
  h.failed(1, "backward", false);
  h.duplicate(41);
  h.duplicate(99999);   // never sent (or forgotten): counted, without a stage
  EXPECT_EQ(h.counts().at({1, "backward"}).duplicated, 1u);
  EXPECT_EQ(h.counts().at({1, "backward"}).resent, 1u);
  EXPECT_EQ(h.counts().at({-1, "unknown"}).duplicated, 1u);
  // Only the newest kRecent requests are remembered.
  for (uint64_t i = 0; i < HopMetrics::kRecent + 10; ++i) h.sent(1000 + i, 0, "forward");
  h.duplicate(1000);
  EXPECT_EQ(h.counts().at({-1, "unknown"}).duplicated, 2u);
}

TEST(Metrics, TheEventRingKeepsTheNewestAndAnswersFromASequenceNumber) {
  Events ev;
  for (int i = 0; i < int(Events::kKeep) + 5; ++i) {
    Event e;
    e.text = std::to_string(i);
    ev.add(e);
  }
  EXPECT_EQ(ev.size(), Events::kKeep);
  EXPECT_EQ(ev.last_seq(), Events::kKeep + 5);
  const auto all = ev.since(0);
  ASSERT_EQ(all.size(), Events::kKeep);
  EXPECT_EQ(all.front().seq, 6u);   // the first five were dropped
  const auto tail = ev.since(ev.last_seq() - 3);
  ASSERT_EQ(tail.size(), 3u);
  EXPECT_EQ(tail.front().seq, ev.last_seq() - 2);
  EXPECT_TRUE(ev.since(ev.last_seq()).empty());
  EXPECT_EQ(ev.since(0, 2).size(), 2u);
  EXPECT_EQ(to_json(all.back())["job"], nullptr);
}

// Families declared once, each sample under its own family, names and labels well formed.
TEST(Metrics, ThePageDeclaresEachFamilyOnceWithItsSamplesUnderIt) {
  FakeSwarm f;
  two_by_two(f);
  const uint64_t job = f.submit(f.client(), FakeSwarm::tiny_spec(2, 4));
  ASSERT_TRUE(f.run(30, [&] { return done(f, job); }));
  const std::string page = exposition(f.core.metrics(f.now));
  std::istringstream in(page);
  const std::regex type_line(R"(# TYPE (swarm_[a-z_]+|process_[a-z_]+) (counter|gauge|histogram))");
  const std::regex sample(R"(([a-z_]+)(\{([a-z_]+="[^"\\]*(\\.[^"\\]*)*",?)*\})? (-?[0-9.e+]+|NaN|\+Inf|-Inf))");
  std::set<std::string> declared;
  std::string family, type;
  int samples = 0;
  for (std::string line; std::getline(in, line);) {
    std::smatch mt;
    if (line.rfind("# HELP ", 0) == 0) continue;
    if (std::regex_match(line, mt, type_line)) {
      family = mt[1];
      type = mt[2];
      EXPECT_TRUE(declared.insert(family).second) << family << " declared twice";
      continue;
    }
    ASSERT_TRUE(std::regex_match(line, mt, sample)) << line;
    const std::string name = mt[1];
    if (type == "histogram") EXPECT_TRUE(name == family + "_bucket" || name == family + "_sum" || name == family + "_count") << line;
    else EXPECT_EQ(name, family) << line;
    if (type == "counter") EXPECT_EQ(name.substr(name.size() - 6), "_total") << line;
    samples++;
  }
  EXPECT_GT(samples, 50);
  const std::string completed = f.status(job)["microbatches"]["completed"].dump();
  EXPECT_NE(page.find("swarm_microbatches_completed_total{job_id=\"" + std::to_string(job) + "\"} " + completed + "\n"), std::string::npos) << page;
  EXPECT_NE(page.find("swarm_job_state{job_id=\"" + std::to_string(job) + "\",state=\"done\"} 1\n"), std::string::npos);
  EXPECT_NE(page.find("swarm_hop_latency_seconds_bucket{job_id=\"" + std::to_string(job) + "\",stage=\"0\",le=\"+Inf\"}"), std::string::npos);
  EXPECT_NE(page.find("swarm_peers{stage=\"1\",state=\"ready\"} 2\n"), std::string::npos);
}

TEST(Metrics, StageServersThatServeMetricsBecomeHttpSdTargets) {
  PeerMetrics a, b;
  a.name = "gpu-a";
  a.id = "p-1";
  a.stage = 2;
  a.metrics_url = "http://10.0.0.5:9100/metrics";
  b.name = "no-http";
  const json t = http_targets({a, b});
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0]["targets"], json::array({"10.0.0.5:9100"}));
  EXPECT_EQ(t[0]["labels"]["peer"], "gpu-a");
  EXPECT_EQ(t[0]["labels"]["stage"], "2");
  EXPECT_EQ(t[0]["labels"]["__metrics_path__"], "/metrics");
}

}  // namespace
}  // namespace swarm::router
