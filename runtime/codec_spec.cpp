// codec_spec.cpp: implements runtime/codec_spec.h: the codec text form (parse_codec, name,
// validate) and the exact encoded sizes.
#include "runtime/codec_spec.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <string>
#include <system_error>

#include "runtime/errors.h"

namespace swarm::compression {
namespace {

constexpr int kMinBlock = 64;
constexpr int kMaxBlock = 4096;
constexpr int kDefaultBlock = 64;
constexpr int kDefaultTopkBlock = 1024;
constexpr double kDefaultTopkFraction = 0.01;
// n above this is surely a bug or an attack (2^48 floats is 1 PiB); keeps size math in range.
constexpr int64_t kMaxElements = int64_t(1) << 48;
const char* const kAccepted =
    "accepted: fp32, fp16, bf16, int8[:block=B][,scale=fp32|fp16], "
    "int4[:block=B][,scale=fp32|fp16], topk[:block=B][,fraction=F] with B an integer in "
    "64..4096 (default 64; topk 1024) and 0 < F <= 1 (default 0.01), "
    "subspace:k=K[,coef=fp32|fp16|bf16|int8|int4][,block=B][,scale=fp16] with K coefficients per "
    "token below d_model (activations and their gradients only), any of them with "
    "entropy=zstd (the codes zstd-compressed on the wire); e.g. "
    "\"int8:block=256,scale=fp16\", \"topk:block=1024,fraction=0.01\", \"int8:block=1024,entropy=zstd\", "
    "\"subspace:k=16,coef=int8\"";
// Largest d_model (and so k) the subspace codec takes; a token's coefficients fit one block row.
constexpr int kMaxSubspaceDim = 65536;

[[noreturn]] void fail(const std::string& what) { throw CodecError(what); }

// Text from the network, made safe to put in an error message.
std::string printable(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < 64; ++i) {
    char c = s[i];
    out += (c >= 0x20 && c < 0x7f) ? c : '?';
  }
  if (s.size() > 64) out += "...";
  return out;
}

// ---- text form ------------------------------------------------------------------------------

bool parse_int(const std::string& v, int* out) {
  if (v.empty() || v.size() > 6) return false;
  for (char c : v)
    if (c < '0' || c > '9') return false;
  *out = std::stoi(v);
  return true;
}

const char* coef_name(Codec c) {
  switch (c) {
    case Codec::kFp32: return "fp32";
    case Codec::kFp16: return "fp16";
    case Codec::kBf16: return "bf16";
    case Codec::kInt8: return "int8";
    case Codec::kInt4: return "int4";
    default: return nullptr;  // not a coefficient codec
  }
}

bool quantized(Codec c) { return c == Codec::kInt8 || c == Codec::kInt4; }

std::string format_double(double d) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, d);  // shortest text that round-trips
  return std::string(buf, r.ptr);
}

}  // namespace

namespace layout {

// Values kept from a block of len values: ceil(fraction * len) in IEEE double, in [1, len].
int topk_keep(double fraction, int len) {
  const double k = std::ceil(fraction * double(len));
  return int(std::min<double>(len, std::max(1.0, k)));
}

int64_t topk_total(const CodecSpec& spec, int64_t n) {
  const int64_t full = n / spec.block;
  const int tail = int(n % spec.block);
  return full * topk_keep(spec.fraction, spec.block) + (tail ? topk_keep(spec.fraction, tail) : 0);
}

void check_count(int64_t n) {
  if (n < 0) fail("codec: element count " + std::to_string(n) + " is negative");
  if (n > kMaxElements)
    fail("codec: element count " + std::to_string(n) + " is above the limit 2^48");
}

}  // namespace layout

// ---- public API -----------------------------------------------------------------------------

bool CodecSpec::operator==(const CodecSpec& o) const {
  return codec == o.codec && block == o.block && fp16_scales == o.fp16_scales &&
         fraction == o.fraction && zstd == o.zstd && k == o.k && dim == o.dim && coef == o.coef &&
         id_bytes == o.id_bytes;
}

CodecSpec CodecSpec::coefficients() const {
  CodecSpec c;
  c.codec = coef;
  c.block = block;
  c.fp16_scales = fp16_scales;
  return c;
}

std::string CodecSpec::name() const {
  std::string text;
  switch (codec) {
    case Codec::kFp32: text = "fp32"; break;
    case Codec::kFp16: text = "fp16"; break;
    case Codec::kBf16: text = "bf16"; break;
    case Codec::kInt8:
    case Codec::kInt4:
      text = std::string(codec == Codec::kInt8 ? "int8" : "int4") + ":block=" + std::to_string(block) +
             (fp16_scales ? ",scale=fp16" : "");
      break;
    case Codec::kTopk: text = "topk:block=" + std::to_string(block) + ",fraction=" + format_double(fraction); break;
    case Codec::kSubspace: {
      const char* c = coef_name(coef);
      text = "subspace:k=" + std::to_string(k) + ",coef=" + (c ? c : "?");
      if (quantized(coef)) text += ",block=" + std::to_string(block) + (fp16_scales ? ",scale=fp16" : "");
      if (dim) text += ",dim=" + std::to_string(dim);
      if (id_bytes) text += ",ids=u" + std::to_string(8 * id_bytes);
      break;
    }
  }
  if (text.empty()) return "codec(" + std::to_string(int(codec)) + ")";
  if (zstd) text += (text.find(':') == std::string::npos ? ":" : ",") + std::string("entropy=zstd");
  return text;
}

void validate(const CodecSpec& s) {
  const std::string what = "codec spec " + s.name() + ": ";
  if (s.codec != Codec::kSubspace && (s.k != 0 || s.dim != 0 || s.coef != Codec::kFp32 || s.id_bytes != 0))
    fail(what + "k, dim, coef and ids apply to subspace only");
  switch (s.codec) {
    case Codec::kSubspace:
      if (!coef_name(s.coef)) fail(what + "coef must be fp32, fp16, bf16, int8 or int4");
      if (quantized(s.coef) ? (s.block < kMinBlock || s.block > kMaxBlock) : (s.block != 0 || s.fp16_scales))
        fail(what + (quantized(s.coef) ? "block " + std::to_string(s.block) + " is outside 64..4096"
                                       : std::string("block and scale apply to int8/int4 coefficients only")));
      if (s.fraction != 0.0) fail(what + "fraction applies to topk only");
      if (s.dim < 0 || s.dim > kMaxSubspaceDim) fail(what + "dim " + std::to_string(s.dim) + " is outside 1..65536");
      if (s.k < 1 || (s.dim > 0 && s.k >= s.dim) || s.k > kMaxSubspaceDim)
        fail(what + "k " + std::to_string(s.k) + " must be at least 1 and below d_model" +
             (s.dim > 0 ? " (" + std::to_string(s.dim) + ")" : ""));
      if (s.id_bytes != 0 && s.id_bytes != 1 && s.id_bytes != 2 && s.id_bytes != 4)
        fail(what + "ids must take 1, 2 or 4 bytes (u8, u16, u32)");
      return;
    case Codec::kFp32:
    case Codec::kFp16:
    case Codec::kBf16:
      if (s.block != 0 || s.fp16_scales || s.fraction != 0.0)
        fail(what + "float codecs take no block, scale or fraction (leave them 0/false)");
      return;
    case Codec::kInt8:
    case Codec::kInt4:
    case Codec::kTopk:
      if (s.block < kMinBlock || s.block > kMaxBlock)
        fail(what + "block " + std::to_string(s.block) + " is outside 64..4096");
      if (s.codec == Codec::kTopk) {
        if (s.fp16_scales) fail(what + "topk stores fp32 values; scale=fp16 does not apply");
        if (!(s.fraction > 0.0 && s.fraction <= 1.0))
          fail(what + "fraction " + format_double(s.fraction) + " is outside (0, 1]");
      } else if (s.fraction != 0.0) {
        fail(what + "fraction applies to topk only");
      }
      return;
  }
  fail("codec spec: unknown codec id " + std::to_string(int(s.codec)) + "; " + kAccepted);
}

CodecSpec parse_codec(const std::string& text) {
  if (text.size() > kMaxCodecTextBytes)
    fail("codec text is " + std::to_string(text.size()) + " bytes, over the limit of " +
         std::to_string(kMaxCodecTextBytes) + " (\"" + printable(text) + "\"); " + kAccepted);
  const std::string bad = "bad codec \"" + printable(text) + "\": ";
  const size_t colon = text.find(':');
  const std::string base = text.substr(0, colon);
  CodecSpec s;
  if (base == "fp32") s.codec = Codec::kFp32;
  else if (base == "fp16") s.codec = Codec::kFp16;
  else if (base == "bf16") s.codec = Codec::kBf16;
  else if (base == "int8") s.codec = Codec::kInt8;
  else if (base == "int4") s.codec = Codec::kInt4;
  else if (base == "topk") s.codec = Codec::kTopk;
  else if (base == "subspace") s.codec = Codec::kSubspace;
  else fail(bad + "unknown codec \"" + printable(base) + "\"; " + kAccepted);

  const bool quant = s.codec == Codec::kInt8 || s.codec == Codec::kInt4;
  const bool topk = s.codec == Codec::kTopk;
  const bool sub = s.codec == Codec::kSubspace;
  if (quant) s.block = kDefaultBlock;
  if (topk) {
    s.block = kDefaultTopkBlock;
    s.fraction = kDefaultTopkFraction;
  }
  if (sub && colon == std::string::npos) fail(bad + "subspace needs k, the coefficients per token, e.g. \"subspace:k=16\"");
  if (colon == std::string::npos) return s;

  bool seen_block = false, seen_scale = false, seen_fraction = false, seen_entropy = false;
  bool seen_k = false, seen_coef = false, seen_dim = false, seen_ids = false;
  size_t at = colon + 1;
  while (true) {
    const size_t comma = text.find(',', at);
    const std::string item = text.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size())
      fail(bad + "parameter \"" + printable(item) + "\" is not key=value; " + kAccepted);
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "entropy") {
      if (seen_entropy) fail(bad + "entropy given twice");
      seen_entropy = true;
      if (value == "zstd") s.zstd = true;
      else if (value != "none") fail(bad + "entropy must be zstd or none, not \"" + printable(value) + "\"");
    } else if (!quant && !topk && !sub) {
      fail(bad + base + " takes no parameters but entropy; " + kAccepted);
    } else if (sub && (key == "k" || key == "dim")) {
      bool& seen = key == "k" ? seen_k : seen_dim;
      if (seen) fail(bad + key + " given twice");
      seen = true;
      int v = 0;
      if (!parse_int(value, &v) || v < 1 || v > kMaxSubspaceDim)
        fail(bad + key + " \"" + printable(value) + "\" is not an integer in 1..65536");
      (key == "k" ? s.k : s.dim) = v;
    } else if (sub && key == "coef") {
      if (seen_coef) fail(bad + "coef given twice");
      seen_coef = true;
      if (value == "fp32") s.coef = Codec::kFp32;
      else if (value == "fp16") s.coef = Codec::kFp16;
      else if (value == "bf16") s.coef = Codec::kBf16;
      else if (value == "int8") s.coef = Codec::kInt8;
      else if (value == "int4") s.coef = Codec::kInt4;
      else fail(bad + "coef must be fp32, fp16, bf16, int8 or int4, not \"" + printable(value) + "\"");
    } else if (sub && key == "ids") {
      if (seen_ids) fail(bad + "ids given twice");
      seen_ids = true;
      if (value == "u8") s.id_bytes = 1;
      else if (value == "u16") s.id_bytes = 2;
      else if (value == "u32") s.id_bytes = 4;
      else fail(bad + "ids must be u8, u16 or u32, not \"" + printable(value) + "\"");
    } else if (key == "block") {
      if (seen_block) fail(bad + "block given twice");
      seen_block = true;
      int b = 0;
      if (!parse_int(value, &b) || b < kMinBlock || b > kMaxBlock)
        fail(bad + "block \"" + printable(value) + "\" is not an integer in 64..4096");
      s.block = b;
    } else if (key == "scale" && (quant || sub)) {
      if (seen_scale) fail(bad + "scale given twice");
      seen_scale = true;
      if (value == "fp16") s.fp16_scales = true;
      else if (value != "fp32") fail(bad + "scale must be fp32 or fp16, not \"" + printable(value) + "\"");
    } else if (key == "fraction" && topk) {
      if (seen_fraction) fail(bad + "fraction given twice");
      seen_fraction = true;
      double f = 0;
      const auto r = std::from_chars(value.data(), value.data() + value.size(), f);
      if (r.ec != std::errc() || r.ptr != value.data() + value.size() || !(f > 0.0 && f <= 1.0))
        fail(bad + "fraction \"" + printable(value) + "\" is not a number in (0, 1]");
      s.fraction = f;
    } else {
      fail(bad + "unknown parameter \"" + printable(key) + "\" for " + base + "; " + kAccepted);
    }
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  if (sub) {
    if (!seen_k) fail(bad + "subspace needs k, the coefficients per token, e.g. \"subspace:k=16\"");
    if (quantized(s.coef)) {
      if (!seen_block) s.block = kDefaultBlock;
    } else if (seen_block || seen_scale) {
      fail(bad + "block and scale apply to int8/int4 coefficients (coef=int8 or coef=int4)");
    }
    if (s.dim > 0 && s.k >= s.dim) fail(bad + "k " + std::to_string(s.k) + " must be below dim " + std::to_string(s.dim));
  }
  return s;
}

size_t encoded_bytes(const CodecSpec& spec, int64_t n) {
  validate(spec);
  layout::check_count(n);
  const size_t un = size_t(n);
  switch (spec.codec) {
    case Codec::kFp32: return 4 * un;
    case Codec::kFp16:
    case Codec::kBf16: return 2 * un;
    case Codec::kInt8: return size_t(layout::blocks(n, spec.block)) * layout::scale_bytes(spec) + un;
    case Codec::kInt4: return size_t(layout::blocks(n, spec.block)) * layout::scale_bytes(spec) + (un + 1) / 2;
    case Codec::kTopk: return 6 * size_t(layout::topk_total(spec, n));
    case Codec::kSubspace: {
      if (spec.dim == 0)
        fail("codec " + spec.name() + ": not bound to a model (dim=d_model unknown); a stage server sets it");
      if (n % spec.dim != 0)
        fail("codec " + spec.name() + ": " + std::to_string(n) + " values are not whole tokens of " +
             std::to_string(spec.dim));
      const int64_t tokens = n / spec.dim;
      return size_t(tokens) * size_t(spec.id_bytes) + encoded_bytes(spec.coefficients(), tokens * spec.k);
    }
  }
  return 0;  // unreachable: validate() rejects unknown codecs
}

std::optional<SubspaceJob> subspace_job(const std::string& activations, const std::string& gradients,
                                        const std::string& outer, int d_model, int vocab_size) {
  if (parse_codec(outer).codec == Codec::kSubspace)
    fail("compression.outer: the subspace codec is for activations and their gradients, which it confines "
         "to the job's subspace; outer gradients are weights: use fp32, int8, int4 or topk");
  SubspaceJob job;
  const int id_bytes = vocab_size <= 256 ? 1 : vocab_size <= 65536 ? 2 : 4;
  for (const auto& [field, text] : {std::pair<const char*, const std::string&>{"compression.activations", activations},
                                    {"compression.gradients", gradients}}) {
    CodecSpec s = parse_codec(text);
    if (s.codec != Codec::kSubspace) continue;
    const std::string where = std::string(field) + " \"" + text + "\": ";
    if (s.dim != 0 && s.dim != d_model)
      fail(where + "dim " + std::to_string(s.dim) + " is not the model's d_model " + std::to_string(d_model) + " (leave dim out)");
    if (s.id_bytes != 0) fail(where + "the stage chooses how token ids travel; leave ids out");
    if (s.k >= d_model)
      fail(where + "k " + std::to_string(s.k) + " must be below d_model " + std::to_string(d_model) +
           " (k coefficients stand for d_model values per token)");
    if (job.k != 0 && job.k != s.k)
      fail(where + "k " + std::to_string(s.k) + " differs from the other direction's k " + std::to_string(job.k) +
           "; a job has one subspace");
    job.k = s.k;
    s.dim = d_model;
    const bool acts = std::string(field) == "compression.activations";
    s.id_bytes = acts ? id_bytes : 0;
    validate(s);
    (acts ? job.activations : job.gradients) = s;
  }
  if (job.k == 0) return std::nullopt;
  return job;
}

}  // namespace swarm::compression
