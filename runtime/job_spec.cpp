// job_spec.cpp: parsing, validation and canonical JSON of the job spec (runtime/job_spec.h).
//
// Parsing walks the JSON with a field path ("model.n_head") so that every SpecError names the
// field it is about and says what to change. Unknown keys are errors (a typo would otherwise
// silently train with a default), with a "did you mean" suggestion by edit distance.
// Validation runs on the filled struct, after the derived defaults (max_inflight,
// max_seq_len, layers_per_stage, inner_batch) are set.
#include "runtime/job_spec.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <sstream>

#include "runtime/codec_spec.h"
#include "runtime/errors.h"
#include "runtime/text.h"
#include "runtime/limits.h"

namespace swarm {
namespace {

using nlohmann::json;

[[noreturn]] void fail(const std::string& path, const std::string& msg) {
  throw SpecError("job spec: " + path + ": " + msg);
}

std::string join_path(const std::string& parent, const std::string& key) {
  return parent.empty() ? key : parent + "." + key;
}

std::string num(double v) { return shortest_number(v); }

std::string quote(const std::string& s) { return "\"" + clip(s) + "\""; }
const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "an integer";
    case json::value_t::number_float: return "a number";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "a list";
    case json::value_t::object: return "an object";
    default: return "an unsupported value";
  }
}

// One JSON object being read: checks its keys against the allowed ones before any field is
// read, and reads fields with type checks.
class Obj {
 public:
  Obj(const json& j, std::string path, std::initializer_list<const char*> keys)
      : j_(j), path_(std::move(path)) {
    if (!j_.is_object()) {
      fail(path_.empty() ? "(top level)" : path_,
           std::string("must be an object {...}, got ") + type_name(j_));
    }
    std::vector<std::string> allowed(keys.begin(), keys.end());
    for (const auto& item : j_.items()) {
      const std::string& k = item.key();
      if (std::find(allowed.begin(), allowed.end(), k) != allowed.end()) continue;
      const std::string best = did_you_mean(k, allowed);
      std::string msg = "unknown key " + quote(k);
      if (!best.empty()) {
        msg += ": did you mean " + quote(join_path(path_, best)) + "?";
      } else {
        msg += "; the keys allowed here are:";
        for (size_t i = 0; i < allowed.size(); ++i) msg += (i ? ", " : " ") + allowed[i];
      }
      fail(join_path(path_, clip(k)), msg);
    }
  }

  const json* find(const char* key) const {
    auto it = j_.find(key);
    if (it == j_.end()) return nullptr;
    if (it->is_null()) {
      fail(join_path(path_, key), "is null; remove the key to use the default, or give a value");
    }
    return &*it;
  }
  std::string at(const char* key) const { return join_path(path_, key); }

  void get(const char* key, int& out) const {
    const json* v = find(key);
    if (!v) return;
    int64_t x = 0;
    if (v->is_number_integer() || v->is_number_unsigned()) {
      if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(std::numeric_limits<int>::max())) {
        fail(at(key), "value " + shown_json(*v) + " is too large");
      }
      x = v->get<int64_t>();
    } else if (v->is_number_float()) {
      double d = v->get<double>();
      if (!std::isfinite(d) || d != std::floor(d)) {
        fail(at(key), "must be a whole number, got " + shown_json(*v));
      }
      if (std::fabs(d) > double(std::numeric_limits<int>::max())) {
        fail(at(key), "value " + shown_json(*v) + " is too large");
      }
      x = int64_t(d);
    } else {
      fail(at(key), std::string("must be an integer, got ") + type_name(*v) + " " + shown_json(*v));
    }
    if (x > std::numeric_limits<int>::max() || x < std::numeric_limits<int>::min()) {
      fail(at(key), "value " + shown_json(*v) + " is too large");
    }
    out = int(x);
  }

  void get(const char* key, uint64_t& out) const {
    const json* v = find(key);
    if (!v) return;
    if (v->is_number_unsigned()) {
      out = v->get<uint64_t>();
    } else if (v->is_number_integer()) {
      int64_t x = v->get<int64_t>();
      if (x < 0) fail(at(key), "must be a non-negative integer, got " + shown_json(*v));
      out = uint64_t(x);
    } else {
      fail(at(key), std::string("must be a non-negative integer, got ") + type_name(*v) + " " +
                        shown_json(*v));
    }
  }

  void get(const char* key, double& out) const {
    const json* v = find(key);
    if (!v) return;
    if (!v->is_number()) {
      fail(at(key), std::string("must be a number, got ") + type_name(*v) + " " + shown_json(*v));
    }
    out = v->get<double>();
    if (!std::isfinite(out)) fail(at(key), "must be a finite number");
  }

  void get(const char* key, bool& out) const {
    const json* v = find(key);
    if (!v) return;
    if (!v->is_boolean()) {
      fail(at(key), std::string("must be true or false, got ") + type_name(*v) + " " + shown_json(*v));
    }
    out = v->get<bool>();
  }

  void get(const char* key, std::string& out) const {
    const json* v = find(key);
    if (!v) return;
    if (!v->is_string()) {
      fail(at(key), std::string("must be a string, got ") + type_name(*v) + " " + shown_json(*v));
    }
    out = v->get<std::string>();
    if (out.size() > limits::kMaxStringBytes) {
      fail(at(key), "is " + std::to_string(out.size()) + " bytes, over the limit of " +
                        std::to_string(limits::kMaxStringBytes));
    }
  }

  void get(const char* key, std::vector<int>& out) const {
    const json* v = find(key);
    if (!v) return;
    if (!v->is_array()) {
      fail(at(key), std::string("must be a list of integers, got ") + type_name(*v) + " " +
                        shown_json(*v));
    }
    if (v->size() > size_t(limits::kMaxStages)) {
      fail(at(key), "has " + std::to_string(v->size()) + " entries, over the limit of " +
                        std::to_string(limits::kMaxStages) + " stages");
    }
    out.clear();
    for (size_t i = 0; i < v->size(); ++i) {
      const json& e = (*v)[i];
      std::string p = at(key) + "[" + std::to_string(i) + "]";
      if (e.is_number_integer() && e.get<int64_t>() >= std::numeric_limits<int>::min() &&
          e.get<int64_t>() <= std::numeric_limits<int>::max()) {
        out.push_back(int(e.get<int64_t>()));
      } else if (e.is_number_unsigned()) {
        fail(p, "value " + shown_json(e) + " is too large");
      } else {
        fail(p, std::string("must be an integer, got ") + type_name(e) + " " + shown_json(e));
      }
    }
  }

  // A sub-object, or nullptr when absent.
  const json* sub(const char* key) const { return find(key); }

 private:
  const json& j_;
  std::string path_;
};

void read_paths(const Obj& o, std::vector<std::string>& out) {
  const json* v = o.find("path");
  if (!v) {
    fail(o.at("path"), "is required: the file (or a list of files) to train on, e.g. "
                       "\"path\": [\"/usr/share/games/fortunes/fortunes\"]");
  }
  out.clear();
  auto take = [&](const json& e, const std::string& p) {
    if (!e.is_string()) {
      fail(p, std::string("must be a file path (string), got ") + type_name(e) + " " + shown_json(e));
    }
    std::string s = e.get<std::string>();
    if (s.empty()) fail(p, "is an empty string; give a file path");
    if (s.size() > limits::kMaxStringBytes) fail(p, "is too long");
    out.push_back(std::move(s));
  };
  if (v->is_string()) {
    take(*v, o.at("path"));
  } else if (v->is_array()) {
    if (v->empty()) fail(o.at("path"), "is an empty list; give at least one file");
    if (v->size() > limits::kMaxDataPaths) {
      fail(o.at("path"), "has " + std::to_string(v->size()) + " files, over the limit of " +
                             std::to_string(limits::kMaxDataPaths) + "; concatenate them into fewer files");
    }
    for (size_t i = 0; i < v->size(); ++i) take((*v)[i], o.at("path") + "[" + std::to_string(i) + "]");
  } else {
    fail(o.at("path"), std::string("must be a file path or a list of file paths, got ") +
                           type_name(*v) + " " + shown_json(*v));
  }
}

std::string list_str(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// n layers over s stages, the first (n % s) stages taking one more.
std::vector<int> near_even_split(int n, int s) {
  std::vector<int> v(size_t(s), n / s);
  for (int i = 0; i < n % s; ++i) v[size_t(i)] += 1;
  return v;
}

// The divisor of n closest to want (the smaller one on a tie), for suggestions.
int nearest_divisor(int n, int want) {
  int best = 1;
  // Only divisors below 2 * want can be closer than 1; the cap keeps absurd inputs cheap.
  const int last = int(std::min<int64_t>({int64_t(n), 2 * int64_t(want), 1 << 20}));
  for (int d = 1; d <= last; ++d) {
    if (n % d == 0 && std::abs(d - want) < std::abs(best - want)) best = d;
  }
  return best;
}

void require_positive(const std::string& path, int v, const std::string& hint = "") {
  if (v < 1) fail(path, "must be at least 1, got " + std::to_string(v) + (hint.empty() ? "" : "; " + hint));
}

void check_file(const std::string& path, const std::string& field) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    fail(field, quote(path) + " is a directory; list the files in it instead");
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    // A device, FIFO or socket: reading it could block or never end (/dev/zero).
    fail(field, quote(path) + " is not a regular file (a device, FIFO or socket); name a file of training data");
  }
  std::ifstream f(path, std::ios::binary);
  if (f) return;
  int err = errno;
  std::string msg = "cannot read " + quote(path) + " (" + std::strerror(err) + ")";
  if (path.find("/usr/share/games/fortunes") == 0) {
    msg += "; this is the bundled example's data: tools/install-deps.sh installs Debian's "
           "`fortunes` package that provides it (or: sudo apt-get install fortunes)";
  } else {
    msg += "; check the path (relative paths are relative to the directory the process runs in)";
  }
  fail(field, msg);
}

// The enum a string field names, or a SpecError listing what it may be.
template <class E>
E choose(const std::string& path, const std::string& value, std::initializer_list<std::pair<const char*, E>> options,
         const std::string& allowed) {
  for (const auto& [name, e] : options)
    if (value == name) return e;
  fail(path, "must be " + allowed + ", got " + quote(value));
}

// Fills derived defaults and checks every rule. `s` comes from the parser, so types are right.
void fill_and_validate(JobSpec& s, bool check_files) {
  if (s.name.empty()) fail("name", "must not be empty; name the job, e.g. \"tiny_gpt\"");
  require_positive("steps", s.steps, "the number of optimizer steps to train");

  // model
  ModelSpec& m = s.model;
  require_positive("model.vocab_size", m.vocab_size, "256 for text read as bytes");
  require_positive("model.d_model", m.d_model);
  require_positive("model.n_head", m.n_head);
  require_positive("model.n_layer", m.n_layer);
  require_positive("model.seq_len", m.seq_len);
  if (m.max_seq_len < 0) {
    fail("model.max_seq_len", "must be >= 0 (0 means model.seq_len), got " + std::to_string(m.max_seq_len));
  }
  if (m.d_model % m.n_head != 0) {
    fail("model.n_head", "model.d_model " + std::to_string(m.d_model) + " is not divisible by model.n_head " +
                             std::to_string(m.n_head) + "; each head gets d_model / n_head channels, so pick "
                             "n_head dividing d_model (e.g. " + std::to_string(nearest_divisor(m.d_model, m.n_head)) +
                             ") or change d_model");
  }
  if (m.max_seq_len == 0) m.max_seq_len = m.seq_len;
  if (m.seq_len > m.max_seq_len) {
    fail("model.seq_len", "model.seq_len " + std::to_string(m.seq_len) + " is over the model's maximum model.max_seq_len " +
                              std::to_string(m.max_seq_len) + ": lower model.seq_len or raise model.max_seq_len "
                              "(the number of position embeddings)");
  }

  if (m.precision != "auto" && m.precision != "fp32" && m.precision != "bf16" && m.precision != "fp16") {
    fail("model.precision", "must be \"auto\" (each peer chooses: bf16 on A100/H100-class GPUs, fp16 on older "
                            "ones, fp32 on CPUs), \"fp32\", \"bf16\" or \"fp16\", got " + quote(m.precision));
  }
  if (m.loss_scale != "auto" && m.loss_scale != "dynamic" && m.loss_scale != "none") {
    fail("model.loss_scale", "must be \"auto\" (dynamic loss scaling on peers that compute in fp16), \"dynamic\" "
                             "(on every peer) or \"none\", got " + quote(m.loss_scale));
  }

  // partition
  PartitionSpec& p = s.partition;
  require_positive("partition.stages", p.stages);
  if (p.stages > limits::kMaxStages) {
    fail("partition.stages", std::to_string(p.stages) + " stages are over the limit of " +
                                 std::to_string(limits::kMaxStages) + " (limits::kMaxStages); use fewer stages");
  }
  if (p.layers_per_stage.empty()) {
    if (m.n_layer < p.stages) {
      fail("partition.stages", std::to_string(p.stages) + " stages need at least one layer each, but model.n_layer is " +
                                   std::to_string(m.n_layer) + "; use at most " + std::to_string(m.n_layer) +
                                   " stages or more layers");
    }
    if (m.n_layer % p.stages != 0) {
      fail("partition.layers_per_stage",
           std::to_string(m.n_layer) + " layers over " + std::to_string(p.stages) +
               " stages do not split evenly: set partition.layers_per_stage, e.g. " +
               list_str(near_even_split(m.n_layer, p.stages)) + ", or change model.n_layer or partition.stages");
    }
    p.layers_per_stage.assign(size_t(p.stages), m.n_layer / p.stages);
  } else {
    if (int(p.layers_per_stage.size()) != p.stages) {
      fail("partition.layers_per_stage",
           "has " + std::to_string(p.layers_per_stage.size()) + " entries but partition.stages is " +
               std::to_string(p.stages) + "; give one layer count per stage");
    }
    long long sum = 0;
    for (size_t i = 0; i < p.layers_per_stage.size(); ++i) {
      if (p.layers_per_stage[i] < 1) {
        fail("partition.layers_per_stage[" + std::to_string(i) + "]",
             "is " + std::to_string(p.layers_per_stage[i]) + "; every stage needs at least 1 layer");
      }
      sum += p.layers_per_stage[i];
    }
    if (sum != m.n_layer) {
      fail("partition.layers_per_stage",
           list_str(p.layers_per_stage) + " sums to " + std::to_string(sum) + " layers but model.n_layer is " +
               std::to_string(m.n_layer) + "; make the entries sum to model.n_layer");
    }
  }

  // data
  DataSpec& d = s.data;
  if (d.format != "text" && d.format != "bin") {
    fail("data.format", "must be \"text\" (any file, every byte a token) or \"bin\" (nanoGPT-style "
                        "little-endian uint16 tokens), got " + quote(d.format));
  }
  if (d.format == "text" && m.vocab_size != 256) {
    fail("model.vocab_size", "is " + std::to_string(m.vocab_size) + " but data.format \"text\" reads every byte as "
                                 "a token, so the vocabulary is exactly the 256 byte values: set model.vocab_size "
                                 "to 256, or use data.format \"bin\" for tokenized data");
  }
  if (d.format == "bin" && m.vocab_size > 65536) {
    fail("model.vocab_size", "is " + std::to_string(m.vocab_size) + " but data.format \"bin\" holds uint16 tokens "
                                 "(at most 65536 distinct values); use a vocabulary of at most 65536");
  }
  if (d.paths.empty()) fail("data.path", "is required: the file (or a list of files) to train on");
  if (!(d.val_fraction > 0.0 && d.val_fraction < 1.0)) {
    fail("data.val_fraction", "must be between 0 and 1 (exclusive), got " + num(d.val_fraction) +
                                  "; e.g. 0.1 keeps the last 10% of the tokens for validation");
  }

  // batch
  BatchSpec& b = s.batch;
  require_positive("batch.batch_size", b.batch_size);
  require_positive("batch.microbatch_size", b.microbatch_size);
  if (b.batch_size % b.microbatch_size != 0) {
    fail("batch.batch_size", "batch.batch_size " + std::to_string(b.batch_size) +
                                 " is not divisible by batch.microbatch_size " + std::to_string(b.microbatch_size) +
                                 "; a step is a whole number of microbatches, so make batch_size a multiple of "
                                 "microbatch_size");
  }
  // One job step in flight by default, at least one microbatch per stage: more keeps more peers
  // busy but makes asynchronous gradients staler (docs/schedules.md).
  if (s.max_inflight < 0) fail("max_inflight", "must be >= 0 (0 means one job step's microbatches, at least partition.stages)");
  if (s.max_inflight == 0) s.max_inflight = std::max(p.stages, b.batch_size / b.microbatch_size);
  if (s.max_inflight > limits::kMaxInflight)
    fail("max_inflight", std::to_string(s.max_inflight) + " is over the limit of " + std::to_string(limits::kMaxInflight) +
                             " microbatches in flight (limits::kMaxInflight); a few per stage keep every stage busy");
  if (b.inner_batch < 0) fail("batch.inner_batch", "must be >= 0 (0 means batch.batch_size)");
  if (b.inner_batch == 0) b.inner_batch = b.batch_size;
  if (b.inner_batch % b.microbatch_size != 0) {
    fail("batch.inner_batch", "batch.inner_batch " + std::to_string(b.inner_batch) +
                                  " is not divisible by batch.microbatch_size " + std::to_string(b.microbatch_size) +
                                  "; a peer accumulates whole microbatches, so make it a multiple of microbatch_size");
  }
  const double act_bytes = 4.0 * b.microbatch_size * double(m.seq_len) * double(m.d_model);
  if (act_bytes > double(limits::kMaxMicrobatchBytes))
    fail("batch.microbatch_size", "one microbatch's activations, [" + std::to_string(b.microbatch_size) + ", " +
                                      std::to_string(m.seq_len) + ", " + std::to_string(m.d_model) + "] in fp32, take " +
                                      num(act_bytes) + " bytes, over the wire's limit of " + std::to_string(limits::kMaxMicrobatchBytes) +
                                      "; use smaller microbatches");
  OptimizerSpec& o = s.optimizer;
  if (o.name != "adamw" && o.name != "sgd") {
    fail("optimizer.name", "must be \"adamw\" or \"sgd\" (plain SGD with the same schedule, clipping and decay), got " + quote(o.name));
  }
  if (!(o.lr > 0)) fail("optimizer.lr", "must be > 0, got " + num(o.lr) + "; e.g. 1e-3");
  if (o.min_lr < 0) fail("optimizer.min_lr", "must be >= 0, got " + num(o.min_lr));
  if (o.min_lr > o.lr) {
    fail("optimizer.min_lr", "optimizer.min_lr " + num(o.min_lr) + " is above optimizer.lr " + num(o.lr) +
                                 "; the schedule decays from lr down to min_lr, so set min_lr <= lr (e.g. lr / 10)");
  }
  if (o.warmup_steps < 0) fail("optimizer.warmup_steps", "must be >= 0, got " + std::to_string(o.warmup_steps));
  if (o.weight_decay < 0) fail("optimizer.weight_decay", "must be >= 0, got " + num(o.weight_decay));
  if (!(o.beta1 >= 0 && o.beta1 < 1)) {
    fail("optimizer.beta1", "must be in [0, 1), got " + num(o.beta1) + "; the usual value is 0.9");
  }
  if (!(o.beta2 >= 0 && o.beta2 < 1)) {
    fail("optimizer.beta2", "must be in [0, 1), got " + num(o.beta2) + "; the usual values are 0.95 to 0.999");
  }
  if (!(o.eps > 0)) fail("optimizer.eps", "must be > 0, got " + num(o.eps) + "; e.g. 1e-8");
  if (o.grad_clip < 0) fail("optimizer.grad_clip", "must be >= 0 (0 disables clipping), got " + num(o.grad_clip));

  // diloco
  DilocoSpec& dl = s.diloco;
  require_positive("diloco.inner_steps", dl.inner_steps, "the number of job steps between weight syncs (H)");
  if (!(dl.outer_lr > 0)) fail("diloco.outer_lr", "must be > 0, got " + num(dl.outer_lr) + "; DiLoCo uses 0.7");
  if (!(dl.outer_momentum >= 0 && dl.outer_momentum < 1)) {
    fail("diloco.outer_momentum", "must be in [0, 1), got " + num(dl.outer_momentum) + "; DiLoCo uses 0.9");
  }
  if (!(dl.deadline_s > 0)) fail("diloco.deadline_s", "must be > 0 seconds, got " + num(dl.deadline_s));
  require_positive("diloco.streaming.fragments", dl.fragments, "the number of parameter fragments (1: no streaming)");
  if (dl.fragments > dl.inner_steps) {
    fail("diloco.streaming.fragments", std::to_string(dl.fragments) + " fragments but diloco.inner_steps is " +
                                           std::to_string(dl.inner_steps) + "; each fragment syncs once every inner_steps "
                                           "steps, at most one per step, so use at most inner_steps fragments");
  }
  if (dl.overlap_steps < 0 || dl.overlap_steps >= std::max(1, dl.inner_steps / dl.fragments)) {
    fail("diloco.streaming.overlap_steps", "must be >= 0 and below inner_steps / fragments (" +
                                               std::to_string(dl.inner_steps / dl.fragments) + "), got " +
                                               std::to_string(dl.overlap_steps) + ": a fragment's exchange must land before the next one starts");
  }
  if (dl.warm_start_steps < -1) {
    fail("diloco.warm_start_steps", "must be >= 0 (0: rounds from the first step), or -1 for the default, got " +
                                        std::to_string(dl.warm_start_steps));
  }
  if (dl.warm_start_steps == -1) {
    dl.warm_start_steps = dl.sync == DilocoSync::kRounds ? int(double(s.steps) * kAutoWarmStartFraction) : 0;
  }
  if (dl.rounds == RoundTiming::kAlongside && s.schedule == Schedule::kSync) {
    fail("diloco.rounds", "\"alongside\" runs rounds without draining the pipeline, but schedule \"sync\" drains it at every "
                          "step; use \"auto\" or \"at_barrier\" with sync, or schedule \"async\"");
  }
  if (dl.sync == DilocoSync::kEveryStep && s.schedule != Schedule::kSync) {
    fail("diloco.sync", "\"every_step\" averages gradients at every optimizer step, which needs schedule \"sync\" "
                        "(a barrier at every step); set \"schedule\": \"sync\"");
  }

  // checkpoint
  if (s.checkpoint.every_steps < 0) fail("checkpoint.every_steps", "must be >= 0 (0 writes one at the end)");
  require_positive("checkpoint.keep", s.checkpoint.keep, "the number of checkpoints kept");
  if (s.checkpoint.snapshot_every_steps < 0) fail("checkpoint.snapshot_every_steps", "must be >= 0 (0 snapshots after every round)");

  // routing
  if (!(s.routing.rebalance_period_s > 0)) fail("routing.rebalance_period_s", "must be > 0 seconds");
  if (!(s.routing.min_gain >= 0)) fail("routing.min_gain", "must be >= 0 (a fraction, e.g. 0.1)");
  if (!(s.routing.cooldown_s >= 0)) fail("routing.cooldown_s", "must be >= 0 seconds");
  if (s.routing.start_peers < 1 || s.routing.start_peers > 4096) fail("routing.start_peers", "must be 1 to 4096 ready peers per stage");
  if (!(s.routing.start_wait_s >= 0 && s.routing.start_wait_s <= 86400)) fail("routing.start_wait_s", "must be 0 to 86400 seconds");
  if (!(s.routing.max_queued_s >= 0 && s.routing.max_queued_s <= 3600))
    fail("routing.max_queued_s", "must be 0 to 3600 seconds of a peer's work (0: no bound)");

  // compression: the codec grammar (runtime/codec_spec.h) names what is wrong and what is accepted.
  for (const auto& [field, text] : {std::make_pair("compression.activations", &s.compression.activations),
                                    std::make_pair("compression.gradients", &s.compression.gradients),
                                    std::make_pair("compression.outer", &s.compression.outer)}) {
    if (text->empty()) fail(field, "must name a codec, e.g. \"fp32\"");
    try {
      compression::parse_codec(*text);
    } catch (const CodecError& e) {
      fail(field, e.what());
    }
  }
  try {  // what the subspace codec asks of the job as a whole: one k, not on outer gradients, k < d_model
    compression::subspace_job(s.compression.activations, s.compression.gradients, s.compression.outer, m.d_model, m.vocab_size);
  } catch (const CodecError& e) {
    throw SpecError(std::string("job spec: ") + e.what());
  }

  // eval
  if (s.eval.every_steps < 0) {
    fail("eval.every_steps", "must be >= 0 (0 evaluates only at the end), got " + std::to_string(s.eval.every_steps));
  }
  require_positive("eval.batches", s.eval.batches, "the number of validation microbatches per evaluation");

  // timeouts
  if (!(s.timeouts.forward_s > 0)) fail("timeouts.forward_s", "must be > 0 seconds, got " + num(s.timeouts.forward_s));
  if (!(s.timeouts.backward_s > 0)) fail("timeouts.backward_s", "must be > 0 seconds, got " + num(s.timeouts.backward_s));
  require_positive("timeouts.max_attempts", s.timeouts.max_attempts, "the attempts per hop before the job fails");

  // Files last: a spec with several mistakes reports its own mistakes before the environment's.
  if (check_files) {
    for (size_t i = 0; i < d.paths.size(); ++i) {
      check_file(d.paths[i], d.paths.size() == 1 ? "data.path" : "data.path[" + std::to_string(i) + "]");
    }
  }
}

// nlohmann's message without its "[json.exception.parse_error.101] parse error at line 1,
// column 35: " prefix, which repeats what we already say.
std::string parser_reason(const std::string& what) {
  size_t col = what.find("column ");
  if (col != std::string::npos) {
    size_t colon = what.find(": ", col);
    if (colon != std::string::npos) return what.substr(colon + 2);
  }
  size_t bracket = what.find("] ");
  return bracket == std::string::npos ? what : what.substr(bracket + 2);
}

}  // namespace

const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::kSync: return "sync";
    case Schedule::kAsyncLocal: return "async_local";
    default: return "async";
  }
}

bool dense_step(const JobSpec& spec, int step) {
  return spec.diloco.sync == DilocoSync::kEveryStep || step <= spec.diloco.warm_start_steps;
}
const char* diloco_sync_name(DilocoSync s) { return s == DilocoSync::kEveryStep ? "every_step" : "rounds"; }

const char* round_timing_name(RoundTiming t) {
  switch (t) {
    case RoundTiming::kAlongside: return "alongside";
    case RoundTiming::kAtBarrier: return "at_barrier";
    case RoundTiming::kAuto: break;
  }
  return "auto";
}

bool rounds_alongside(const JobSpec& spec) {
  if (spec.schedule == Schedule::kSync) return false;
  if (spec.diloco.rounds == RoundTiming::kAuto) return spec.max_inflight > spec.microbatches_per_step();
  return spec.diloco.rounds == RoundTiming::kAlongside;
}
const char* routing_mode_name(RoutingMode m) { return m == RoutingMode::kStatic ? "static" : "swarm"; }
const char* hops_name(Hops h) { return h == Hops::kHub ? "hub" : "p2p"; }

int JobSpec::first_layer(int stage) const {
  SWARM_CHECK(int(partition.layers_per_stage.size()) == partition.stages,
              "layers_per_stage is filled by parse_job_spec");
  SWARM_CHECK(stage >= 0 && stage <= partition.stages, "stage " + std::to_string(stage) + " out of range");
  int first = 0;
  for (int i = 0; i < stage; ++i) first += partition.layers_per_stage[size_t(i)];
  return first;
}

JobSpec parse_job_spec(const json& j, bool check_files) {
  JobSpec s;
  Obj top(j, "", {"name", "seed", "steps", "schedule", "max_inflight", "model", "partition", "data", "batch",
                  "optimizer", "diloco", "compression", "eval", "timeouts", "checkpoint", "routing"});
  top.get("name", s.name);
  top.get("seed", s.seed);
  top.get("steps", s.steps);
  std::string schedule = schedule_name(s.schedule);
  top.get("schedule", schedule);
  s.schedule = choose<Schedule>("schedule", schedule, {{"async", Schedule::kAsync}, {"sync", Schedule::kSync}, {"async_local", Schedule::kAsyncLocal}},
                                "\"async\" (no flush, one step per job step), \"sync\" (flush at every step, exact) "
                                "or \"async_local\" (no flush, each peer steps on its own)");
  top.get("max_inflight", s.max_inflight);

  if (const json* v = top.sub("model")) {
    Obj o(*v, "model", {"vocab_size", "d_model", "n_head", "n_layer", "seq_len", "max_seq_len", "bias", "precision", "loss_scale"});
    o.get("vocab_size", s.model.vocab_size);
    o.get("d_model", s.model.d_model);
    o.get("n_head", s.model.n_head);
    o.get("n_layer", s.model.n_layer);
    o.get("seq_len", s.model.seq_len);
    o.get("max_seq_len", s.model.max_seq_len);
    o.get("bias", s.model.bias);
    o.get("precision", s.model.precision);
    o.get("loss_scale", s.model.loss_scale);
  }
  if (const json* v = top.sub("partition")) {
    Obj o(*v, "partition", {"stages", "layers_per_stage"});
    o.get("stages", s.partition.stages);
    o.get("layers_per_stage", s.partition.layers_per_stage);
  }
  const json* data = top.sub("data");
  if (!data) {
    fail("data", "is required: at least {\"path\": \"FILE\"} naming the text (or .bin tokens) to train on");
  }
  {
    Obj o(*data, "data", {"format", "path", "val_fraction"});
    o.get("format", s.data.format);
    read_paths(o, s.data.paths);
    o.get("val_fraction", s.data.val_fraction);
  }
  if (const json* v = top.sub("batch")) {
    Obj o(*v, "batch", {"batch_size", "microbatch_size", "inner_batch"});
    o.get("batch_size", s.batch.batch_size);
    o.get("microbatch_size", s.batch.microbatch_size);
    o.get("inner_batch", s.batch.inner_batch);
  }
  if (const json* v = top.sub("optimizer")) {
    Obj o(*v, "optimizer", {"name", "lr", "min_lr", "warmup_steps", "weight_decay", "beta1", "beta2", "eps", "grad_clip"});
    o.get("name", s.optimizer.name);
    o.get("lr", s.optimizer.lr);
    o.get("min_lr", s.optimizer.min_lr);
    o.get("warmup_steps", s.optimizer.warmup_steps);
    o.get("weight_decay", s.optimizer.weight_decay);
    o.get("beta1", s.optimizer.beta1);
    o.get("beta2", s.optimizer.beta2);
    o.get("eps", s.optimizer.eps);
    o.get("grad_clip", s.optimizer.grad_clip);
  }
  if (const json* v = top.sub("diloco")) {
    Obj o(*v, "diloco", {"inner_steps", "outer_lr", "outer_momentum", "nesterov", "deadline_s", "sync", "warm_start_steps", "streaming", "rounds"});
    o.get("inner_steps", s.diloco.inner_steps);
    o.get("outer_lr", s.diloco.outer_lr);
    o.get("outer_momentum", s.diloco.outer_momentum);
    o.get("nesterov", s.diloco.nesterov);
    o.get("deadline_s", s.diloco.deadline_s);
    std::string sync = diloco_sync_name(s.diloco.sync);
    o.get("sync", sync);
    s.diloco.sync = choose<DilocoSync>("diloco.sync", sync, {{"rounds", DilocoSync::kRounds}, {"every_step", DilocoSync::kEveryStep}},
                                       "\"rounds\" (DiLoCo: an outer step every inner_steps) or \"every_step\" "
                                       "(average gradients every step, the data-parallel reference)");
    o.get("warm_start_steps", s.diloco.warm_start_steps);
    std::string rounds = round_timing_name(s.diloco.rounds);
    o.get("rounds", rounds);
    s.diloco.rounds = choose<RoundTiming>("diloco.rounds", rounds,
                                          {{"auto", RoundTiming::kAuto}, {"alongside", RoundTiming::kAlongside}, {"at_barrier", RoundTiming::kAtBarrier}},
                                          "\"auto\" (alongside training when more than one job step is in flight), \"alongside\" "
                                          "(the pipeline is not drained for a round) or \"at_barrier\" (drained, as under sync)");
    if (const json* st = o.sub("streaming")) {
      Obj so(*st, "diloco.streaming", {"fragments", "overlap_steps"});
      so.get("fragments", s.diloco.fragments);
      so.get("overlap_steps", s.diloco.overlap_steps);
    }
  }
  if (const json* v = top.sub("checkpoint")) {
    Obj o(*v, "checkpoint", {"dir", "every_steps", "keep", "snapshot_every_steps"});
    o.get("dir", s.checkpoint.dir);
    o.get("every_steps", s.checkpoint.every_steps);
    o.get("keep", s.checkpoint.keep);
    o.get("snapshot_every_steps", s.checkpoint.snapshot_every_steps);
  }
  if (const json* v = top.sub("routing")) {
    Obj o(*v, "routing", {"mode", "hops", "rebalance", "rebalance_period_s", "min_gain", "cooldown_s", "start_peers", "start_wait_s", "max_queued_s"});
    std::string mode = routing_mode_name(s.routing.mode);
    o.get("mode", mode);
    s.routing.mode = choose<RoutingMode>("routing.mode", mode, {{"swarm", RoutingMode::kSwarm}, {"static", RoutingMode::kStatic}},
                                         "\"swarm\" (each hop to the peer that finishes it first) or \"static\" "
                                         "(fixed pipelines, for comparison)");
    std::string hops = hops_name(s.routing.hops);
    o.get("hops", hops);
    s.routing.hops = choose<Hops>("routing.hops", hops, {{"p2p", Hops::kP2p}, {"hub", Hops::kHub}},
                                  "\"p2p\" (tensors go straight from peer to peer; peers without --listen are relayed) or "
                                  "\"hub\" (every tensor through the router)");
    o.get("rebalance", s.routing.rebalance);
    o.get("rebalance_period_s", s.routing.rebalance_period_s);
    o.get("min_gain", s.routing.min_gain);
    o.get("cooldown_s", s.routing.cooldown_s);
    o.get("start_peers", s.routing.start_peers);
    o.get("start_wait_s", s.routing.start_wait_s);
    o.get("max_queued_s", s.routing.max_queued_s);
  }
  if (const json* v = top.sub("compression")) {
    Obj o(*v, "compression", {"activations", "gradients", "outer"});
    o.get("activations", s.compression.activations);
    o.get("gradients", s.compression.gradients);
    o.get("outer", s.compression.outer);
  }
  if (const json* v = top.sub("eval")) {
    Obj o(*v, "eval", {"every_steps", "batches"});
    o.get("every_steps", s.eval.every_steps);
    o.get("batches", s.eval.batches);
  }
  if (const json* v = top.sub("timeouts")) {
    Obj o(*v, "timeouts", {"forward_s", "backward_s", "max_attempts"});
    o.get("forward_s", s.timeouts.forward_s);
    o.get("backward_s", s.timeouts.backward_s);
    o.get("max_attempts", s.timeouts.max_attempts);
  }
  fill_and_validate(s, check_files);
  return s;
}

JobSpec parse_job_spec_text(const std::string& text, bool check_files) {
  if (text.size() > limits::kMaxJobSpecBytes) {
    throw SpecError("job spec: the text is " + std::to_string(text.size()) + " bytes, over the limit of " +
                    std::to_string(limits::kMaxJobSpecBytes) +
                    " (limits::kMaxJobSpecBytes); a job spec names its data files, it does not hold data");
  }
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    // e.byte is 1-based: the position of the character where parsing stopped.
    size_t byte = e.byte == 0 ? 0 : e.byte - 1;
    size_t line = 1, col = 1;
    for (size_t i = 0; i < byte && i < text.size(); ++i) {
      if (text[i] == '\n') ++line, col = 1;
      else ++col;
    }
    throw SpecError("job spec: not valid JSON: syntax error at line " + std::to_string(line) + ", column " +
                    std::to_string(col) + " (byte " + std::to_string(e.byte) + "): " + parser_reason(e.what()));
  } catch (const json::out_of_range& e) {
    // A number past a double's range (1e309): the parser says which, not where.
    throw SpecError("job spec: not valid JSON: " + parser_reason(e.what()) +
                    "; numbers must be within about ±1.8e308");
  }
  return parse_job_spec(j, check_files);
}

json to_json(const JobSpec& s) {
  json j;
  j["name"] = s.name;
  j["seed"] = s.seed;
  j["steps"] = s.steps;
  j["schedule"] = schedule_name(s.schedule);
  j["max_inflight"] = s.max_inflight;
  j["model"] = {{"vocab_size", s.model.vocab_size}, {"d_model", s.model.d_model}, {"n_head", s.model.n_head},
                {"n_layer", s.model.n_layer},       {"seq_len", s.model.seq_len}, {"max_seq_len", s.model.max_seq_len},
                {"bias", s.model.bias},             {"precision", s.model.precision}, {"loss_scale", s.model.loss_scale}};
  j["partition"] = {{"stages", s.partition.stages}, {"layers_per_stage", s.partition.layers_per_stage}};
  j["data"] = {{"format", s.data.format}, {"path", s.data.paths}, {"val_fraction", s.data.val_fraction}};
  j["batch"] = {{"batch_size", s.batch.batch_size},
                {"microbatch_size", s.batch.microbatch_size},
                {"inner_batch", s.batch.inner_batch}};
  j["optimizer"] = {{"name", s.optimizer.name},
                    {"lr", s.optimizer.lr},
                    {"min_lr", s.optimizer.min_lr},
                    {"warmup_steps", s.optimizer.warmup_steps},
                    {"weight_decay", s.optimizer.weight_decay},
                    {"beta1", s.optimizer.beta1},
                    {"beta2", s.optimizer.beta2},
                    {"eps", s.optimizer.eps},
                    {"grad_clip", s.optimizer.grad_clip}};
  j["diloco"] = {{"inner_steps", s.diloco.inner_steps},
                 {"outer_lr", s.diloco.outer_lr},
                 {"outer_momentum", s.diloco.outer_momentum},
                 {"nesterov", s.diloco.nesterov},
                 {"deadline_s", s.diloco.deadline_s},
                 {"sync", diloco_sync_name(s.diloco.sync)},
                 {"warm_start_steps", s.diloco.warm_start_steps},
                 {"rounds", round_timing_name(s.diloco.rounds)},
                 {"streaming", {{"fragments", s.diloco.fragments}, {"overlap_steps", s.diloco.overlap_steps}}}};
  j["compression"] = {{"activations", s.compression.activations},
                      {"gradients", s.compression.gradients},
                      {"outer", s.compression.outer}};
  j["eval"] = {{"every_steps", s.eval.every_steps}, {"batches", s.eval.batches}};
  j["timeouts"] = {{"forward_s", s.timeouts.forward_s},
                   {"backward_s", s.timeouts.backward_s},
                   {"max_attempts", s.timeouts.max_attempts}};
  j["checkpoint"] = {{"dir", s.checkpoint.dir},
                     {"every_steps", s.checkpoint.every_steps},
                     {"keep", s.checkpoint.keep},
                     {"snapshot_every_steps", s.checkpoint.snapshot_every_steps}};
  j["routing"] = {{"mode", routing_mode_name(s.routing.mode)},
                  {"hops", hops_name(s.routing.hops)},
                  {"rebalance", s.routing.rebalance},
                  {"rebalance_period_s", s.routing.rebalance_period_s},
                  {"min_gain", s.routing.min_gain},
                  {"cooldown_s", s.routing.cooldown_s},
                  {"start_peers", s.routing.start_peers},
                  {"start_wait_s", s.routing.start_wait_s},
                  {"max_queued_s", s.routing.max_queued_s}};
  return j;
}

bool operator==(const JobSpec& a, const JobSpec& b) { return to_json(a) == to_json(b); }

}  // namespace swarm
