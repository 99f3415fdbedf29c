// bench.cpp: the benchmarks behind `swarm bench` (see bench.h).
//
// transport: payloads that originate in the router's dispatcher go to an echo stage server
//   and back, against a bare ZeroMQ PUSH/PULL pair on loopback.
// pipeline: the same job in one process (the reference trainer) and through swarms of one
//   and of four stages, one peer each.
// codec: compression/bench_codec.h.
#include "tools/bench.h"

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "compression/bench_codec.h"
#include "runtime/client.h"
#include "runtime/data.h"
#include "runtime/job_spec.h"
#include "stages/reference.h"
#include "tools/local_swarm.h"

namespace swarm {

using nlohmann::json;

namespace {

std::string temp_dir(const char* what) {
  std::string tmpl = std::string("/tmp/swarm-bench-") + what + "-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back(0);
  return mkdtemp(buf.data()) ? std::string(buf.data()) : std::string("/tmp");
}

void emit(bool as_json, const json& line, const std::string& text) {
  if (as_json) std::cout << line.dump() << std::endl;
  else std::cout << text << std::endl;
}

// Bytes/s of `count` messages of `bytes` through a bare PUSH/PULL pair on loopback TCP.
double bare_zmq(int64_t bytes, int64_t count) {
  zmq::context_t ctx(1);
  zmq::socket_t pull(ctx, zmq::socket_type::pull);
  pull.bind("tcp://127.0.0.1:*");
  const std::string ep = pull.get(zmq::sockopt::last_endpoint);
  std::vector<char> payload(size_t(bytes), 0x3c);
  std::thread sender([&] {
    zmq::context_t c2(1);
    zmq::socket_t push(c2, zmq::socket_type::push);
    push.set(zmq::sockopt::linger, -1);
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

double through_router(LocalSwarm& swarm, int64_t bytes, int64_t count) {
  Client c(swarm.router_endpoint());
  json rep = c.request_body(wire::MsgType::kSubmit, json{{"bench_transport", {{"bytes", bytes}, {"count", count}, {"inflight", 8}}}});
  FollowOptions fo;
  fo.quiet = true;
  fo.poll_s = 0.1;
  fo.timeout_s = 300;
  json st = follow_job(c, rep.at("job_id").get<uint64_t>(), fo);
  if (st.value("state", std::string()) != "done") throw std::runtime_error("transport benchmark job failed: " + st.value("reason", std::string()));
  return st["bench"]["bytes_per_s"].get<double>();
}

int bench_transport(bool as_json) {
  LocalSwarm swarm(temp_dir("transport"));
  swarm.start_router();
  swarm.start_stage(0, "echo", 1, {"--echo"});
  // Wait until the echo peer registered.
  {
    Client c(swarm.router_endpoint());
    for (int i = 0; i < 100; ++i) {
      json p = c.request_body(wire::MsgType::kPeers, json::object());
      if (!p["peers"].empty()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  struct Case { const char* name; int64_t bytes, count; };
  const Case cases[] = {{"4m", 4 << 20, 400}, {"4k", 4 << 10, 20000}};
  json figures = json::object(), raw = json::object();
  for (const Case& cs : cases) {
    const double zmq_bps = bare_zmq(cs.bytes, cs.count);
    const double router_bps = through_router(swarm, cs.bytes, cs.count);
    const double ratio = router_bps / zmq_bps;
    raw[cs.name] = {{"bytes", cs.bytes}, {"count", cs.count}, {"router_bytes_per_s", router_bps}, {"zmq_bytes_per_s", zmq_bps}};
    figures[std::string("router_") + cs.name + "_vs_zmq"] = {{"value", ratio}, {"target", std::string(cs.name) == "4m" ? ">= 0.4" : "report"}};
    char text[256];
    std::snprintf(text, sizeof(text), "%s payloads: router + echo stage %.1f MB/s, bare zmq push/pull %.1f MB/s, ratio %.3f",
                  cs.name, router_bps / 1e6, zmq_bps / 1e6, ratio);
    emit(as_json, json{{"bench", "transport"}, {"case", cs.name}, {"router_bytes_per_s", router_bps}, {"zmq_bytes_per_s", zmq_bps}, {"ratio", ratio}}, text);
  }
  swarm.stop_all();
  json summary{{"bench", "transport"}, {"figures", figures}, {"raw", raw}};
  std::cout << (as_json ? summary.dump() : summary.dump(2)) << std::endl;
  return 0;
}

// The bundled example's job spec, as JSON to adjust.
json example_job() {
  const std::string path = std::string(SWARM_SOURCE_DIR) + "/examples/tiny_gpt/job.json";
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot read " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return json::parse(ss.str());
}

JobSpec pipeline_spec(int stages) {
  json j = example_job();
  j["steps"] = 30;
  j["partition"] = {{"stages", stages}};
  j["diloco"]["inner_steps"] = 1000;  // no round inside the measured window
  j["eval"] = {{"every_steps", 0}, {"batches", 2}};
  j["schedule"] = "async";
  return parse_job_spec(j, true);
}

// Tokens/s of the training steps (the final round and evaluation excluded).
double train_tokens_per_s(const json& st) {
  double tps = 0;
  for (const auto& h : st["history"])
    if (h.contains("train_loss")) tps = h.value("tokens_per_s", 0.0);
  return tps;
}

json run_swarm(const JobSpec& spec, int threads, const char* what, int peers_per_stage = 1) {
  LocalSwarm swarm(temp_dir(what));
  swarm.start_router();
  for (int s = 0; s < spec.partition.stages; ++s)
    for (int i = 0; i < peers_per_stage; ++i) swarm.start_stage(s, "stage" + std::to_string(s) + "-" + std::to_string(i), threads);
  Client c(swarm.router_endpoint());
  json rep = c.request_body(wire::MsgType::kSubmit, json{{"spec", to_json(spec)}});
  FollowOptions fo;
  fo.quiet = true;
  fo.timeout_s = 900;
  json st = follow_job(c, rep.at("job_id").get<uint64_t>(), fo);
  swarm.stop_all();
  if (st.value("state", std::string()) != "done") throw std::runtime_error(std::string(what) + " swarm failed: " + st.value("reason", std::string()));
  return st;
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

// The bundled example, one peer per stage, once per activation/gradient codec pair: the
// codecs' cost in validation loss against their saving in wire bytes.
int bench_compression(bool as_json) {
  const json base = example_job();
  const char* codecs[] = {"fp32", "bf16", "int8", "int4"};
  json raw = json::object();
  for (const char* codec : codecs) {
    json j = base;
    j["compression"]["activations"] = codec;
    j["compression"]["gradients"] = codec;
    JobSpec spec = parse_job_spec(j, true);
    json st = run_swarm(spec, 1, "compression");
    const json& per = st["wire_bytes_per_sample"];
    const double bytes = per.value("activations", 0.0) + per.value("gradients", 0.0);
    raw[codec] = {{"codec", spec.compression.activations}, {"val_loss", st["val_loss"]}, {"train_loss", st["train_loss"]},
                  {"wire_bytes_per_sample", bytes}, {"codec_ms", st["codec_ms"]}, {"tokens_per_s", train_tokens_per_s(st)}};
    char text[256];
    std::snprintf(text, sizeof(text), "%-5s val loss %.4f, %.0f wire bytes per sample (activations + gradients)", codec,
                  st["val_loss"].get<double>(), bytes);
    json line{{"bench", "compression"}, {"case", codec}};
    line.update(raw[codec]);
    emit(as_json, line, text);
  }
  auto rel = [&](const char* c) { return raw[c]["val_loss"].get<double>() / raw["fp32"]["val_loss"].get<double>() - 1.0; };
  auto ratio = [&](const char* c) { return raw["fp32"]["wire_bytes_per_sample"].get<double>() / raw[c]["wire_bytes_per_sample"].get<double>(); };
  json summary{{"bench", "compression"},
               {"figures", {{"int8_loss_rel", {{"value", rel("int8")}, {"target", "<= 0.01"}}},
                            {"int8_bytes_ratio", {{"value", ratio("int8")}, {"target", ">= 3.7"}}},
                            {"int4_loss_rel", {{"value", rel("int4")}, {"target", "report"}}},
                            {"int4_bytes_ratio", {{"value", ratio("int4")}, {"target", "report"}}}}},
               {"raw", raw}};
  std::cout << (as_json ? summary.dump() : summary.dump(2)) << std::endl;
  return 0;
}

// The bundled example with 2 peers per stage, same samples and seed, under four ways for a
// stage group to agree: averaging gradients every step (the data-parallel reference), DiLoCo
// rounds every 10 and every 50 steps, and streaming DiLoCo (H = 50, 4 fragments, one synced
// every 12-13 steps and overlapped with the next inner step, int8 outer gradients with error
// feedback). Figures: validation loss and sync bytes (outer gradients up and means down) per
// training sample.
int bench_diloco(bool as_json) {
  struct Case { const char* name; const char* sync; int H; int F; int overlap; const char* codec; };
  const Case cases[] = {{"every_step", "every_step", 10, 1, 0, "fp32"},
                        {"diloco_h10", "rounds", 10, 1, 0, "fp32"},
                        {"diloco_h50", "rounds", 50, 1, 0, "fp32"},
                        {"streaming_h50_f4_int8", "rounds", 50, 4, 1, "int8:block=1024,scale=fp16"}};
  json raw = json::object();
  for (const Case& cs : cases) {
    json j = example_job();
    j["schedule"] = "sync";
    j["diloco"]["sync"] = cs.sync;
    j["diloco"]["inner_steps"] = cs.H;
    j["diloco"]["streaming"] = {{"fragments", cs.F}, {"overlap_steps", cs.overlap}};
    j["compression"]["outer"] = cs.codec;
    JobSpec spec = parse_job_spec(j, true);
    json st = run_swarm(spec, 1, cs.name, 2);
    const double per = st.value("sync_bytes_per_sample", 0.0);
    raw[cs.name] = {{"val_loss", st["val_loss"]}, {"train_loss", st["train_loss"]}, {"sync_bytes_per_sample", per},
                    {"rounds", st["rounds"]}, {"fragment_syncs", st["fragment_syncs"]}, {"hash_mismatches", st["hash_mismatches"]},
                    {"tokens_per_s", train_tokens_per_s(st)}, {"outer_codec", cs.codec}};
    char text[256];
    std::snprintf(text, sizeof(text), "%-22s val loss %.4f, %.0f sync bytes per sample", cs.name, st["val_loss"].get<double>(), per);
    json line{{"bench", "diloco"}, {"case", cs.name}};
    line.update(raw[cs.name]);
    emit(as_json, line, text);
  }
  auto val = [&](const char* c) { return raw[c]["val_loss"].get<double>(); };
  auto bytes = [&](const char* c) { return raw[c]["sync_bytes_per_sample"].get<double>(); };
  json summary{{"bench", "diloco"},
               {"figures", {{"h50_bytes_ratio", {{"value", bytes("every_step") / bytes("diloco_h50")}, {"target", ">= 40"}}},
                            {"h50_loss_rel", {{"value", val("diloco_h50") / val("every_step") - 1.0}, {"target", "<= 0.02"}}},
                            {"h10_loss_rel", {{"value", val("diloco_h10") / val("every_step") - 1.0}, {"target", "report"}}},
                            {"streaming_bytes_ratio_vs_h50", {{"value", bytes("diloco_h50") / bytes("streaming_h50_f4_int8")}, {"target", ">= 4"}}},
                            {"streaming_loss_rel", {{"value", val("streaming_h50_f4_int8") / val("every_step") - 1.0}, {"target", "<= 0.03"}}}}},
               {"raw", raw}};
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
  std::cerr << "swarm bench: unknown benchmark '" << name << "'; available: codec, compression, transport, pipeline, diloco" << std::endl;
  return 2;
}

}  // namespace swarm
