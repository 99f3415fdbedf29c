// fuzz_job_spec.cpp: libFuzzer target for parse_job_spec_text on arbitrary text, the job spec a
// user (or anyone who can reach the router's port with a SUBMIT) writes.
//
// Input: the JSON text itself. Checked on every input (a failure aborts):
//   - parsing returns a JobSpec or throws SpecError; any other exception escapes (a crash);
//   - an accepted spec's canonical JSON (to_json) parses again to an equal spec with the same
//     canonical JSON: what the router sends to peers is what it accepted;
//   - the derived fields hold their documented rules (layers_per_stage has one entry of at least
//     1 per stage and sums to n_layer; max_inflight, inner_batch and microbatches per step are
//     positive) so that code behind the parser can rely on them;
//   - the three codec names parse or throw CodecError (what the router does next).
// Data files are not opened (check_files false): the target stays deterministic.
#include <string>

#include "compression/codec.h"
#include "runtime/errors.h"
#include "runtime/job_spec.h"
#include "tests/fuzz/fuzz_check.h"

using namespace swarm;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  JobSpec s;
  try {
    s = parse_job_spec_text(text, /*check_files=*/false);
  } catch (const SpecError&) {
    return 0;
  }
  const nlohmann::json canon = to_json(s);
  JobSpec again = parse_job_spec(canon, /*check_files=*/false);   // must not throw
  FUZZ_CHECK(again == s, "the canonical JSON parses to a different spec");
  FUZZ_CHECK(to_json(again) == canon, "the canonical JSON is not a fixed point");

  const auto& p = s.partition;
  FUZZ_CHECK(p.stages >= 1 && int(p.layers_per_stage.size()) == p.stages, "layers_per_stage has one entry per stage");
  for (int l : p.layers_per_stage) FUZZ_CHECK(l >= 1, "every stage has a layer");
  FUZZ_CHECK(s.first_layer(p.stages) == s.model.n_layer, "layers_per_stage sums to n_layer");
  FUZZ_CHECK(s.max_inflight >= 1 && s.batch.inner_batch >= 1 && s.microbatches_per_step() >= 1,
             "derived counts are positive");
  FUZZ_CHECK(s.model.seq_len <= s.model.max_seq_len, "seq_len fits the position table");

  for (const std::string* c : {&s.compression.activations, &s.compression.gradients, &s.compression.outer}) {
    try {
      compression::parse_codec(*c);
    } catch (const CodecError&) {
    }
  }
  return 0;
}
