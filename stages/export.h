// export.h: a swarm checkpoint -> one PyTorch state dict (`swarm export`, docs/checkpoints.md).
//
// Defines swarm::export_checkpoint. The weights exported are every stage group's global
// weights theta_g (what the swarm evaluates), under nanoGPT's parameter names
// ("transformer.wte.weight", "transformer.h.0.attn.c_attn.weight", ..., "lm_head.weight"; the
// LM head is not tied to wte), as float32 CPU tensors in a zip archive that Python's
// `torch.load` reads as a plain dict of tensors, `weights_only=True` included (libtorch 1.13
// and 2.x). Beside it goes a JSON file with the model config a forward needs
// (tests/python/check_export.py is the reference forward in plain PyTorch).
#pragma once

#include <cstdint>
#include <string>

namespace swarm {

struct ExportSummary {
  std::string checkpoint;    // the step dir read
  std::string pt_path;       // the state dict written
  std::string config_path;   // the model config written
  int step = 0;              // the checkpoint's optimizer steps
  int64_t tensors = 0;
  int64_t parameters = 0;    // floats in all tensors
};

// Reads `ckpt_path` (a checkpoint dir, whose newest valid step dir is taken, or a step dir;
// see resolve_checkpoint), rebuilds each stage's StageModel on the CPU to learn the names
// and shapes, fills them from the stage's theta_g, and writes the state dict to `out_pt` and
// the config to `out_pt` with its extension replaced by ".json" (both written to a temp name
// and renamed; missing parent directories are created). Stores that config path in
// `*config_json_path` when given.
// Throws InputError when the checkpoint is missing, damaged, or does not match its own job
// spec (a stage missing, a theta_g of the wrong size), or when an output cannot be written.
ExportSummary export_checkpoint(const std::string& ckpt_path, const std::string& out_pt,
                                std::string* config_json_path = nullptr);

}  // namespace swarm
