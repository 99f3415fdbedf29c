// export.cpp: swarm::export_checkpoint, a checkpoint's global weights as a PyTorch state dict.
//
// Why not torch::pickle_save: it tags every dict with torch.jit._pickle.restore_type_tag,
// which torch.load's weights_only unpickler (the default since PyTorch 2.6) refuses. The same
// jit::Pickler with tag_aggregates off writes what Python's torch.save writes for a dict of
// tensors (_rebuild_tensor_v2, FloatStorage persistent ids), and PyTorchStreamWriter the zip
// archive around it (data.pkl, data/<i>, version), on libtorch 1.13 and 2.x alike.
#include "stages/export.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/torch.h>

#include "runtime/checkpoint.h"
#include "runtime/errors.h"
#include "runtime/job_spec.h"
#include "stages/model.h"

namespace swarm {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr double kLayerNormEps = 1e-5;   // stages/model.cpp

// Writes an output file through a temp name in the same directory, renamed on commit.
class OutFile {
 public:
  explicit OutFile(std::string path)
      : path_(std::move(path)), tmp_(path_ + ".tmp-" + std::to_string(::getpid())) {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("create", tmp_);
  }
  ~OutFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;

  // False (errno_ set) when a write failed; PyTorchStreamWriter's writer_func reports it by
  // returning fewer bytes.
  bool write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        errno_ = errno;
        return false;
      }
      p += w;
      n -= size_t(w);
    }
    return true;
  }
  void check() const {
    if (errno_) throw InputError("cannot write " + path_ + ": " + std::strerror(errno_));
  }
  void commit() {
    check();
    if (::fsync(fd_) != 0) fail("fsync", tmp_);
    if (::close(fd_) != 0) {
      fd_ = -1;
      fail("close", tmp_);
    }
    fd_ = -1;
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail("rename to " + path_ + ":", tmp_);
    committed_ = true;
  }

 private:
  [[noreturn]] void fail(const std::string& what, const std::string& p) const {
    throw InputError("cannot write " + path_ + ": " + what + " " + p + ": " + std::strerror(errno));
  }
  std::string path_, tmp_;
  int fd_ = -1;
  int errno_ = 0;
  bool committed_ = false;
};

void save_state_dict(const c10::Dict<std::string, at::Tensor>& dict, const std::string& path) {
  std::vector<char> pkl;
  torch::jit::Pickler pickler([&](const char* b, size_t n) { pkl.insert(pkl.end(), b, b + n); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(c10::IValue(dict));
  pickler.stop();

  OutFile out(path);
  try {
    caffe2::serialize::PyTorchStreamWriter zip([&](const void* b, size_t n) -> size_t { return out.write(b, n) ? n : 0; });
    zip.writeRecord("data.pkl", pkl.data(), pkl.size());
    // Storage i of the pickle is record data/<i> (the Pickler's default keys), whole storages.
    const std::vector<at::Tensor>& storages = pickler.tensorData();
    for (size_t i = 0; i < storages.size(); ++i) {
      const at::Storage& st = storages[i].storage();
      zip.writeRecord("data/" + std::to_string(i), st.data(), st.nbytes());
    }
    zip.writeEndOfFile();
  } catch (const c10::Error& e) {
    out.check();   // a write error is the story; otherwise it is libtorch's
    throw InputError("cannot write " + path + ": " + e.what_without_backtrace());
  }
  out.commit();
}

void save_text(const std::string& text, const std::string& path) {
  OutFile out(path);
  out.write(text.data(), text.size());
  out.commit();
}

}  // namespace

ExportSummary export_checkpoint(const std::string& ckpt_path, const std::string& out_pt, std::string* config_json_path) {
  LoadedCheckpoint lc = resolve_checkpoint(ckpt_path);
  const std::string where = "checkpoint " + lc.path + ": ";
  JobSpec spec;
  try {
    spec = parse_job_spec(lc.ckpt.spec, /*check_files=*/false);
  } catch (const InputError& e) {
    throw InputError(where + "its job spec: " + e.what());
  }
  const int S = spec.partition.stages;
  std::map<int, const StageState*> by_stage;
  for (const StageState& s : lc.ckpt.stages) by_stage[s.stage] = &s;
  for (int s = 0; s < S; ++s)
    if (!by_stage.count(s))
      throw InputError(where + "no state for stage " + std::to_string(s) + " of the job's " + std::to_string(S));
  if (by_stage.rbegin()->first >= S)
    throw InputError(where + "state for stage " + std::to_string(by_stage.rbegin()->first) + " but the job has " +
                     std::to_string(S) + " stages");

  torch::NoGradGuard no_grad;
  c10::Dict<std::string, at::Tensor> dict;
  json keys = json::array();
  ExportSummary sum;
  for (int s = 0; s < S; ++s) {
    StageModel model(spec.model, s, S, spec.first_layer(s), spec.partition.layers_per_stage[s], spec.seed, torch::kCPU);
    const std::vector<float>& theta_g = by_stage[s]->theta_g;
    if (int64_t(theta_g.size()) != model.num_parameters())
      throw InputError(where + "stage " + std::to_string(s) + ": theta_g holds " + std::to_string(theta_g.size()) +
                       " floats but the job's stage " + std::to_string(s) + " has " +
                       std::to_string(model.num_parameters()) + " parameters");
    size_t off = 0;
    for (const auto& [name, p] : model.named_parameters()) {
      // A fresh tensor per parameter: the archive holds exactly its bytes.
      at::Tensor t = torch::from_blob(const_cast<float*>(theta_g.data() + off), p.sizes(), torch::kFloat32).clone();
      off += size_t(p.numel());
      dict.insert(name, t);
      keys.push_back(name);
      ++sum.tensors;
      sum.parameters += t.numel();
    }
  }

  const std::string cfg_path = fs::path(out_pt).replace_extension(".json").string();
  if (cfg_path == out_pt) throw InputError("the output " + out_pt + " ends in .json, the config's name; name the state dict e.g. model.pt");
  const ModelSpec& m = spec.model;
  const int block_size = m.max_seq_len > 0 ? m.max_seq_len : m.seq_len;
  nlohmann::ordered_json cfg = {
      {"format", "swarm-export"},
      {"version", 1},
      {"architecture", "GPT-2 (nanoGPT names): pre-LayerNorm blocks x + attn(ln_1(x)), x + mlp(ln_2(x)); causal "
                       "multi-head attention scaled by 1/sqrt(head_dim); MLP n_embd -> 4 n_embd -> n_embd; final "
                       "ln_f then lm_head; Linear weights [out, in] as torch.nn.Linear"},
      {"vocab_size", m.vocab_size},
      {"n_layer", m.n_layer},
      {"n_head", m.n_head},
      {"n_embd", m.d_model},
      {"d_model", m.d_model},
      {"block_size", block_size},
      {"max_seq_len", block_size},
      {"seq_len", m.seq_len},
      {"bias", m.bias},
      {"layer_norm_eps", kLayerNormEps},
      {"gelu", "tanh"},
      {"tied_embeddings", false},
      {"dropout", 0.0},
      {"dtype", "float32"},
      {"weights", "theta_g: each stage group's global (outer) weights"},
      {"step", lc.ckpt.step},
      {"checkpoint", lc.path},
      {"job_name", spec.name},
      {"parameters", sum.parameters},
      {"state_dict_keys", keys},
  };

  const fs::path parent = fs::path(out_pt).parent_path();
  std::error_code ec;
  if (!parent.empty()) fs::create_directories(parent, ec);
  if (ec) throw InputError("cannot write " + out_pt + ": create directory " + parent.string() + ": " + ec.message());
  save_state_dict(dict, out_pt);
  save_text(cfg.dump(2) + "\n", cfg_path);
  if (config_json_path) *config_json_path = cfg_path;
  sum.checkpoint = lc.path;
  sum.pt_path = out_pt;
  sum.config_path = cfg_path;
  sum.step = lc.ckpt.step;
  return sum;
}

}  // namespace swarm
