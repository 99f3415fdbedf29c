// checkpoint.h: the on-disk training checkpoint (docs/checkpoints.md). No libtorch.
//
// Defines swarm::StageState and swarm::Checkpoint (everything a job needs to continue: the
// step, the data position, every stage group's weights and optimizer state, the router's own
// state), `write_checkpoint` (atomic: temp dir, fsync, rename; then keep-K pruning),
// `read_checkpoint` (one step dir, every size and XXH3-64 checksum verified),
// `load_latest_checkpoint` (newest valid step dir of a checkpoint dir, skipping damaged ones)
// and `resolve_checkpoint` (either kind of path). Every failure a file can cause is an
// InputError naming the file, the array and what is wrong.
//
// Layout: DIR/step-00000123/{manifest.json, stage-0.bin, stage-1.bin, ...}. A stage file holds
// the stage's arrays back to back as little-endian fp32, in the order theta_g, momentum, theta,
// adam_m, adam_v; the manifest gives each array's file, offset, count and checksum.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace swarm {

constexpr const char* kCheckpointFormat = "swarm-checkpoint";
// Version 2 adds each stage's fp16 loss scale; version 1 checkpoints still read (no scale).
constexpr int kCheckpointVersion = 2;
constexpr int kCheckpointOldestVersion = 1;

// Everything one stage needs to continue. Every array is flat fp32 in the stage model's
// named_parameters() order (the stage server's flatten()); an array may be empty (not
// saved), otherwise it has the same length as every other non-empty array of the stage.
struct StageState {
  int stage = 0;
  std::vector<float> theta_g, momentum;   // the stage group's global weights and outer momentum
  std::vector<float> theta;               // one donor peer's local weights
  std::vector<float> adam_m, adam_v;      // that donor's AdamW moments (exp_avg, exp_avg_sq)
  int64_t adam_step = 0;                  // that donor's AdamW steps taken (bias correction)
  // That donor's dynamic loss scale (runtime/precision.h LossScaler) and its good steps since the
  // scale last changed; 0: none (a peer without loss scaling, or a version 1 checkpoint).
  double loss_scale = 0;
  int64_t loss_scale_good_steps = 0;
};

struct Checkpoint {
  int step = 0;                  // optimizer steps completed
  uint64_t next_microbatch = 0;  // data position: the next training microbatch index
  uint64_t rounds = 0;           // within-stage rounds completed
  nlohmann::json spec;           // the job spec, to_json(JobSpec)
  nlohmann::json router;         // router-side state to restore (history, counters); opaque here
  std::vector<StageState> stages;   // one per stage, any order, stage indexes distinct
};

// Writes `ckpt` as DIR/step-<8-digit step>/ and returns that path. Atomic: the files are
// written and fsynced in DIR/.tmp-step-...-<pid>-<n>/, which is fsynced and renamed to its
// final name, then DIR is fsynced; a step dir that already exists is replaced. Then prunes:
// only the newest `keep` complete step dirs remain (keep <= 0 keeps all; the one just written
// always stays), and temp dirs left by dead processes of this host are removed (a failure
// there is logged, not thrown: the checkpoint is already safe).
// Creates DIR (and its parents) when missing. Throws InputError naming the path and the
// errno text when something cannot be created or written; nothing partial is left behind.
std::string write_checkpoint(const std::string& dir, const Checkpoint& ckpt, int keep);

// Reads one step dir, verifying the manifest's format and version, every file's size and every
// array's checksum. Throws InputError naming the file and array and saying what is wrong
// (missing manifest, bad JSON, wrong format version, truncated, checksum mismatch, ...).
Checkpoint read_checkpoint(const std::string& step_dir);

struct LoadedCheckpoint {
  Checkpoint ckpt;
  std::string path;                   // the step dir it was read from
  std::vector<std::string> skipped;   // newer step dirs that failed, each "PATH: why"
};

// The newest valid step dir of checkpoint dir `dir`: tries step-* newest first, records and
// skips the damaged ones, ignores .tmp-* and anything else. nullopt when none is valid or the
// dir does not exist (a fresh job); then `skipped`, when given, says why each step dir failed.
// InputError when `dir` exists but is not a directory or cannot be listed.
std::optional<LoadedCheckpoint> load_latest_checkpoint(const std::string& dir,
                                                       std::vector<std::string>* skipped = nullptr);

// Either a step dir (one with a manifest.json, or named step-*) read as is, or a checkpoint
// dir, whose newest valid step dir is taken. Throws InputError when the path does not exist,
// or holds no valid checkpoint (listing why each candidate was skipped).
LoadedCheckpoint resolve_checkpoint(const std::string& path);

}  // namespace swarm
