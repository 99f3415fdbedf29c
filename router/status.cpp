// status.cpp: what `swarm status --json` and /metrics show of a training job
// (TrainingJob::status, TrainingJob::metrics), the routing figures as the router models them,
// and Job's shared parts.
#include <algorithm>
#include <cmath>

#include "router/training_job.h"

namespace swarm::router {

namespace {

nlohmann::json number_or_null(double v) { return std::isnan(v) ? nlohmann::json(nullptr) : nlohmann::json(v); }

}  // namespace

const char* job_state_name(JobState s) {
  switch (s) {
    case JobState::kQueued: return "queued";
    case JobState::kLoading: return "loading";
    case JobState::kRunning: return "running";
    case JobState::kDone: return "done";
    case JobState::kFailed: return "failed";
    case JobState::kCancelled: return "cancelled";
  }
  return "?";
}

void Job::finish(Ctx& c, JobState st, const std::string& reason) {
  state_ = st;
  reason_ = reason;
  finished_s_ = c.now;
  c.event(EventKind::kJob, st == JobState::kDone ? LogLevel::kInfo : LogLevel::kWarn,
          "job " + std::to_string(id_) + " " + job_state_name(st) + (reason.empty() ? "" : ": " + reason), id_);
}

nlohmann::json TrainingJob::status(const Registry& peers, double now) const {
  // Bytes counted since this router took the job, over the samples trained since then.
  const uint64_t trained = (completed_ - resumed_at_) * uint64_t(spec_.batch.microbatch_size);
  auto per_sample = [&](uint64_t bytes) { return trained ? double(bytes) / double(trained) : 0.0; };
  nlohmann::json peers_per_stage = nlohmann::json::array();
  for (int s = 0; s < S_; ++s) peers_per_stage.push_back(peers.stage_peers(id_, s, now).size());
  const double elapsed = elapsed_s(now);
  // Throughput as the router models it (samples/s): per stage, the bottleneck, and the best
  // assignment of these peers (the benchmarks' ideal).
  nlohmann::json routing{{"mode", routing_mode_name(spec_.routing.mode)}, {"moves", moves_}, {"rebalance", rebalance_reason_}};
  {
    const swarm::Registry reg = placement_view(peers, now);
    const std::vector<double> tp = stage_throughputs(reg);
    std::vector<double> speeds;
    for (const auto& p : reg.peers)
      if (p.speed > 0 && std::isfinite(p.speed)) speeds.push_back(p.speed);
    routing["stage_samples_per_s"] = tp;
    routing["min_stage_samples_per_s"] = tp.empty() ? 0.0 : *std::min_element(tp.begin(), tp.end());
    routing["ideal_samples_per_s"] =
        speeds.size() >= size_t(S_) && speeds.size() == reg.peers.size() ? ideal_min_throughput(speeds, reg.stage_cost) : 0.0;
  }
  const nlohmann::json rounds = rounds_.status();
  uint64_t in_flight = 0;   // training microbatches taken and not completed (evaluation ones apart)
  for (const auto& [key, f] : flights_.all()) in_flight += !f.eval;
  nlohmann::json s{{"job_id", id_},
                   {"name", name_},
                   {"state", job_state_name(state_)},
                   {"reason", reason_},
                   {"step", steps_done_},
                   {"steps", spec_.steps},
                   {"stages", S_},
                   {"peers_per_stage", peers_per_stage},
                   {"train_loss", number_or_null(train_loss_)},
                   {"val_loss", number_or_null(val_loss_)},
                   {"unigram_loss", unigram_},
                   {"tokens_per_s", tokens_per_s(now)},
                   {"elapsed_s", elapsed},
                   {"rounds", rounds["rounds"]},
                   {"fragment_syncs", rounds["fragment_syncs"]},
                   {"state_hashes", rounds["state_hashes"]},
                   {"hash_mismatches", rounds["hash_mismatches"]},
                   {"outer_peer_bytes", rounds["outer_peer_bytes"]},
                   {"outliers", rounds["outliers"]},
                   {"routing", routing},
                   {"sync_bytes_per_sample", per_sample(rounds_.bytes_outer)},
                   {"microbatches", {{"taken", taken_}, {"completed", completed_}, {"in_flight", in_flight}, {"max_inflight", spec_.max_inflight},
                                     {"waiting", flights_.waiting()}, {"resent", resent()},
                                     {"duplicates", duplicates()}, {"rejected", rejected()}, {"lost", lost()}}},
                   {"backward", {{"cached", flights_.cached}, {"recomputed", flights_.recomputed}}},
                   {"wire_bytes", {{"activations", flights_.bytes_act}, {"gradients", flights_.bytes_grad}, {"outer", rounds_.bytes_outer}}},
                   {"hops", {{"mode", hops_name(spec_.routing.hops)}, {"bytes_through_router", flights_.bytes_relayed},
                             {"fetch_failures", flights_.fetch_failures}, {"pushed", flights_.pushes}, {"relayed_by_router", flights_.uploads},
                             {"remade", flights_.remade}, {"token_bytes", flights_.bytes_tokens}, {"own_tokens", flights_.own_tokens}}},
                   {"wire_bytes_per_sample", {{"activations", per_sample(flights_.bytes_act)}, {"gradients", per_sample(flights_.bytes_grad)}}},
                   {"codec_ms", {{"activations", {{"encode", codec_us_[0] / 1000}, {"decode", codec_us_[1] / 1000}}},
                                 {"gradients", {{"encode", codec_us_[2] / 1000}, {"decode", codec_us_[3] / 1000}}}}},
                   {"integrity_failures", integrity_failures_},
                   {"skipped_steps", skipped_steps_},
                   {"timeouts", timeouts_},
                   {"quarantined", quarantined_},
                   {"stage_restores", restores_},
                   {"resumed", resumed_},
                   {"checkpoints", dur_.status()}};
  // The most recent entries: a status reply stays within the wire's array limit.
  constexpr size_t kHistory = 4096;
  const size_t from = history_.size() > kHistory ? history_.size() - kHistory : 0;
  s["history"] = nlohmann::json(std::vector<nlohmann::json>(history_.begin() + long(from), history_.end()));
  return s;
}

void Job::metrics(JobMetrics& m, const Registry& peers, double now) const {
  m.id = id_;
  m.name = name_;
  m.state = job_state_name(state_);
}

void TrainingJob::metrics(JobMetrics& m, const Registry& peers, double now) const {
  Job::metrics(m, peers, now);
  m.step = steps_done_;
  m.steps = spec_.steps;
  m.taken = taken_;
  m.completed = completed_;
  m.resent = resent();
  m.duplicates = duplicates();
  m.rejected = rejected();
  m.lost = lost();
  m.train_loss = train_loss_;
  m.val_loss = val_loss_;
  m.tokens_per_s = tokens_per_s(now);
  m.tokens = uint64_t(train_tokens_);
  m.rounds = rounds_.count();
  m.bytes_activations = flights_.bytes_act;
  m.bytes_gradients = flights_.bytes_grad;
  m.bytes_outer = rounds_.bytes_outer;
  m.bytes_through_router = flights_.bytes_relayed;
  m.codec_activations = spec_.compression.activations;
  m.codec_gradients = spec_.compression.gradients;
  m.codec_outer = spec_.compression.outer;
  for (int k = 0; k < 4; ++k) m.codec_s[k] = codec_us_[k] / 1e6;
  m.backward_cached = flights_.cached;
  m.backward_recomputed = flights_.recomputed;
  m.fetch_failures = flights_.fetch_failures;
  m.relayed_by_router = flights_.uploads;
  m.remade = flights_.remade;
  m.integrity_failures = integrity_failures_;
  m.timeouts = timeouts_;
  m.quarantines = quarantined_.size();
  m.skipped_steps = skipped_steps_;
  m.moves = move_counts_;
  m.checkpoints_written = dur_.written();
  m.checkpoint_failures = dur_.failed();
  m.checkpoint_seconds = dur_.write_seconds();
  m.round_seconds = rounds_.durations();
  m.stage_samples_per_s = stage_throughputs(placement_view(peers, now));
  m.hops = flights_.hop_metrics;
}

}  // namespace swarm::router
