// clients.cpp: the client side of the router core (router/core_impl.h): SUBMIT (a job is
// created, its data loaded off the router's thread, then it joins the queue), STATUS, CANCEL,
// CHAOS, and the JSON that STATUS and PEERS answer with.
#include <algorithm>
#include <filesystem>

#include "router/core_impl.h"
#include "router/echo_job.h"
#include "router/training_job.h"
#include "runtime/fault.h"
#include "runtime/text.h"

namespace swarm::router {

using wire::MsgType;

void RouterCore::Impl::on_submit(Ctx& c, const PeerId& from, const wire::Message& m, const Identity& who) {
  const msg::Submit s = msg::read<msg::Submit>(m);
  if (jobs.size() >= limits::kMaxJobs) {
    auto it = std::find_if(jobs.begin(), jobs.end(), [](const auto& j) { return job_finished(j->state()); });
    if (it == jobs.end())
      return reply_error(c, from, &m, WireErrc::kTooLarge, "the router holds " + std::to_string(jobs.size()) + " unfinished jobs, its limit");
    owners.erase((*it)->id());
    jobs.erase(it);
  }
  if (s.bench_transport) {
    const msg::BenchTransport t = s.bench();
    owners[next_job_id] = who.key;
    jobs.push_back(std::make_unique<EchoJob>(next_job_id++, t));
    msg::Submitted ok;
    ok.job_id = jobs.back()->id();
    c.send(from, msg::make(ok, m.id, m.attempt));
    c.info("job " + std::to_string(ok.job_id) + " (transport benchmark) submitted");
    return;
  }
  if (!s.spec) return reply_error(c, from, &m, WireErrc::kMalformed, "SUBMIT needs a job spec (spec) or bench_transport");
  JobSpec spec;
  try {
    spec = parse_job_spec(*s.spec, /*check_files=*/false);
  } catch (const SpecError& e) {
    msg::Error err;
    err.code = int32_t(WireErrc::kMalformed);
    err.name = "bad_job_spec";
    err.message = e.what();
    err.request_type = int32_t(m.type);
    return c.send(from, msg::make(err, m.id, m.attempt));
  }
  const uint64_t id = next_job_id++;
  owners[id] = who.key;
  queue_load(c, id, std::move(spec), Submitter{from, m.id, m.attempt, s.resume, who.remote}, "");
}

// A job is created now (its id fixes its place in the queue) and runs once its data is loaded.
void RouterCore::Impl::queue_load(Ctx& c, uint64_t id, JobSpec spec, Submitter who, std::string checkpoint_dir) {
  auto job = std::make_unique<TrainingJob>(id, spec);
  Durability& d = job->durability();
  if (!opt.state_dir.empty()) {
    d.job_dir = opt.state_dir + "/jobs/" + std::to_string(id);
    if (d.checkpoint_dir.empty()) d.checkpoint_dir = d.job_dir + "/checkpoints";
  }
  if (!checkpoint_dir.empty()) d.checkpoint_dir = checkpoint_dir;
  LoadJob load{id, std::make_shared<JobSpec>(std::move(spec)), who.resume, who.resume.empty() && who.client.empty() ? d.checkpoint_dir : "", who.remote};
  loading[id] = std::move(who);
  jobs.push_back(std::move(job));
  c.out.push_back(std::move(load));
}

void RouterCore::Impl::on_loaded(Ctx& c, JobLoaded r) {
  auto it = loading.find(r.job);
  if (it == loading.end()) return;
  const Submitter who = it->second;
  loading.erase(it);
  auto jt = std::find_if(jobs.begin(), jobs.end(), [&](const auto& j) { return j->id() == r.job; });
  if (jt == jobs.end()) return;
  auto* job = static_cast<TrainingJob*>(jt->get());
  if (r.error.empty() && r.checkpoint && !who.resume.empty()) {
    const nlohmann::json& old = r.checkpoint->ckpt.spec;
    for (const char* key : {"model", "partition", "batch", "seed"})
      if (!old.contains(key) || old[key] != job->spec_json()[key])
        r.error = std::string("--resume ") + who.resume + ": the job's \"" + key + "\" differs from the checkpoint's (" +
                  (old.contains(key) ? shown_json(old[key]) : "missing") + "); resume with the spec the checkpoint was written with";
    if (job->durability().checkpoint_dir.empty())
      job->durability().checkpoint_dir = std::filesystem::path(r.checkpoint->path).parent_path().string();
  }
  if (!r.error.empty() || !r.data) {
    owners.erase(r.job);
    jobs.erase(jt);
    if (who.client.empty()) {
      c.log(LogLevel::kError, "job " + std::to_string(r.job) + " in the state dir cannot continue: " + r.error);
      return;
    }
    msg::Error err;
    err.code = int32_t(WireErrc::kMalformed);
    err.name = "bad_job_spec";
    err.message = r.error;
    err.request_type = int32_t(MsgType::kSubmit);
    return c.send(who.client, msg::make(err, who.id, who.attempt));
  }
  job->loaded(c, r);
  job->persist(c);
  if (!who.client.empty()) {
    msg::Submitted ok;
    ok.job_id = r.job;
    c.send(who.client, msg::make(ok, who.id, who.attempt));
    c.info("job " + std::to_string(r.job) + " '" + job->name() + "' submitted");
  } else {
    if (!r.checkpoint) c.warn("job " + std::to_string(r.job) + " has no valid checkpoint in " + job->durability().checkpoint_dir + "; it starts again from step 0");
    c.info("job " + std::to_string(r.job) + " '" + job->name() + "' picked up from the state dir");
  }
}

nlohmann::json RouterCore::Impl::status_of(const Job* j, double now) const {
  nlohmann::json body = j ? j->status(peers, now) : nlohmann::json{{"state", "none"}};
  body["router"] = {{"peers", peers.size()}, {"jobs", jobs.size()}, {"bad_messages", bad_messages}, {"uptime_s", now}};
  // The newest events (router/events.h), the dashboard's timeline; /api/events streams them all.
  nlohmann::json ev = nlohmann::json::array();
  for (const Event& e : events.since(0, kStatusEvents)) ev.push_back(to_json(e));
  body["events"] = std::move(ev);
  return body;
}

void RouterCore::Impl::on_status(Ctx& c, const PeerId& from, const wire::Message& m, const Identity& who) {
  const msg::Status s = msg::read<msg::Status>(m);
  Job* j = nullptr;
  if (s.job_id) {
    j = find_job(*s.job_id);
  } else {
    for (auto it = jobs.rbegin(); it != jobs.rend() && !j; ++it)  // the newest job it may see
      if (owns(who, (*it)->id())) j = it->get();
  }
  if (s.job_id && !j) return reply_error(c, from, &m, WireErrc::kMalformed, "no job " + std::to_string(*s.job_id) + " on this router");
  if (j && !owns(who, j->id()))
    return bad(c, from, &m, WireErrc::kForbidden, "job " + std::to_string(j->id()) + " belongs to another client; seeing it needs the role admin");
  c.send(from, wire::json_message(MsgType::kStatusReply, m.id, m.attempt, status_of(j, c.now)));
}

void RouterCore::Impl::on_cancel(Ctx& c, const PeerId& from, const wire::Message& m, const Identity& who) {
  const msg::Cancel cl = msg::read<msg::Cancel>(m);
  Job* j = find_job(cl.job_id);
  if (!j) return reply_error(c, from, &m, WireErrc::kMalformed, "no job " + std::to_string(cl.job_id) + " on this router");
  if (!owns(who, j->id()))
    return bad(c, from, &m, WireErrc::kForbidden, "job " + std::to_string(j->id()) + " belongs to another client; cancelling it needs the role admin");
  if (!job_finished(j->state())) end_job(c, *j, JobState::kCancelled, "cancelled by " + (who.authenticated ? who.name : std::string("a client")));
  c.send(from, wire::json_message(MsgType::kStatusReply, m.id, m.attempt, status_of(j, c.now)));
}

// `swarm chaos`: a fault for a live peer, named by id or name. The spec is checked here, so a
// typo is an error for the user, not a log line on a remote host.
void RouterCore::Impl::on_chaos(Ctx& c, const PeerId& from, const wire::Message& m) {
  const msg::Chaos ch = msg::read<msg::Chaos>(m);
  FaultSpec spec;
  try {
    spec = parse_fault_json(ch.fault);
  } catch (const InputError& e) {
    return reply_error(c, from, &m, WireErrc::kMalformed, std::string("bad fault: ") + e.what());
  }
  // An id (bin, or a str equal to an id) first; a str that is no id names a peer.
  Peer* target = peers.find(ch.peer);
  if (!target && ch.peer_is_id) return reply_error(c, from, &m, WireErrc::kMalformed, "no peer with id " + wire::printable_id(ch.peer) + "; `swarm peers` lists them");
  if (!target) {
    std::vector<Peer*> named;
    for (auto& [id, p] : peers.all())
      if (p.hello.name == ch.peer) named.push_back(&p);
    if (named.size() > 1)
      return reply_error(c, from, &m, WireErrc::kMalformed, std::to_string(named.size()) + " peers are named \"" + ch.peer + "\"; name one by its id (`swarm peers`)");
    if (named.empty()) return reply_error(c, from, &m, WireErrc::kMalformed, "no peer \"" + ch.peer + "\"; `swarm peers` lists them");
    target = named[0];
  }
  msg::Chaos fwd;
  fwd.fault = to_json(spec);
  c.send(target->id, msg::make(fwd, requests.reserve_id()));
  c.event(EventKind::kFault, LogLevel::kWarn, "chaos: fault " + to_string(spec) + " sent to peer " + target->hello.name, target->job_id,
          target, target->stage);
  msg::ChaosReply rep;
  rep.peer = target->id;
  rep.name = target->hello.name;
  rep.fault = to_string(spec);
  c.send(from, msg::make(rep, m.id, m.attempt));
}

nlohmann::json RouterCore::status_json(std::optional<uint64_t> job, double now) const {
  const Job* j = nullptr;
  for (const auto& q : impl_->jobs)
    if (!job || q->id() == *job) j = q.get();
  return impl_->status_of(j, now);
}

RouterMetrics RouterCore::metrics(double now) const {
  const Impl& I = *impl_;
  RouterMetrics m;
  m.uptime_s = now;
  m.bad_messages = I.bad_messages;
  m.bans = I.peers.bans_total();
  m.clients = I.clients.size();
  m.jobs = I.jobs.size();
  for (const auto& [id, p] : I.peers.all()) {
    PeerMetrics pm;
    pm.id = id;
    pm.name = p.hello.name;
    pm.state = peer_state_name(p.state);
    pm.device = p.hello.device_name.empty() ? p.hello.device : p.hello.device_name;
    pm.label = !p.hello.profile.empty() ? p.hello.profile : p.hello.emulate > 1 ? std::to_string(p.hello.emulate) + "x" : "";
    pm.metrics_url = p.hello.metrics;
    pm.stage = p.stage;
    pm.seconds_per_unit = p.ms_per_unit / 1000;
    pm.queued_units = p.queued_units;
    pm.inbox = p.heartbeat.queue;
    pm.heartbeat_age_s = std::max(0.0, now - p.last_seen_s);
    pm.results = p.results;
    pm.failures = p.failures;
    pm.timeouts = p.timeouts;
    pm.integrity_failures = p.integrity_failures;
    pm.banned = I.peers.banned(p, now);
    pm.relayed = !p.can_hold();
    m.peers.push_back(std::move(pm));
  }
  // The job `swarm status` shows without --job: the newest.
  if (!I.jobs.empty()) {
    m.has_job = true;
    I.jobs.back()->metrics(m.job, I.peers, now);
  }
  return m;
}

std::vector<Event> RouterCore::events_since(uint64_t seq, size_t max) const { return impl_->events.since(seq, max); }

uint64_t RouterCore::active_job() const {
  for (const auto& j : impl_->jobs)
    if (j->active()) return j->id();
  return 0;
}

nlohmann::json RouterCore::peers_json(size_t offset, size_t limit, double now) const {
  nlohmann::json list = nlohmann::json::array();
  const auto& all = impl_->peers.all();
  size_t i = 0;
  for (const auto& [id, p] : all) {
    if (i++ < offset) continue;
    if (list.size() >= std::min(limit, limits::kMaxPeersPerReply)) break;
    const msg::Heartbeat& hb = p.heartbeat;
    list.push_back({{"id", wire::id_json(id)}, {"name", p.hello.name}, {"device", p.hello.device}, {"device_name", p.hello.device_name},
                    {"device_memory_bytes", p.hello.device_memory_bytes ? nlohmann::json(*p.hello.device_memory_bytes) : nlohmann::json(nullptr)},
                    {"device_memory_free_bytes", p.hello.device_memory_free_bytes ? nlohmann::json(*p.hello.device_memory_free_bytes) : nlohmann::json(nullptr)},
                    {"precision", p.hello.precision},
                    {"stage", p.stage}, {"requested_stage", p.hello.stage}, {"preferred_stage", p.hello.prefer_stage},
                    {"state", peer_state_name(p.state)}, {"job_id", p.job_id}, {"emulate", p.hello.emulate},
                    {"profile", p.hello.profile}, {"echo", p.hello.echo}, {"ms_per_unit", p.ms_per_unit},
                    {"turnaround_ms", p.turnaround_ms}, {"listen", p.hello.listen}, {"relayed", !p.can_hold()}, {"pushed_to", p.can_hold() && !p.no_push.on},
                    {"s_per_mb", p.s_per_mb > 0 ? nlohmann::json(p.s_per_mb) : nlohmann::json(nullptr)}, {"metrics", p.hello.metrics},
                    {"queued_units", p.queued_units}, {"results", p.results}, {"failures", p.failures},
                    {"integrity_failures", p.integrity_failures}, {"timeouts", p.timeouts},
                    {"banned_s", std::max(0.0, p.banned_until_s - now)}, {"last_seen_s", now - p.last_seen_s},
                    {"heartbeat", {{"stage", hb.stage}, {"job_id", hb.job_id}, {"ready", hb.ready}, {"queue", hb.queue},
                                   {"ms_per_unit", hb.ms_per_unit}, {"forwards", hb.forwards}, {"backwards", hb.backwards},
                                   {"cache_hits", hb.cache_hits}, {"recomputes", hb.recomputes},
                                   {"cache_entries", hb.cache_entries ? nlohmann::json(*hb.cache_entries) : nlohmann::json(nullptr)}, {"steps", hb.steps},
                                   {"errors", hb.errors}, {"overflows", hb.overflows}, {"skipped_steps", hb.skipped_steps},
                                   {"loss_scale", hb.loss_scale}}}});
  }
  return {{"peers", list}, {"total", all.size()}, {"offset", offset}};
}

}  // namespace swarm::router
