// checkpoint.cpp: write_checkpoint, read_checkpoint, load_latest_checkpoint, resolve_checkpoint
// (runtime/checkpoint.h; the format is in docs/checkpoints.md).
//
// POSIX files and directories: every file is fsynced before its temp dir is renamed into
// place, so after a crash a step dir is either absent or complete; what a disk can still do to
// it later (truncation, flipped bits) the reader catches with sizes and XXH3-64 checksums.
#include "runtime/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <iterator>
#include <set>

#include <xxhash.h>

#include "runtime/errors.h"
#include "runtime/fs.h"
#include "runtime/log.h"

namespace swarm {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
constexpr bool kHostLittleEndian = false;
#else
constexpr bool kHostLittleEndian = true;
#endif

constexpr const char* kManifest = "manifest.json";
constexpr const char* kDType = "f32le";   // the only array type of version 1
constexpr const char* kArrayNames[] = {"theta_g", "momentum", "theta", "adam_m", "adam_v"};

std::vector<float>* array_of(StageState& s, const std::string& name) {
  if (name == "theta_g") return &s.theta_g;
  if (name == "momentum") return &s.momentum;
  if (name == "theta") return &s.theta;
  if (name == "adam_m") return &s.adam_m;
  if (name == "adam_v") return &s.adam_v;
  return nullptr;
}
const std::vector<float>* array_of(const StageState& s, const std::string& name) {
  return array_of(const_cast<StageState&>(s), name);
}

std::string errno_text(int e) { return std::strerror(e); }

std::string join(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, v);
  return buf;
}

bool parse_hex64(const std::string& s, uint64_t* out) {
  if (s.empty() || s.size() > 16) return false;
  uint64_t v = 0;
  for (char c : s) {
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else return false;
    v = (v << 4) | uint64_t(d);
  }
  *out = v;
  return true;
}

uint32_t byteswap32(uint32_t x) {
  return (x >> 24) | ((x >> 8) & 0xFF00u) | ((x << 8) & 0xFF0000u) | (x << 24);
}

// Floats in their on-disk byte order (little-endian); a no-op view on little-endian hosts.
const void* to_disk_order(const std::vector<float>& v, std::vector<uint32_t>* scratch) {
  if (kHostLittleEndian) return v.data();
  scratch->resize(v.size());
  std::memcpy(scratch->data(), v.data(), v.size() * sizeof(float));
  for (uint32_t& w : *scratch) w = byteswap32(w);
  return scratch->data();
}

void from_disk_order(std::vector<float>* v) {
  if (kHostLittleEndian) return;
  for (float& f : *v) {
    uint32_t w;
    std::memcpy(&w, &f, 4);
    w = byteswap32(w);
    std::memcpy(&f, &w, 4);
  }
}

// --- writing ---

// Every write failure reads "cannot write checkpoint: STEP PATH: errno text" (runtime/fs.h).
const char* const kWhat = "checkpoint";
std::string step_dir_name(int step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08d", step);
  return buf;
}

std::atomic<uint64_t> g_temp_counter{0};

// ".tmp-<what>-<pid>-<n>": the pid tells a later writer whether the owner is still alive.
std::string temp_name(const std::string& what) {
  return ".tmp-" + what + "-" + std::to_string(::getpid()) + "-" + std::to_string(g_temp_counter.fetch_add(1));
}

void remove_tree_quietly(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
}

// --- listing ---

struct StepEntry {
  uint64_t step;
  std::string name;
};

// "step-" then digits only.
bool parse_step_name(const std::string& name, uint64_t* step) {
  if (name.size() <= 5 || name.compare(0, 5, "step-") != 0 || name.size() > 5 + 19) return false;
  uint64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
    v = v * 10 + uint64_t(name[i] - '0');
  }
  *step = v;
  return true;
}

std::vector<std::string> list_names(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) throw InputError("cannot list checkpoint directory " + dir + ": " + errno_text(errno));
  std::vector<std::string> out;
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  ::closedir(d);
  return out;
}

// Step dirs of `dir`, newest (highest step) first.
std::vector<StepEntry> list_step_dirs(const std::string& dir) {
  std::vector<StepEntry> out;
  for (const std::string& n : list_names(dir)) {
    uint64_t step;
    std::error_code ec;
    if (parse_step_name(n, &step) && fs::is_directory(join(dir, n), ec)) out.push_back({step, n});
  }
  std::sort(out.begin(), out.end(), [](const StepEntry& a, const StepEntry& b) {
    return a.step != b.step ? a.step > b.step : a.name > b.name;
  });
  return out;
}

bool has_manifest(const std::string& step_dir) {
  std::error_code ec;
  return fs::is_regular_file(join(step_dir, kManifest), ec);
}

// Removes .tmp-* dirs whose writer (the pid in the name) is no longer running on this host.
void remove_orphan_temps(const std::string& dir) {
  for (const std::string& n : list_names(dir)) {
    if (n.compare(0, 5, ".tmp-") != 0) continue;
    const size_t last = n.rfind('-');
    if (last == std::string::npos || last < 5) continue;
    const size_t before = n.rfind('-', last - 1);
    if (before == std::string::npos || before < 4) continue;
    const std::string pid_text = n.substr(before + 1, last - before - 1);
    if (pid_text.empty() || pid_text.size() > 9 ||
        !std::all_of(pid_text.begin(), pid_text.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    const pid_t pid = pid_t(std::stol(pid_text));
    if (pid <= 0 || pid == ::getpid()) continue;
    if (::kill(pid, 0) != 0 && errno == ESRCH) remove_tree_quietly(join(dir, n));
  }
}

// Keeps the newest `keep` complete step dirs (and always `just_written`); older step dirs,
// complete or not, are renamed to a temp name and removed, so a half-removed dir never looks
// like a checkpoint.
void prune(const std::string& dir, const std::string& just_written, int keep) {
  if (keep <= 0) return;
  const std::vector<StepEntry> steps = list_step_dirs(dir);
  int kept = 0;
  bool cut = false;   // set once `keep` complete dirs are kept: everything older goes
  for (const StepEntry& e : steps) {
    const std::string path = join(dir, e.name);
    if (e.name == just_written) {
      ++kept;
      if (kept >= keep) cut = true;
      continue;
    }
    if (!cut) {
      if (has_manifest(path)) {
        ++kept;
        if (kept >= keep) cut = true;
      }
      continue;
    }
    const std::string doomed = join(dir, temp_name("prune-" + e.name));
    if (::rename(path.c_str(), doomed.c_str()) == 0) remove_tree_quietly(doomed);
  }
}

// --- reading ---

class Reader {
 public:
  explicit Reader(std::string step_dir) : dir_(std::move(step_dir)) {}

  [[noreturn]] void fail(const std::string& what) const { throw InputError("checkpoint " + dir_ + ": " + what); }

  Checkpoint read() {
    const std::string mpath = join(dir_, kManifest);
    std::error_code ec;
    if (!fs::exists(dir_, ec)) fail("no such directory");
    if (!fs::is_directory(dir_, ec)) fail("not a directory");
    const std::string text = read_small_file(mpath);
    json m;
    try {
      m = json::parse(text);
    } catch (const json::exception& e) {
      fail(std::string(kManifest) + ": bad JSON: " + e.what());
    }
    try {
      return from_manifest(m);
    } catch (const json::exception& e) {
      fail(std::string(kManifest) + ": " + e.what());
    }
  }

 private:
  std::string read_small_file(const std::string& path) const {
    fs_util::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) {
      if (errno == ENOENT) fail(std::string("missing ") + kManifest + " (an unfinished or damaged checkpoint)");
      fail(std::string("cannot open ") + kManifest + ": " + errno_text(errno));
    }
    std::string out;
    char buf[1 << 16];
    for (;;) {
      const ssize_t r = ::read(fd.get(), buf, sizeof buf);
      if (r < 0) {
        if (errno == EINTR) continue;
        fail(std::string("cannot read ") + kManifest + ": " + errno_text(errno));
      }
      if (r == 0) break;
      out.append(buf, size_t(r));
    }
    return out;
  }

  Checkpoint from_manifest(const json& m) const {
    if (!m.is_object()) fail(std::string(kManifest) + ": not a JSON object");
    const std::string format = m.value("format", std::string());
    if (format != kCheckpointFormat)
      fail(std::string(kManifest) + ": not a swarm checkpoint (format \"" + format + "\", expected \"" + kCheckpointFormat + "\")");
    if (!m.contains("version") || !m["version"].is_number_integer())
      fail(std::string(kManifest) + ": no format version");
    const int version = m["version"].get<int>();
    if (version < kCheckpointOldestVersion || version > kCheckpointVersion)
      fail(std::string(kManifest) + ": format version " + std::to_string(version) + ", this build reads versions " +
           std::to_string(kCheckpointOldestVersion) + " to " + std::to_string(kCheckpointVersion));
    for (const char* f : {"step", "next_microbatch", "rounds", "spec", "stages"})
      if (!m.contains(f)) fail(std::string(kManifest) + ": field \"" + f + "\" missing");

    Checkpoint c;
    c.step = m.at("step").get<int>();
    if (c.step < 0) fail(std::string(kManifest) + ": negative step");
    c.next_microbatch = m.at("next_microbatch").get<uint64_t>();
    c.rounds = m.at("rounds").get<uint64_t>();
    c.spec = m.at("spec");
    c.router = m.value("router", json());
    if (!m.at("stages").is_array()) fail(std::string(kManifest) + ": \"stages\" is not a list");
    std::set<int> seen;
    for (const json& js : m.at("stages")) {
      c.stages.push_back(read_stage(js));
      if (!seen.insert(c.stages.back().stage).second)
        fail(std::string(kManifest) + ": stage " + std::to_string(c.stages.back().stage) + " listed twice");
    }
    return c;
  }

  StageState read_stage(const json& js) const {
    StageState s;
    s.stage = js.at("stage").get<int>();
    if (s.stage < 0) fail(std::string(kManifest) + ": negative stage index");
    s.adam_step = js.value("adam_step", int64_t(0));
    s.loss_scale = js.value("loss_scale", 0.0);   // absent before version 2
    s.loss_scale_good_steps = js.value("loss_scale_good_steps", int64_t(0));
    if (!std::isfinite(s.loss_scale) || s.loss_scale < 0 || s.loss_scale_good_steps < 0)
      fail(std::string(kManifest) + ": stage " + std::to_string(s.stage) + ": loss_scale " + std::to_string(s.loss_scale) +
           " / loss_scale_good_steps " + std::to_string(s.loss_scale_good_steps) + " must be finite and >= 0");
    const std::string file = js.at("file").get<std::string>();
    if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
      fail(std::string(kManifest) + ": stage " + std::to_string(s.stage) + ": bad file name \"" + file + "\"");
    const uint64_t bytes = js.at("bytes").get<uint64_t>();
    const std::string path = join(dir_, file);

    fs_util::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) fail(file + ": " + (errno == ENOENT ? std::string("missing") : errno_text(errno)));
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) fail(file + ": " + errno_text(errno));
    const uint64_t on_disk = uint64_t(st.st_size);
    if (on_disk < bytes)
      fail(file + ": truncated: " + std::to_string(on_disk) + " bytes on disk, the manifest says " + std::to_string(bytes));
    if (on_disk > bytes)
      fail(file + ": " + std::to_string(on_disk) + " bytes on disk, more than the " + std::to_string(bytes) +
           " the manifest says");

    const json& arrays = js.at("arrays");
    if (!arrays.is_object()) fail(std::string(kManifest) + ": stage " + std::to_string(s.stage) + ": \"arrays\" is not an object");
    size_t common = 0;
    std::string common_name;
    for (auto it = arrays.begin(); it != arrays.end(); ++it) {
      const std::string& name = it.key();
      std::vector<float>* dst = array_of(s, name);
      const std::string where = file + ": array " + name;
      if (!dst) fail(where + ": unknown array name");
      const json& a = it.value();
      if (a.value("file", file) != file) fail(where + ": listed under stage file " + file + " but names file " + a.value("file", file));
      if (a.value("dtype", std::string()) != kDType)
        fail(where + ": dtype \"" + a.value("dtype", std::string()) + "\", this build reads \"" + kDType + "\"");
      const uint64_t offset = a.at("offset").get<uint64_t>();
      const uint64_t count = a.at("count").get<uint64_t>();
      uint64_t want = 0;
      if (!parse_hex64(a.at("xxh3").get<std::string>(), &want)) fail(where + ": the manifest's checksum is not hex");
      if (count > (bytes / 4) || offset > bytes || offset + count * 4 > bytes)
        fail(where + ": offset " + std::to_string(offset) + " + " + std::to_string(count) + " floats runs past the " +
             std::to_string(bytes) + " bytes of the file");
      if (count > 0) {
        if (common == 0) {
          common = size_t(count);
          common_name = name;
        } else if (size_t(count) != common) {
          fail(where + ": " + std::to_string(count) + " floats, but " + common_name + " has " + std::to_string(common));
        }
      }
      dst->resize(size_t(count));
      read_exact(fd.get(), dst->data(), size_t(count) * 4, offset, file, where);
      const uint64_t got = XXH3_64bits(dst->data(), size_t(count) * 4);
      if (got != want)
        fail(where + " (offset " + std::to_string(offset) + ", " + std::to_string(count) + " floats): checksum mismatch: xxh3 " +
             hex64(got) + " on disk, " + hex64(want) + " in the manifest");
      from_disk_order(dst);
    }
    return s;
  }

  void read_exact(int fd, void* dst, size_t n, uint64_t offset, const std::string& file, const std::string& where) const {
    char* p = static_cast<char*>(dst);
    while (n > 0) {
      const ssize_t r = ::pread(fd, p, std::min<size_t>(n, size_t(1) << 30), off_t(offset));
      if (r < 0) {
        if (errno == EINTR) continue;
        fail(where + ": read error: " + errno_text(errno));
      }
      if (r == 0) fail(where + ": truncated while reading " + file);
      p += r;
      n -= size_t(r);
      offset += uint64_t(r);
    }
  }

  std::string dir_;
};

}  // namespace

std::string write_checkpoint(const std::string& dir, const Checkpoint& ckpt, int keep) {
  SWARM_CHECK(ckpt.step >= 0, "a checkpoint's step is never negative");
  std::set<int> seen;
  for (const StageState& s : ckpt.stages) {
    SWARM_CHECK(s.stage >= 0 && seen.insert(s.stage).second, "stage indexes of a checkpoint are distinct and >= 0");
    size_t common = 0;
    for (const char* name : kArrayNames) {
      const size_t n = array_of(s, name)->size();
      if (n == 0) continue;
      SWARM_CHECK(common == 0 || n == common, std::string("stage ") + std::to_string(s.stage) + ": array " + name +
                                                  " differs in length from the stage's other arrays");
      common = n;
    }
  }

  fs_util::make_dirs(dir, kWhat);
  const std::string final_name = step_dir_name(ckpt.step);
  const std::string final_path = join(dir, final_name);
  const std::string tmp_path = join(dir, temp_name(final_name));
  if (::mkdir(tmp_path.c_str(), 0755) != 0) fs_util::fail_write(kWhat, "create directory", tmp_path, errno);

  try {
    nlohmann::ordered_json stages = nlohmann::ordered_json::array();
    for (const StageState& s : ckpt.stages) {
      const std::string file = "stage-" + std::to_string(s.stage) + ".bin";
      nlohmann::ordered_json arrays = nlohmann::ordered_json::object();
      std::vector<std::pair<const void*, size_t>> pieces;
      std::vector<std::vector<uint32_t>> scratch(std::size(kArrayNames));
      uint64_t offset = 0;
      for (size_t i = 0; i < std::size(kArrayNames); ++i) {
        const std::vector<float>& v = *array_of(s, kArrayNames[i]);
        const void* bytes = to_disk_order(v, &scratch[i]);
        const size_t n = v.size() * sizeof(float);
        arrays[kArrayNames[i]] = {{"file", file}, {"offset", offset}, {"count", v.size()}, {"dtype", kDType},
                                  {"xxh3", hex64(XXH3_64bits(bytes, n))}};
        pieces.emplace_back(bytes, n);
        offset += n;
      }
      fs_util::write_file_synced(join(tmp_path, file), pieces, kWhat);
      stages.push_back({{"stage", s.stage}, {"file", file}, {"bytes", offset}, {"adam_step", s.adam_step},
                        {"loss_scale", s.loss_scale}, {"loss_scale_good_steps", s.loss_scale_good_steps}, {"arrays", arrays}});
    }

    // Field order as docs/checkpoints.md lists it, for people reading the file.
    nlohmann::ordered_json rng = {
        {"sampler", "counter-based: training microbatch i is sample_microbatch(data, train, seed, i, ...); "
                    "validation microbatches are fixed"},
        {"next_microbatch", ckpt.next_microbatch}};
    rng["seed"] = ckpt.spec.is_object() && ckpt.spec.contains("seed") ? ckpt.spec["seed"] : json();
    nlohmann::ordered_json manifest = {{"format", kCheckpointFormat},
                                       {"version", kCheckpointVersion},
                                       {"step", ckpt.step},
                                       {"next_microbatch", ckpt.next_microbatch},
                                       {"rounds", ckpt.rounds},
                                       {"created_unix_s", int64_t(std::time(nullptr))},
                                       {"rng", rng},
                                       {"spec", ckpt.spec},
                                       {"router", ckpt.router},
                                       {"stages", stages}};
    const std::string text = manifest.dump(1) + "\n";
    fs_util::write_file_synced(join(tmp_path, kManifest), {{text.data(), text.size()}}, kWhat);
    fs_util::fsync_dir(tmp_path, kWhat);

    if (::rename(tmp_path.c_str(), final_path.c_str()) != 0) {
      if (errno != ENOTEMPTY && errno != EEXIST) fs_util::fail_write(kWhat, "rename " + tmp_path + " to", final_path, errno);
      // A checkpoint of this step exists (a job resumed from an earlier one): swap it out
      // atomically where the filesystem can, else move it aside first.
      if (::renameat2(AT_FDCWD, tmp_path.c_str(), AT_FDCWD, final_path.c_str(), RENAME_EXCHANGE) == 0) {
        remove_tree_quietly(tmp_path);   // now holds the old checkpoint
      } else {
        const std::string old = join(dir, temp_name("replaced-" + final_name));
        if (::rename(final_path.c_str(), old.c_str()) != 0) fs_util::fail_write(kWhat, "move aside", final_path, errno);
        if (::rename(tmp_path.c_str(), final_path.c_str()) != 0) fs_util::fail_write(kWhat, "rename " + tmp_path + " to", final_path, errno);
        remove_tree_quietly(old);
      }
    }
  } catch (...) {
    remove_tree_quietly(tmp_path);
    throw;
  }
  fs_util::fsync_dir(dir, kWhat);

  // The checkpoint is safe now; failing to tidy up older ones must not undo that.
  try {
    prune(dir, final_name, keep);
    remove_orphan_temps(dir);
  } catch (const InputError& e) {
    log_warn("checkpoint", std::string("wrote ") + final_path + " but could not prune " + dir + ": " + e.what());
  }
  return final_path;
}

Checkpoint read_checkpoint(const std::string& step_dir) { return Reader(step_dir).read(); }

std::optional<LoadedCheckpoint> load_latest_checkpoint(const std::string& dir, std::vector<std::string>* skipped_out) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) return std::nullopt;
  if (!fs::is_directory(dir, ec)) throw InputError("checkpoint directory " + dir + " is not a directory");
  std::vector<std::string> skipped;
  for (const StepEntry& e : list_step_dirs(dir)) {
    const std::string path = join(dir, e.name);
    try {
      Checkpoint c = read_checkpoint(path);
      if (skipped_out) *skipped_out = skipped;
      return LoadedCheckpoint{std::move(c), path, std::move(skipped)};
    } catch (const InputError& err) {
      skipped.push_back(err.what());
    }
  }
  if (skipped_out) *skipped_out = std::move(skipped);
  return std::nullopt;
}

LoadedCheckpoint resolve_checkpoint(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw InputError("checkpoint " + path + ": no such file or directory");
  if (!fs::is_directory(path, ec)) throw InputError("checkpoint " + path + ": not a directory");
  uint64_t step;
  const std::string base = fs::path(path).lexically_normal().filename().empty()
                               ? fs::path(path).lexically_normal().parent_path().filename().string()
                               : fs::path(path).lexically_normal().filename().string();
  if (has_manifest(path) || parse_step_name(base, &step)) return LoadedCheckpoint{read_checkpoint(path), path, {}};
  std::vector<std::string> skipped;
  std::optional<LoadedCheckpoint> latest = load_latest_checkpoint(path, &skipped);
  if (!latest) {
    if (skipped.empty()) throw InputError("checkpoint " + path + ": no step-* checkpoint in this directory");
    std::string why;
    for (const std::string& s : skipped) why += "\n  " + s;
    throw InputError("no valid checkpoint in " + path + ":" + why);
  }
  return std::move(*latest);
}

}  // namespace swarm
