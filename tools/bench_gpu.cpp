// bench_gpu.cpp: `swarm bench gpu` (see bench.h), one CUDA device, four figures in one run:
//   mfu                   the 1-stage swarm's training FLOP/s on GPT-2-medium-sized blocks (12 blocks
//                         of d_model 1024, 16 heads, 1024 tokens) in bf16 (fp16 where the device has
//                         no bf16) ÷ the device's dense peak (tools/gpu_peaks.h)
//   vs_pytorch            the same stage server's tokens/s ÷ PyTorch eager in Python on the same model,
//                         precision, optimizer and GPU (tools/gpu/pytorch_eager.py)
//   gpu_1stage_vs_single  the 1-stage swarm's tokens/s ÷ the single-process reference on the GPU
//   int8_encode_vs_d2d    the device int8 encode's bytes/s ÷ a device-to-device copy of the same bytes
// FLOPs per token: 6 x (parameters but the embeddings) + 12 x layers x d_model x seq_len (the
// attention's products, counted in full as PaLM's and nanoGPT's MFU do). Compiles in every build;
// refuses without a CUDA device or without -DSWARM_CUDA=ON (docs/gpu.md).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "runtime/client.h"
#include "runtime/data.h"
#include "runtime/job_spec.h"
#include "runtime/memory_estimate.h"
#include "stages/device_codec.h"
#include "stages/device_info.h"
#include "stages/precision.h"
#include "stages/reference.h"
#include "tools/bench.h"
#include "tools/gpu_peaks.h"
#include "tools/local_swarm.h"

#ifdef SWARM_CUDA
#include <c10/cuda/CUDACachingAllocator.h>

#include "compression/cuda/bench_cuda.h"
#endif

namespace swarm {

using nlohmann::json;

namespace {

constexpr int kSteps = 30;        // optimizer steps per measured run (32 samples x 1024 tokens each)
constexpr int kCodecReps = 20;
constexpr int64_t kCodecValues = int64_t(64) << 20;  // 256 MiB of fp32

void say(bool as_json, const json& line, const std::string& text) {
  if (as_json) std::cout << line.dump() << std::endl;
  else std::cout << text << std::endl;
}

json read_json(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot read " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return json::parse(ss.str());
}

// 4 MiB of English-like text in a new temp dir: the speed does not depend on the data, and a GPU
// machine need not have the example's (Debian's fortunes).
std::string write_text() {
  char tmpl[] = "/tmp/swarm-bench-gpu-data-XXXXXX";
  const std::string dir = mkdtemp(tmpl) ? tmpl : "/tmp";
  const char* words[] = {"the ", "swarm ", "trains ", "one ", "model ", "across ", "many ", "unequal ", "machines, ",
                         "and ", "every ", "stage ", "keeps ", "its ", "own ", "weights. "};
  std::string text;
  uint64_t x = 7;
  while (text.size() < (size_t(4) << 20)) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    text += words[(x >> 33) % 16];
  }
  std::ofstream(dir + "/text.txt") << text;
  return dir + "/text.txt";
}

// The GPU example's optimizer, one stage of GPT-2-medium-sized blocks, pinned precision.
JobSpec bench_spec(Precision precision) {
  json j = read_json(std::string(SWARM_SOURCE_DIR) + "/examples/gpt2_small/job.json");
  j["name"] = "bench_gpu";
  j["data"] = {{"format", "text"}, {"path", write_text()}, {"val_fraction", 0.1}};
  j["steps"] = kSteps;
  j["schedule"] = "async";  // one peer steps once per job step of 32 samples: the reference's training, no STEP round trips
  j["max_inflight"] = 4;
  j["model"] = {{"vocab_size", 256}, {"d_model", 1024}, {"n_head", 16}, {"n_layer", 12}, {"seq_len", 1024},
                {"precision", precision_name(precision)}};
  j["partition"] = {{"stages", 1}};
  j["batch"] = {{"batch_size", 32}, {"microbatch_size", 8}};
  j["compression"] = {{"activations", "fp32"}, {"gradients", "fp32"}, {"outer", "fp32"}};
  j["diloco"] = {{"inner_steps", 100000}, {"warm_start_steps", 0}};  // no round, no flush at every step
  j["eval"] = {{"every_steps", 0}, {"batches", 1}};
  j.erase("checkpoint");
  return parse_job_spec(j, true);
}

double flops_per_token(const JobSpec& s) {
  const double C = s.model.d_model, L = s.model.n_layer, T = s.model.seq_len;
  const double embeddings = double(s.model.vocab_size) * C + double(s.model.max_seq_len) * C;
  return 6.0 * (double(stage_parameters(s, 0)) - embeddings) + 12.0 * L * C * T;
}

// Tokens/s of the swarm's training steps (the last history entry with a train loss).
double swarm_tokens_per_s(const JobSpec& spec, Precision precision) {
  char tmpl[] = "/tmp/swarm-bench-gpu-XXXXXX";
  LocalSwarm swarm(mkdtemp(tmpl) ? tmpl : "/tmp");
  swarm.start_router();
  swarm.start_stage(0, "gpu0", 0, {"--device", "cuda:0", "--precision", precision_name(precision)});
  Client c(swarm.router_endpoint());
  const uint64_t id = c.request_body(wire::MsgType::kSubmit, json{{"spec", to_json(spec)}}).at("job_id").get<uint64_t>();
  FollowOptions fo;
  fo.quiet = true;
  fo.poll_s = 0.2;
  fo.timeout_s = 600;
  const json st = follow_job(c, id, fo);
  swarm.stop_all();
  if (st.value("state", std::string()) != "done")
    throw std::runtime_error("the 1-stage GPU swarm failed: " + st.value("reason", std::string()) + " (logs in " + swarm.log_dir() + ")");
  double tps = 0;
  for (const auto& h : st["history"])
    if (h.contains("train_loss")) tps = h.value("tokens_per_s", 0.0);
  return tps;
}

// tools/gpu/pytorch_eager.py on the same shapes: its last JSON line.
json pytorch_eager(const JobSpec& s, Precision precision) {
  const char* py = std::getenv("SWARM_PYTHON");
  std::ostringstream cmd;
  cmd << (py ? py : "python3") << " " << SWARM_SOURCE_DIR << "/tools/gpu/pytorch_eager.py --json"
      << " --vocab " << s.model.vocab_size << " --d-model " << s.model.d_model << " --n-head " << s.model.n_head
      << " --n-layer " << s.model.n_layer << " --seq-len " << s.model.seq_len << " --microbatch " << s.batch.microbatch_size
      << " --batch " << s.batch.batch_size << " --steps " << s.steps << " --precision " << precision_name(precision)
      << " --lr " << s.optimizer.lr << " --weight-decay " << s.optimizer.weight_decay << " --grad-clip " << s.optimizer.grad_clip
      << " 2>&1";
  FILE* p = popen(cmd.str().c_str(), "r");
  if (!p) throw std::runtime_error("cannot run " + cmd.str());
  std::string out, last;
  char buf[4096];
  while (fgets(buf, sizeof buf, p)) {
    out += buf;
    if (buf[0] == '{') last = buf;
  }
  const int rc = pclose(p);
  if (rc != 0 || last.empty()) throw std::runtime_error("PyTorch eager run failed (" + cmd.str() + "):\n" + out);
  return json::parse(last);
}

}  // namespace

int run_gpu_bench(bool as_json) {
  const bool cuda = torch::cuda::is_available();
  if (!cuda || !device_codecs_available()) {
    std::cerr << "swarm bench gpu: needs a CUDA device and a build against a CUDA libtorch with -DSWARM_CUDA=ON "
                 "(docs/gpu.md, tools/gpu-check.sh). This build: libtorch " TORCH_VERSION ", SWARM_CUDA "
              << (device_codecs_available() ? "on" : "off") << ", CUDA devices " << (cuda ? torch::cuda::device_count() : 0)
              << "." << std::endl;
    return 2;
  }
  const torch::Device dev("cuda:0");
  const DeviceInfo info = query_device("cuda:0");
  const Precision precision = auto_precision(device_caps(dev, info));
  const JobSpec spec = bench_spec(precision);
  const double fpt = flops_per_token(spec);
  say(as_json, json{{"bench", "gpu"}, {"device", info.name}, {"compute_capability", std::to_string(info.cc_major) + "." + std::to_string(info.cc_minor)},
                    {"precision", precision_name(precision)}, {"params", stage_parameters(spec, 0)}, {"flops_per_token", fpt}},
      "device " + info.name + ", " + precision_name(precision) + ", " + std::to_string(stage_parameters(spec, 0)) + " parameters");

  // The single-process reference on the GPU.
  const TokenData data = TokenData::load(spec.data, spec.model.seq_len, spec.model.vocab_size);
  ReferenceOptions ro;
  ro.device = "cuda:0";
  ro.precision = precision;
  const double single = train_reference(spec, data, ro).tokens_per_s;
#ifdef SWARM_CUDA
  c10::cuda::CUDACachingAllocator::emptyCache();  // the stage server below needs the memory
#endif
  say(as_json, json{{"bench", "gpu"}, {"case", "single"}, {"tokens_per_s", single}}, "single process: " + std::to_string(single) + " tokens/s");
  const double swarm1 = swarm_tokens_per_s(spec, precision);
  say(as_json, json{{"bench", "gpu"}, {"case", "swarm_1stage"}, {"tokens_per_s", swarm1}}, "1-stage swarm: " + std::to_string(swarm1) + " tokens/s");
  const json eager = pytorch_eager(spec, precision);
  const double torch_tps = eager.value("tokens_per_s", 0.0);
  say(as_json, json{{"bench", "gpu"}, {"case", "pytorch_eager"}, {"result", eager}}, "PyTorch eager: " + std::to_string(torch_tps) + " tokens/s");

  json codec = json::object();
  double encode_vs_d2d = 0;
#ifdef SWARM_CUDA
  const compression::cuda::EncodeTiming t =
      compression::cuda::time_encode_vs_d2d(compression::parse_codec("int8:block=64"), kCodecValues, kCodecReps);
  encode_vs_d2d = t.copy_s / t.encode_s;
  codec = {{"codec", "int8:block=64"}, {"values", t.values}, {"encode_s", t.encode_s}, {"copy_s", t.copy_s},
           {"encode_gb_per_s", t.encode_bytes_per_s() / 1e9}, {"copy_gb_per_s", t.copy_bytes_per_s() / 1e9}};
#endif
  say(as_json, json{{"bench", "gpu"}, {"case", "int8_encode"}, {"result", codec}}, "int8 encode vs copy: " + std::to_string(encode_vs_d2d));

  const std::optional<GpuPeak> peak = gpu_peak(info.name);
  const double peak_tflops = !peak ? 0 : precision == Precision::kBf16 ? peak->bf16_tflops : peak->fp16_tflops;
  const json mfu = peak_tflops > 0 ? json(swarm1 * fpt / (peak_tflops * 1e12)) : json(nullptr);
  json summary{
      {"bench", "gpu"},
      {"figures",
       {{"mfu", {{"value", mfu}, {"target", peak_tflops > 0 ? "report (goal >= 0.4)" : "report: " + info.name + " is not in tools/gpu_peaks.cpp"}}},
        {"vs_pytorch", {{"value", torch_tps > 0 ? swarm1 / torch_tps : 0.0}, {"target", ">= 1.0"}}},
        {"gpu_1stage_vs_single", {{"value", single > 0 ? swarm1 / single : 0.0}, {"target", ">= 0.9"}}},
        {"int8_encode_vs_d2d", {{"value", encode_vs_d2d}, {"target", ">= 0.3"}}}}},
      {"raw",
       {{"device", info.name}, {"precision", precision_name(precision)}, {"peak_tflops", peak_tflops},
        {"peak_row", peak ? peak->model : ""}, {"flops_per_token", fpt}, {"params", stage_parameters(spec, 0)},
        {"tokens_per_step", spec.batch.batch_size * spec.model.seq_len}, {"steps", spec.steps},
        {"single_tokens_per_s", single}, {"swarm1_tokens_per_s", swarm1}, {"pytorch_eager", eager}, {"int8_encode", codec},
        {"libtorch", TORCH_VERSION}}}};
  std::cout << (as_json ? summary.dump() : summary.dump(2)) << std::endl;
  return 0;
}

}  // namespace swarm
