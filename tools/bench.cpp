// bench.cpp: the benchmarks behind `swarm bench` (see bench.h).
//
// transport: payloads that originate in the router's dispatcher go to an echo stage server
//   and back, against a bare ZeroMQ PUSH/PULL pair on loopback; then the 4 MiB case again
//   with and without the router's /metrics scraped every 100 ms (scrape_overhead).
// pipeline: the same job in one process (the reference trainer) and through swarms of one
//   and of four stages, one peer each.
// codec: compression/bench_codec.h.
// hetero: an unbalanced emulated mix of fast and slow peers under static routing, swarm
//   routing and swarm routing with the rebalancer, against the best assignment's throughput.
// hosts: bench_hosts.cpp.
// gpu: bench_gpu.cpp.
// sim: bench_sim.cpp.
#include "tools/bench.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <filesystem>
#include <functional>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "compression/bench_codec.h"
#include "runtime/chaos_plan.h"
#include "runtime/client.h"
#include "runtime/data.h"
#include "runtime/http.h"
#include "runtime/job_spec.h"
#include "runtime/keys.h"
#include "stages/reference.h"
#include "tools/bench_common.h"
#include "tools/local_swarm.h"

namespace swarm {

using nlohmann::json;

namespace {

// Bytes/s of `count` messages of `bytes` through a bare PUSH/PULL pair on loopback TCP;
// `secure`: the pair speaks CURVE (runtime/keys.h), as every swarm connection does with keys.
double bare_zmq(int64_t bytes, int64_t count, bool secure = false) {
  const KeyPair server = generate_keypair(), client = generate_keypair();
  zmq::context_t ctx(1);
  zmq::socket_t pull(ctx, zmq::socket_type::pull);
  if (secure) curve_server(pull, server, "bench");   // no ZAP handler in this context: any client key
  pull.bind("tcp://127.0.0.1:*");
  const std::string ep = pull.get(zmq::sockopt::last_endpoint);
  std::vector<char> payload(size_t(bytes), 0x3c);
  std::thread sender([&] {
    zmq::context_t c2(1);
    zmq::socket_t push(c2, zmq::socket_type::push);
    push.set(zmq::sockopt::linger, -1);
    if (secure) curve_client(push, client, server.public_key);
    push.connect(ep);
    for (int64_t i = 0; i < count; ++i) push.send(zmq::message_t(payload.data(), payload.size()), zmq::send_flags::none);
    push.close();
  });
  zmq::message_t m;
  (void)pull.recv(m);  // the clock starts at the first message: connection setup excluded
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 1; i < count; ++i) (void)pull.recv(m);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  sender.join();
  return double(count - 1) * double(bytes) / s;
}

double through_router(LocalSwarm& swarm, int64_t bytes, int64_t count, int inflight) {
  Client c(swarm.router_endpoint());
  json rep = c.request_body(wire::MsgType::kSubmit, json{{"bench_transport", {{"bytes", bytes}, {"count", count}, {"inflight", inflight}}}});
  FollowOptions fo;
  fo.quiet = true;
  fo.poll_s = 0.1;
  fo.timeout_s = 300;
  json st = follow_job(c, rep.at("job_id").get<uint64_t>(), fo);
  if (st.value("state", std::string()) != "done") throw std::runtime_error("transport benchmark job failed: " + st.value("reason", std::string()));
  return st["bench"]["bytes_per_s"].get<double>();
}

// GETs `url` every `period_s` on a thread of its own until stopped, as Prometheus would scrape.
class Scraper {
 public:
  Scraper(std::string url, double period_s) : url_(std::move(url)), period_s_(period_s), thread_([this] { loop(); }) {}
  ~Scraper() { stop(); }
  void stop() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  int ok = 0, failed = 0;
  size_t bytes = 0;

 private:
  void loop() {
    std::unique_lock<std::mutex> l(mu_);
    while (!stop_) {
      l.unlock();
      const http::Response r = http::get(url_, 5);
      if (r.status == 200) {
        ok++;
        bytes += r.body.size();
      } else {
        failed++;
      }
      l.lock();
      cv_.wait_for(l, std::chrono::duration<double>(period_s_), [this] { return stop_; });
    }
  }
  std::string url_;
  double period_s_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// A router and one echo stage server, registered; `secure`: CURVE on every connection.
void start_echo_swarm(LocalSwarm& swarm, bool secure, const std::vector<std::string>& router_args = {}) {
  swarm.set_secure(secure);
  swarm.start_router(router_args);
  swarm.start_stage(0, "echo", 1, {"--echo"});
  Client c(swarm.router_endpoint());
  for (int i = 0; i < 100; ++i) {
    json p = c.request_body(wire::MsgType::kPeers, json::object());
    if (!p["peers"].empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

int bench_transport(bool as_json) {
  // The router's own cost against bare ZeroMQ: without encryption, as the figures always were.
  // The router serves /metrics throughout; only the scraped runs below read it.
  LocalSwarm swarm(temp_dir("transport"));
  start_echo_swarm(swarm, false, {"--http", "127.0.0.1:0"});
  // 8 payloads in flight, as a pipeline keeps a few hops per peer; 4 KiB payloads also with 64
  // in flight: with 8, each payload waits for a round trip through four threads on each side,
  // so the figure measures latency; with 64 the router's own per-message cost shows.
  struct Case { const char* name; int64_t bytes, count; int inflight; const char* target; };
  const Case cases[] = {{"4m", 4 << 20, 400, 8, ">= 0.7"}, {"4k", 4 << 10, 20000, 8, ">= 0.4"}, {"4k_inflight64", 4 << 10, 40000, 64, "report"}};
  json figures = json::object(), raw = json::object();
  for (const Case& cs : cases) {
    const double zmq_bps = bare_zmq(cs.bytes, cs.count);
    const double router_bps = through_router(swarm, cs.bytes, cs.count, cs.inflight);
    const double ratio = router_bps / zmq_bps;
    raw[cs.name] = {{"bytes", cs.bytes}, {"count", cs.count}, {"inflight", cs.inflight}, {"router_bytes_per_s", router_bps}, {"zmq_bytes_per_s", zmq_bps}};
    figures[std::string("router_") + cs.name + "_vs_zmq"] = {{"value", ratio}, {"target", cs.target}};
    char text[256];
    std::snprintf(text, sizeof(text), "%s payloads (%d in flight): router + echo stage %.1f MB/s, bare zmq push/pull %.1f MB/s, ratio %.3f",
                  cs.name, cs.inflight, router_bps / 1e6, zmq_bps / 1e6, ratio);
    emit(as_json, json{{"bench", "transport"}, {"case", cs.name}, {"router_bytes_per_s", router_bps}, {"zmq_bytes_per_s", zmq_bps}, {"ratio", ratio}}, text);
  }
  // The 4 MiB case with /metrics scraped every 100 ms against the same case unscraped, in pairs
  // whose order alternates (load on a shared machine drifts both ways); the figure is the median
  // of the pairs' ratios.
  {
    const Case& cs = cases[0];
    constexpr int kPairs = 6;
    std::vector<double> plain, scraped, ratios;
    int scrapes = 0, scrape_failures = 0;
    size_t scrape_bytes = 0;
    auto run_scraped = [&] {
      Scraper sc(swarm.http_url() + "/metrics", 0.1);
      scraped.push_back(through_router(swarm, cs.bytes, cs.count, cs.inflight));
      sc.stop();
      scrapes += sc.ok;
      scrape_failures += sc.failed;
      scrape_bytes += sc.bytes;
    };
    for (int i = 0; i < kPairs; ++i) {
      if (i % 2 == 0) {
        plain.push_back(through_router(swarm, cs.bytes, cs.count, cs.inflight));
        run_scraped();
      } else {
        run_scraped();
        plain.push_back(through_router(swarm, cs.bytes, cs.count, cs.inflight));
      }
      ratios.push_back(scraped.back() / plain.back());
    }
    const double overhead = median(ratios);
    raw["4m_scraped"] = {{"bytes", cs.bytes}, {"count", cs.count}, {"inflight", cs.inflight}, {"pairs", kPairs},
                         {"unscraped_bytes_per_s", plain}, {"scraped_bytes_per_s", scraped}, {"scrape_period_s", 0.1},
                         {"pair_ratios", ratios}, {"scrapes", scrapes}, {"scrape_failures", scrape_failures},
                         {"metrics_page_bytes", scrapes ? scrape_bytes / size_t(scrapes) : 0}};
    figures["scrape_overhead"] = {{"value", overhead}, {"target", ">= 0.97"}};
    char text[256];
    std::snprintf(text, sizeof(text), "4m payloads, /metrics scraped every 100 ms: %.1f MB/s vs %.1f MB/s unscraped (medians of %d pairs), "
                  "median pair ratio %.3f; %d scrapes, %d failed",
                  median(scraped) / 1e6, median(plain) / 1e6, kPairs, overhead, scrapes, scrape_failures);
    emit(as_json, json{{"bench", "transport"}, {"case", "4m_scraped"}, {"scraped_bytes_per_s", median(scraped)},
                       {"unscraped_bytes_per_s", median(plain)}, {"ratio", overhead}, {"scrapes", scrapes}, {"scrape_failures", scrape_failures}},
         text);
  }
  swarm.stop_all();
  // What CURVE costs (docs/security.md): 4 MiB payloads with every connection encrypted, against
  // the same without, measured back to back.
  {
    LocalSwarm plain(temp_dir("transport-plain")), curve(temp_dir("transport-curve"));
    start_echo_swarm(plain, false);
    const double plain_bps = through_router(plain, 4 << 20, 400, 8);
    plain.stop_all();
    start_echo_swarm(curve, true);
    const double curve_bps = through_router(curve, 4 << 20, 400, 8);
    curve.stop_all();
    // What CURVE costs ZeroMQ itself, without swarm: the bare pair with and without it.
    const double zmq_plain_bps = bare_zmq(4 << 20, 400), zmq_curve_bps = bare_zmq(4 << 20, 400, true);
    raw["curve_4m"] = {{"bytes", 4 << 20}, {"count", 400}, {"inflight", 8}, {"curve_bytes_per_s", curve_bps}, {"plain_bytes_per_s", plain_bps},
                       {"zmq_curve_bytes_per_s", zmq_curve_bps}, {"zmq_plain_bytes_per_s", zmq_plain_bps}};
    figures["curve_4m_vs_plain"] = {{"value", curve_bps / plain_bps}, {"target", ">= 0.6"}};
    figures["zmq_curve_4m_vs_plain"] = {{"value", zmq_curve_bps / zmq_plain_bps}, {"target", "report"}};
    char text[320];
    std::snprintf(text, sizeof(text),
                  "4m payloads with CURVE: %.1f MB/s, without %.1f MB/s, ratio %.3f; bare zmq push/pull with CURVE %.1f MB/s, without %.1f MB/s, ratio %.3f",
                  curve_bps / 1e6, plain_bps / 1e6, curve_bps / plain_bps, zmq_curve_bps / 1e6, zmq_plain_bps / 1e6, zmq_curve_bps / zmq_plain_bps);
    emit(as_json, json{{"bench", "transport"}, {"case", "curve_4m"}, {"curve_bytes_per_s", curve_bps}, {"plain_bytes_per_s", plain_bps},
                       {"ratio", curve_bps / plain_bps}, {"zmq_curve_bytes_per_s", zmq_curve_bps}, {"zmq_plain_bytes_per_s", zmq_plain_bps},
                       {"zmq_ratio", zmq_curve_bps / zmq_plain_bps}}, text);
  }
  json summary{{"bench", "transport"}, {"figures", figures}, {"raw", raw}};
  std::cout << (as_json ? summary.dump() : summary.dump(2)) << std::endl;
  return 0;
}

JobSpec pipeline_spec(int stages) {
  json j = example_job();
  j["steps"] = 30;
  j["partition"] = {{"stages", stages}};
  j["diloco"]["inner_steps"] = 1000;  // no round inside the measured window
  j["diloco"]["warm_start_steps"] = 0;  // nor a flush at every step
  j["eval"] = {{"every_steps", 0}, {"batches", 2}};
  j["schedule"] = "async";
  return parse_job_spec(j, true);
}

int bench_pipeline(bool as_json) {
  const int cores = std::max(1, int(std::thread::hardware_concurrency()));
  JobSpec one = pipeline_spec(1), four = pipeline_spec(4);
  TokenData data = TokenData::load(one.data, one.model.seq_len, one.model.vocab_size);
  ReferenceResult single = train_reference(one, data, cores);
  emit(as_json, json{{"bench", "pipeline"}, {"case", "single"}, {"threads", cores}, {"tokens_per_s", single.tokens_per_s}},
       "single process (" + std::to_string(cores) + " threads): " + std::to_string(single.tokens_per_s) + " tokens/s");
  json s1 = run_swarm(one, cores, "pipeline1");
  const double t1 = train_tokens_per_s(s1);
  emit(as_json, json{{"bench", "pipeline"}, {"case", "swarm_1stage"}, {"threads", cores}, {"tokens_per_s", t1}},
       "1-stage swarm (" + std::to_string(cores) + " threads): " + std::to_string(t1) + " tokens/s");
  json s4 = run_swarm(four, 1, "pipeline4");
  const double t4 = train_tokens_per_s(s4);
  const double cached = s4["backward"].value("cached", 0.0), recomputed = s4["backward"].value("recomputed", 0.0);
  const double recompute_frac = cached + recomputed > 0 ? recomputed / (cached + recomputed) : 0;
  emit(as_json, json{{"bench", "pipeline"}, {"case", "swarm_4stage"}, {"threads_per_stage", 1}, {"tokens_per_s", t4},
                     {"backward_cached", cached}, {"backward_recomputed", recomputed}},
       "4-stage swarm (1 thread per stage): " + std::to_string(t4) + " tokens/s; backward recomputed " +
           std::to_string(int(recomputed)) + " of " + std::to_string(int(cached + recomputed)));
  json summary{{"bench", "pipeline"},
               {"figures", {{"ratio_1stage", {{"value", t1 / single.tokens_per_s}, {"target", ">= 0.9"}}},
                            {"ratio_4stage", {{"value", t4 / single.tokens_per_s}, {"target", "report (4 one-thread stages on " + std::to_string(cores) + " cores)"}}}}},
               {"raw", {{"single_tokens_per_s", single.tokens_per_s}, {"swarm1_tokens_per_s", t1}, {"swarm4_tokens_per_s", t4},
                        {"cores", cores}, {"steps", one.steps}, {"backward_recompute_fraction_4stage", recompute_frac},
                        {"losses_single_last", single.losses.empty() ? 0.0 : single.losses.back()},
                        {"loss_swarm1_last", s1["train_loss"]}, {"loss_swarm4_last", s4["train_loss"]}}}};
  std::cout << (as_json ? summary.dump() : summary.dump(2)) << std::endl;
  return 0;
}

// The subspace codec of the bundled example's headline case, and the coefficient codec of the
// wider model's k sweep (docs/compression.md#subspace).
constexpr const char* kSubspaceExample = "subspace:k=16,coef=int4";
constexpr const char* kSubspaceWideCoef = "int4";

// The bundled example's model made wider: d_model 512 over 4 stages of one block, 8 heads, and
// fewer, smaller steps so that four runs fit in a few minutes on 2 cores.
json wide_job() {
  json j = example_job();
  j["model"]["d_model"] = 512;
  j["model"]["n_head"] = 8;
  j["steps"] = 50;
  j["batch"] = {{"batch_size", 8}, {"microbatch_size", 8}};
  j["optimizer"] = {{"lr", 0.001}, {"min_lr", 0.0001}, {"warmup_steps", 10}};
  j["eval"] = {{"every_steps", 0}, {"batches", 8}};
  return j;
}

// The bundled example, one peer per stage, once per activation/gradient codec pair: the
// codecs' cost in validation loss against their saving in wire bytes. Then the subspace codec
// (Protocol Models), on the example and on the wider model for k in {8, 16, 32}.
int bench_compression(bool as_json) {
  struct Case { std::string name; json job; std::string codec; };
  std::vector<Case> cases;
  for (const char* codec : {"fp32", "bf16", "int8", "int4"}) cases.push_back({codec, example_job(), codec});
  cases.push_back({"subspace", example_job(), kSubspaceExample});
  cases.push_back({"wide_fp32", wide_job(), "fp32"});
  for (int k : {8, 16, 32})
    cases.push_back({"wide_subspace_k" + std::to_string(k), wide_job(),
                     "subspace:k=" + std::to_string(k) + ",coef=" + kSubspaceWideCoef});
  json raw = json::object();
  for (const Case& cs : cases) {
    json j = cs.job;
    j["schedule"] = "sync";                // the codecs' cost alone: exact training otherwise
    j["diloco"]["warm_start_steps"] = 0;   // as first measured (docs/compression.md)
    j["compression"]["activations"] = cs.codec;
    j["compression"]["gradients"] = cs.codec;
    JobSpec spec = parse_job_spec(j, true);
    json st = run_swarm(spec, 1, "compression");
    const json& per = st["wire_bytes_per_sample"];
    const double bytes = per.value("activations", 0.0) + per.value("gradients", 0.0);
    raw[cs.name] = {{"codec", spec.compression.activations}, {"d_model", spec.model.d_model}, {"steps", spec.steps},
                    {"val_loss", st["val_loss"]}, {"train_loss", st["train_loss"]}, {"wire_bytes_per_sample", bytes},
                    {"codec_ms", st["codec_ms"]}, {"tokens_per_s", train_tokens_per_s(st)}, {"elapsed_s", st["elapsed_s"]}};
    char text[320];
    std::snprintf(text, sizeof(text), "%-22s %-26s val loss %.4f, %.0f wire bytes per sample (activations + gradients)",
                  cs.name.c_str(), cs.codec.c_str(), st["val_loss"].get<double>(), bytes);
    json line{{"bench", "compression"}, {"case", cs.name}};
    line.update(raw[cs.name]);
    emit(as_json, line, text);
  }
  auto rel = [&](const std::string& c, const char* base) {
    return raw[c]["val_loss"].get<double>() / raw[base]["val_loss"].get<double>() - 1.0;
  };
  auto ratio = [&](const std::string& c, const char* base) {
    return raw[base]["wire_bytes_per_sample"].get<double>() / raw[c]["wire_bytes_per_sample"].get<double>();
  };
  json figures{{"int8_loss_rel", {{"value", rel("int8", "fp32")}, {"target", "<= 0.01"}}},
               {"int8_bytes_ratio", {{"value", ratio("int8", "fp32")}, {"target", ">= 3.7"}}},
               {"int4_loss_rel", {{"value", rel("int4", "fp32")}, {"target", "report"}}},
               {"int4_bytes_ratio", {{"value", ratio("int4", "fp32")}, {"target", "report"}}},
               {"subspace_loss_rel", {{"value", rel("subspace", "fp32")}, {"target", "<= 0.03"}}},
               {"subspace_bytes_ratio", {{"value", ratio("subspace", "fp32")}, {"target", ">= 32"}}}};
  for (int k : {8, 16, 32}) {
    const std::string c = "wide_subspace_k" + std::to_string(k);
    figures[c + "_loss_rel"] = {{"value", rel(c, "wide_fp32")}, {"target", "report"}};
    figures[c + "_bytes_ratio"] = {{"value", ratio(c, "wide_fp32")}, {"target", "report"}};
  }
  json summary{{"bench", "compression"}, {"figures", figures}, {"raw", raw}};
  std::cout << (as_json ? summary.dump() : summary.dump(2)) << std::endl;
  return 0;
}

// The bundled example with 2 peers per stage, same samples and seed, under four ways for a
// stage group to agree: averaging gradients every step (the data-parallel reference), DiLoCo
// rounds every 10 and every 50 steps, and streaming DiLoCo (H = 50, 4 fragments, one synced
// every 12-13 steps and overlapped with the next inner step, int8 outer gradients with error
// feedback, the int8 codes zstd-packed on the wire). Figures: validation loss and sync bytes (outer gradients up and means down) per
// training sample. Two protocols, each case on a fresh swarm:
// - "warm": the DiLoCo paper's protocol. The every_step run trains 2 x steps with a checkpoint
//   at `steps`; every DiLoCo case continues from that checkpoint (same weights, AdamW state,
//   data position and lr schedule) to 2 x steps. The targets apply here.
// - "scratch": every case trains `steps` from random initialisation. Reported.
int bench_diloco(bool as_json) {
  struct Case { const char* name; const char* sync; int H; int F; int overlap; const char* codec; };
  const Case cases[] = {{"every_step", "every_step", 10, 1, 0, "fp32"},
                        {"diloco_h10", "rounds", 10, 1, 0, "fp32"},
                        {"diloco_h50", "rounds", 50, 1, 0, "fp32"},
                        {"streaming_h50_f4_int8", "rounds", 50, 4, 1, "int8:block=1024,scale=fp16,entropy=zstd"}};
  auto job = [](const Case& cs, int steps) {
    json j = example_job();
    j["steps"] = steps;
    j["schedule"] = "sync";
    j["diloco"]["sync"] = cs.sync;
    j["diloco"]["warm_start_steps"] = 0;  // "scratch" is from a cold start; "warm" resumes from one
    j["diloco"]["inner_steps"] = cs.H;
    j["diloco"]["streaming"] = {{"fragments", cs.F}, {"overlap_steps", cs.overlap}};
    j["compression"]["outer"] = cs.codec;
    return j;
  };
  const int steps = example_job().value("steps", 300);
  const std::string warm_dir = temp_dir("diloco-warm");
  json raw = json::object();
  for (const char* protocol : {"warm", "scratch"}) {
    const bool warm = std::string(protocol) == "warm";
    json& out = raw[protocol];
    for (const Case& cs : cases) {
      const bool reference = std::string(cs.sync) == "every_step";
      json j = job(cs, warm ? 2 * steps : steps);
      std::string resume;
      if (warm && reference) j["checkpoint"] = {{"dir", warm_dir}, {"every_steps", steps}, {"keep", 2}};
      if (warm && !reference) {
        char step_dir[32];
        std::snprintf(step_dir, sizeof(step_dir), "/step-%08d", steps);
        resume = warm_dir + step_dir;
        j["checkpoint"] = {{"dir", warm_dir + "/" + cs.name}};  // its end checkpoint, apart from the shared one
      }
      JobSpec spec = parse_job_spec(j, true);
      json st = run_swarm(spec, 1, cs.name, 2, resume);
      const double per = st.value("sync_bytes_per_sample", 0.0);
      out[cs.name] = {{"val_loss", st["val_loss"]}, {"train_loss", st["train_loss"]}, {"sync_bytes_per_sample", per},
                      {"steps", warm && !reference ? json::array({steps, 2 * steps}) : json::array({0, spec.steps})},
                      {"rounds", st["rounds"]}, {"fragment_syncs", st["fragment_syncs"]}, {"hash_mismatches", st["hash_mismatches"]},
                      {"tokens_per_s", train_tokens_per_s(st)}, {"outer_codec", cs.codec}};
      char text[256];
      std::snprintf(text, sizeof(text), "%-7s %-22s val loss %.4f, %.0f sync bytes per sample", protocol, cs.name,
                    st["val_loss"].get<double>(), per);
      json line{{"bench", "diloco"}, {"protocol", protocol}, {"case", cs.name}};
      line.update(out[cs.name]);
      emit(as_json, line, text);
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(warm_dir, ec);
  auto val = [&](const char* p, const char* c) { return raw[p][c]["val_loss"].get<double>(); };
  auto bytes = [&](const char* p, const char* c) { return raw[p][c]["sync_bytes_per_sample"].get<double>(); };
  auto rel = [&](const char* p, const char* c) { return val(p, c) / val(p, "every_step") - 1.0; };
  json summary{{"bench", "diloco"},
               {"figures", {{"h50_bytes_ratio", {{"value", bytes("warm", "every_step") / bytes("warm", "diloco_h50")}, {"target", ">= 40"}}},
                            {"h50_loss_rel", {{"value", rel("warm", "diloco_h50")}, {"target", "<= 0.02"}}},
                            {"h10_loss_rel", {{"value", rel("warm", "diloco_h10")}, {"target", "report"}}},
                            {"streaming_bytes_ratio_vs_h50", {{"value", bytes("warm", "diloco_h50") / bytes("warm", "streaming_h50_f4_int8")}, {"target", ">= 4"}}},
                            {"streaming_loss_rel", {{"value", rel("warm", "streaming_h50_f4_int8")}, {"target", "<= 0.03"}}},
                            {"scratch_h50_loss_rel", {{"value", rel("scratch", "diloco_h50")}, {"target", "report"}}},
                            {"scratch_h10_loss_rel", {{"value", rel("scratch", "diloco_h10")}, {"target", "report"}}},
                            {"scratch_streaming_loss_rel", {{"value", rel("scratch", "streaming_h50_f4_int8")}, {"target", "report"}}}}},
               {"raw", raw}};
  std::cout << (as_json ? summary.dump() : summary.dump(2)) << std::endl;
  return 0;
}

// `swarm bench hetero`: the bundled example on 2 "a100-like" peers (--emulate 2) and 6
// "t4-like" ones (--emulate 8), 4:1, started unbalanced: both a100-like on stage 0, the t4-like
// 2/2/2 on stages 1-3, none pinned (--prefer-stage). The factors pad real compute, so the 8
// processes need under 2 cores even when balanced: on this 2-core machine a CPU-bound swarm
// could not get faster by moving peers. One swarm serves one job per run, each cancelled after
// its window: static routing, swarm routing, swarm routing with the rebalancer, and static once
// more (a new job starts every peer on its preferred stage again), so that the load of a shared
// machine drifting during the bench shows as two different static figures.
constexpr double kHeteroWarmupS = 5, kHeteroWindowS = 15, kHeteroSettleLimitS = 120;
constexpr double kHeteroPeriodS = 3, kHeteroCooldownS = 5;
constexpr int kHeteroPeers = 8;

// One run: samples/s over a steady window, after a warm-up and, when rebalancing, after the
// moves settle (no move for a cooldown plus two check periods, every peer ready, the last check
// found nothing worth moving; or kHeteroSettleLimitS passed: "settled": false). The router's
// model figures (min stage, ideal) are averaged over the window's polls: each is a snapshot of
// noisy per-peer EMAs.
json run_hetero(Client& c, const char* name, const std::string& mode, bool rebalance, bool as_json) {
  json j = example_job();
  j["steps"] = 100000;  // cancelled once the window is measured
  j["schedule"] = "async";
  j["max_inflight"] = 24;
  j["diloco"]["inner_steps"] = 100000;  // no round (a barrier) inside the window
  j["diloco"]["warm_start_steps"] = 0;     // nor a flush at every step
  j["eval"] = {{"every_steps", 0}, {"batches", 1}};
  j["routing"] = {{"mode", mode}, {"rebalance", rebalance}, {"rebalance_period_s", kHeteroPeriodS},
                  {"cooldown_s", kHeteroCooldownS}, {"min_gain", 0.1}};
  const JobSpec spec = parse_job_spec(j, true);
  const int B = spec.batch.microbatch_size;
  const uint64_t job = c.request_body(wire::MsgType::kSubmit, json{{"spec", to_json(spec)}}).at("job_id").get<uint64_t>();

  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto now_s = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  json st, at_start;
  double ready_s = -1, last_move_s = -1, start_s = -1;
  size_t moves_seen = 0;
  bool settled = !rebalance;
  double ideal_sum = 0, model_min_sum = 0;  // the router's model, averaged over the window's polls
  int model_polls = 0;
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    st = c.request_body(wire::MsgType::kStatus, json{{"job_id", job}});
    const std::string state = st.value("state", std::string());
    if (state != "queued" && state != "loading" && state != "running")
      throw std::runtime_error(std::string(name) + " run ended early: " + state + " " + st.value("reason", std::string()));
    const double t = now_s();
    if (t > 300) throw std::runtime_error(std::string(name) + " run did not reach a steady window in 300 s");
    if (state != "running") continue;
    int ready = 0;
    for (const auto& n : st["peers_per_stage"]) ready += n.get<int>();
    if (ready_s < 0 && ready == kHeteroPeers) ready_s = t;
    if (ready_s < 0) continue;
    const json& r = st["routing"];
    if (r["moves"].size() > moves_seen) {
      moves_seen = r["moves"].size();
      last_move_s = t;
    }
    if (start_s < 0) {
      const double quiet = last_move_s < 0 ? t - ready_s : t - last_move_s;
      const bool done_moving = r.value("rebalance", std::string()).rfind("no move", 0) == 0 && quiet >= kHeteroCooldownS + 2 * kHeteroPeriodS;
      if (!settled && ready == kHeteroPeers && done_moving) settled = true;
      if (t - ready_s >= kHeteroWarmupS && ready == kHeteroPeers && (settled || t - ready_s > kHeteroSettleLimitS)) {
        start_s = t;
        at_start = st;
      }
      continue;
    }
    ideal_sum += r.value("ideal_samples_per_s", 0.0);
    model_min_sum += r.value("min_stage_samples_per_s", 0.0);
    model_polls++;
    if (t - start_s >= kHeteroWindowS) break;
  }
  const json peers = c.request_body(wire::MsgType::kPeers, json::object())["peers"];
  c.request_body(wire::MsgType::kCancel, json{{"job_id", job}});
  auto delta = [&](const char* group, const char* key) { return st[group][key].get<double>() - at_start[group][key].get<double>(); };
  const double window_s = st["elapsed_s"].get<double>() - at_start["elapsed_s"].get<double>();
  const double samples_per_s = delta("microbatches", "completed") * B / window_s;
  const double recomputed = delta("backward", "recomputed"), cached = delta("backward", "cached");
  json placement = json::object();
  for (const auto& p : peers) placement[p["name"].get<std::string>()] = p["stage"];
  const json& r = st["routing"];
  json out{{"mode", mode}, {"rebalance", rebalance}, {"samples_per_s", samples_per_s}, {"window_s", window_s},
           {"moves", r["moves"].size()}, {"moves_in_window", r["moves"].size() - at_start["routing"]["moves"].size()},
           {"settled", settled}, {"backward_recomputed_fraction", cached + recomputed > 0 ? recomputed / (cached + recomputed) : 0.0},
           {"model_min_stage_samples_per_s", model_min_sum / model_polls}, {"model_stage_samples_per_s_at_end", r["stage_samples_per_s"]},
           {"ideal_samples_per_s", ideal_sum / model_polls},
           {"peers_per_stage", st["peers_per_stage"]}, {"placement", placement}, {"move_log", r["moves"]}};
  char text[400];
  std::snprintf(text, sizeof(text),
                "%-11s %6.1f samples/s over %.0f s; %zu move(s)%s; backwards recomputed %.0f%%; router's model: min stage %.1f, ideal %.1f samples/s; peers per stage %s",
                name, samples_per_s, window_s, r["moves"].size(), rebalance && !settled ? " (not settled)" : "",
                100 * out["backward_recomputed_fraction"].get<double>(), model_min_sum / model_polls, ideal_sum / model_polls,
                st["peers_per_stage"].dump().c_str());
  json line{{"bench", "hetero"}, {"case", name}};
  line.update(out);
  line.erase("move_log");
  emit(as_json, line, text);
  return out;
}

// One scenario: the 8 peers started on the stages `t4_stages` gives for the t4-like ones (the
// a100-like both on stage 0), then static, swarm, swarm with rebalancing and static again.
json hetero_scenario(const std::string& name, const std::vector<int>& t4_stages, bool as_json) {
  LocalSwarm swarm(temp_dir("hetero"));
  swarm.start_router();
  for (int i = 0; i < 2; ++i) swarm.start_stage(-1, "a100-like-" + std::to_string(i), 1, {"--prefer-stage", "0", "--emulate", "2"});
  for (size_t i = 0; i < t4_stages.size(); ++i)
    swarm.start_stage(-1, "t4-like-" + std::to_string(i), 1, {"--prefer-stage", std::to_string(t4_stages[i]), "--emulate", "8"});
  Client c(swarm.router_endpoint());
  for (int i = 0; i < 600 && c.request_body(wire::MsgType::kPeers, json::object())["peers"].size() < size_t(kHeteroPeers); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  emit(as_json, json{{"bench", "hetero"}, {"scenario", name}, {"t4_like_stages", t4_stages}}, "scenario " + name);
  const json st1 = run_hetero(c, "static", "static", false, as_json);
  const json unbalanced = run_hetero(c, "unbalanced", "swarm", false, as_json);
  const json rebalanced = run_hetero(c, "rebalanced", "swarm", true, as_json);
  const json st2 = run_hetero(c, "static", "static", false, as_json);
  swarm.stop_all();
  const double ideal = rebalanced["ideal_samples_per_s"].get<double>();
  const double v_st = (st1["samples_per_s"].get<double>() + st2["samples_per_s"].get<double>()) / 2;
  const double v_un = unbalanced["samples_per_s"].get<double>(), v_re = rebalanced["samples_per_s"].get<double>();
  return json{{"rebalanced_vs_ideal", ideal > 0 ? v_re / ideal : 0.0}, {"rebalanced_vs_static", v_re / v_st},
              {"rebalanced_vs_unbalanced", v_re / v_un}, {"static_samples_per_s", v_st},
              {"static_runs_samples_per_s", {st1["samples_per_s"], st2["samples_per_s"]}}, {"unbalanced_samples_per_s", v_un},
              {"rebalanced_samples_per_s", v_re}, {"ideal_samples_per_s", ideal}, {"moves", rebalanced["moves"]},
              {"settled", rebalanced["settled"]},
              {"runs", {{"static", st1}, {"unbalanced", unbalanced}, {"rebalanced", rebalanced}, {"static_again", st2}}}};
}

// Two starts, both with the a100-like pair on stage 0: "even" (t4-like 2/2/2 on stages 1-3:
// every stage has 2 peers, static's best case: its 2 full pipelines run at 2 t4s' pace, 2/3 of
// the ideal, so the rebalanced swarm can beat it by 1.5x at most) and "uneven" (one t4-like
// joins stage 0, stage 1 keeps one: static has 1 full pipeline and idles the rest).
int bench_hetero(bool as_json) {
  const char* note = "2 a100-like (--emulate 2) + 6 t4-like (--emulate 8) peers, 4:1, on 4 stages of the bundled example; "
                     "started with both a100-like on stage 0 (--prefer-stage, not pinned); the factors pad real compute so that "
                     "the 8 processes need under 2 cores";
  emit(as_json, json{{"bench", "hetero"}, {"note", note}}, note);
  const json even = hetero_scenario("even", {1, 1, 2, 2, 3, 3}, as_json);
  const json uneven = hetero_scenario("uneven", {0, 1, 2, 2, 3, 3}, as_json);
  json summary{{"bench", "hetero"},
               {"note", note},
               {"figures", {{"rebalanced_vs_ideal", {{"value", even["rebalanced_vs_ideal"]}, {"target", ">= 0.85"}}},
                            {"rebalanced_vs_static", {{"value", even["rebalanced_vs_static"]}, {"target", ">= 1.5 (at most 1.5 from this start)"}}},
                            {"rebalanced_vs_unbalanced", {{"value", even["rebalanced_vs_unbalanced"]}, {"target", "report"}}},
                            {"uneven_rebalanced_vs_ideal", {{"value", uneven["rebalanced_vs_ideal"]}, {"target", ">= 0.85"}}},
                            {"uneven_rebalanced_vs_static", {{"value", uneven["rebalanced_vs_static"]}, {"target", ">= 1.5"}}}}},
               {"raw", {{"even", even}, {"uneven", uneven}}}};
  std::cout << (as_json ? summary.dump() : summary.dump(2)) << std::endl;
  return 0;
}

// One run of the bundled example on 4 stages x 2 peers, polled every 50 ms: the completed
// microbatches over time, and what `during` does to the swarm.
struct Trace {
  std::vector<std::pair<double, double>> completed;  // (seconds since the job started, microbatches)
  json status;
};

Trace traced_run(const JobSpec& spec, const char* what, const std::function<void(LocalSwarm&, Client&, double)>& during,
                 const ChaosPlan* plan = nullptr) {
  LocalSwarm swarm(temp_dir(what));
  swarm.start_router();
  for (int s = 0; s < spec.partition.stages; ++s)
    for (int i = 0; i < 2; ++i) swarm.start_stage(s, "stage" + std::to_string(s) + "-" + std::to_string(i), 1);
  Client c(swarm.router_endpoint());
  for (int i = 0; i < 200 && c.request_body(wire::MsgType::kPeers, json::object())["peers"].size() < size_t(2 * spec.partition.stages); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const uint64_t id = c.request_body(wire::MsgType::kSubmit, json{{"spec", to_json(spec)}}).at("job_id").get<uint64_t>();
  Trace tr;
  auto t0 = std::chrono::steady_clock::now();
  bool running = false;
  for (;;) {
    json st = c.request_body(wire::MsgType::kStatus, json{{"job_id", id}});
    const std::string state = st.value("state", std::string());
    if (!running && state == "running") {
      running = true;
      t0 = std::chrono::steady_clock::now();
      if (plan) swarm.run_chaos(*plan);
    }
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (running) {
      tr.completed.emplace_back(t, st["microbatches"].value("completed", 0.0));
      if (during) during(swarm, c, t);
    }
    if (state == "done" || state == "failed" || state == "cancelled") {
      tr.status = st;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  swarm.stop_all();
  if (tr.status.value("state", std::string()) != "done") throw std::runtime_error(std::string(what) + " run failed: " + tr.status.value("reason", std::string()));
  return tr;
}

// Microbatches per second over [a, b) from a trace.
double rate(const Trace& tr, double a, double b) {
  double ca = -1, cb = -1, ta = 0, tb = 0;
  for (const auto& [t, c] : tr.completed) {
    if (t >= a && ca < 0) ca = c, ta = t;
    if (t < b) cb = c, tb = t;
  }
  return (ca >= 0 && tb > ta) ? (cb - ca) / (tb - ta) : 0.0;
}

// Tokens per second of the training (from the job's start to its last microbatch).
double run_tokens_per_s(const Trace& tr, const JobSpec& spec) {
  const double mbs = tr.completed.back().second;
  double end = tr.completed.back().first;
  for (const auto& [t, c] : tr.completed)
    if (c >= mbs) { end = t; break; }
  return end > 0 ? mbs * spec.batch.microbatch_size * spec.model.seq_len / end : 0.0;
}

// The bundled example with 2 peers per stage, three times: without faults; with one SIGKILL
// 10 s in (seconds until the router declares the peer gone, seconds until throughput is back
// to 90% of what the 7 survivors deliver, measured over the 4 s after that); and under the
// chaos plan examples/chaos/kill_every_15s.json (a random peer killed every 15 s, started again
// 5 s later), whose tokens/s is compared with the run without faults.
int bench_faults(bool as_json) {
  JobSpec spec = parse_job_spec(example_job(), true);
  Trace base = traced_run(spec, "faults-base", nullptr);
  const double base_tps = run_tokens_per_s(base, spec);
  emit(as_json, json{{"bench", "faults"}, {"case", "no_faults"}, {"tokens_per_s", base_tps}, {"val_loss", base.status["val_loss"]}},
       "no faults: " + std::to_string(base_tps) + " tokens/s");

  // Seconds from a signal to `name` until the router's registry (polled every 10 ms) no
  // longer lists it.
  auto time_to_gone = [](LocalSwarm& sw, Client& c, size_t index, const std::string& name, int sig) {
    json id;
    const json listed = c.request_body(wire::MsgType::kPeers, json::object());  // kept alive for the loop
    for (const auto& p : listed["peers"])
      if (p["name"] == name) id = p["id"];
    if (id.is_null()) return -1.0;  // not registered: nothing to time
    sw.kill_stage(index, sig);
    const auto k = std::chrono::steady_clock::now();
    for (int i = 0; i < 1000; ++i) {
      bool present = false;
      const json now = c.request_body(wire::MsgType::kPeers, json::object());
      for (const auto& p : now["peers"]) present |= p["id"] == id;
      if (!present) return std::chrono::duration<double>(std::chrono::steady_clock::now() - k).count();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1.0;
  };
  double kill_at = -1, detect_s = -1, stop_detect_s = -1, stopped_at = -1;
  Trace once = traced_run(spec, "faults-kill", [&](LocalSwarm& sw, Client& c, double t) {
    if (kill_at < 0 && t >= 10) {
      // stage2-1: a middle stage, so the pipeline on both sides of it must reroute. Its TCP
      // connection closes with the process: the router's next send to it fails.
      kill_at = t;
      detect_s = time_to_gone(sw, c, 5, "stage2-1", SIGKILL);
    } else if (stopped_at < 0 && t >= 22) {
      // stage1-1 frozen (SIGSTOP): the connection stays open, only missed heartbeats tell.
      stopped_at = t;
      stop_detect_s = time_to_gone(sw, c, 3, "stage1-1", SIGSTOP);
      sw.kill_stage(3, SIGCONT);  // it thaws, finds the router silent, and joins again
    }
  });
  // What the survivors deliver: the rate once things settled; recovery: the first 1 s window
  // after the kill at 90% of it.
  const double survivors = rate(once, kill_at + 5, kill_at + 9), before = rate(once, kill_at - 5, kill_at);
  double recover_s = -1;
  for (const auto& [t, c] : once.completed) {
    if (t < kill_at) continue;
    if (rate(once, t, t + 1) >= 0.9 * survivors) {
      recover_s = t + 1 - kill_at;  // the window's end: when the rate is back
      break;
    }
  }
  emit(as_json, json{{"bench", "faults"}, {"case", "kill_once"}, {"detect_s", detect_s}, {"recover_s", recover_s},
                     {"detect_stopped_s", stop_detect_s}, {"mb_per_s_before", before}, {"mb_per_s_survivors", survivors},
                     {"lost", once.status["microbatches"]["lost"]}},
       "one SIGKILL: detected in " + std::to_string(detect_s) + " s, throughput back to 90% in " + std::to_string(recover_s) +
           " s; a SIGSTOPped peer detected in " + std::to_string(stop_detect_s) + " s");

  const ChaosPlan plan = load_chaos_plan(std::string(SWARM_SOURCE_DIR) + "/examples/chaos/kill_every_15s.json");
  Trace chaos = traced_run(spec, "faults-chaos", nullptr, &plan);
  const double chaos_tps = run_tokens_per_s(chaos, spec);
  const json& mb = chaos.status["microbatches"];
  emit(as_json, json{{"bench", "faults"}, {"case", "chaos"}, {"tokens_per_s", chaos_tps}, {"microbatches", mb},
                     {"val_loss", chaos.status["val_loss"]}},
       "kill a random peer every 15 s, restart 5 s later: " + std::to_string(chaos_tps) + " tokens/s");
  const uint64_t lost = once.status["microbatches"].value("lost", uint64_t(0)) + mb.value("lost", uint64_t(0));
  json summary{{"bench", "faults"},
               {"figures", {{"detect_s", {{"value", detect_s}, {"target", "< 2"}}},
                            {"recover_s", {{"value", recover_s}, {"target", "< 3"}}},
                            {"detect_stopped_s", {{"value", stop_detect_s}, {"target", "report (heartbeats: 1.5 s window)"}}},
                            {"chaos_ratio", {{"value", chaos_tps / base_tps}, {"target", ">= 0.75"}}},
                            {"lost", {{"value", lost}, {"target", "0"}}}}},
               {"raw", {{"no_faults_tokens_per_s", base_tps}, {"chaos_tokens_per_s", chaos_tps},
                        {"chaos_microbatches", mb}, {"kill_at_s", kill_at}, {"mb_per_s_before_kill", before},
                        {"mb_per_s_survivors", survivors}, {"val_loss_no_faults", base.status["val_loss"]},
                        {"val_loss_chaos", chaos.status["val_loss"]}}}};
  std::cout << (as_json ? summary.dump() : summary.dump(2)) << std::endl;
  return 0;
}

}  // namespace

int run_bench(const std::string& name, bool as_json) {
  if (name == "codec") {
    json summary = compression::run_codec_bench(as_json, std::cout);
    std::cout << (as_json ? summary.dump() : summary.dump(2)) << std::endl;
    return 0;
  }
  if (name == "transport") return bench_transport(as_json);
  if (name == "pipeline") return bench_pipeline(as_json);
  if (name == "compression") return bench_compression(as_json);
  if (name == "diloco") return bench_diloco(as_json);
  if (name == "faults") return bench_faults(as_json);
  if (name == "hetero") return bench_hetero(as_json);
  if (name == "hosts") return run_hosts_bench(as_json);
  if (name == "quality") return bench_quality(as_json);
  if (name == "gpu") return run_gpu_bench(as_json);
  if (name == "sim") return run_sim_bench(as_json);
  if (name == "router") return run_router_bench(as_json);
  std::cerr << "swarm bench: unknown benchmark '" << name << "'; available: codec, compression, transport, pipeline, diloco, faults, hetero, hosts, quality, sim, router, gpu" << std::endl;
  return 2;
}

}  // namespace swarm
