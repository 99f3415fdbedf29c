// test_data.cpp: token data loading (text and bin), the train/val split, the unigram baseline
// and the deterministic microbatch sampler (runtime/data.h).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "runtime/data.h"
#include "runtime/errors.h"

using swarm::DataSpec;
using swarm::Microbatch;
using swarm::Split;
using swarm::SpecError;
using swarm::TokenData;

namespace {

#define EXPECT_HAS(msg, part) EXPECT_NE(std::string(msg).find(part), std::string::npos) << "message: " << (msg)

// Temp files removed when the test ends.
class DataTest : public testing::Test {
 protected:
  ~DataTest() override {
    for (const auto& p : files_) std::remove(p.c_str());
  }
  std::string write(const std::string& name, const std::string& bytes) {
    std::string p = testing::TempDir() + "swarm_data_" + std::to_string(getpid()) + "_" +
                    testing::UnitTest::GetInstance()->current_test_info()->name() + "_" + name;
    std::ofstream f(p, std::ios::binary);
    f.write(bytes.data(), std::streamsize(bytes.size()));
    files_.push_back(p);
    return p;
  }
  std::string write_u16(const std::string& name, const std::vector<uint16_t>& toks) {
    std::string bytes;
    for (uint16_t t : toks) {
      bytes.push_back(char(t & 0xff));
      bytes.push_back(char(t >> 8));
    }
    return write(name, bytes);
  }
  std::vector<std::string> files_;
};

DataSpec spec(const std::string& format, std::vector<std::string> paths, double val_fraction = 0.1) {
  DataSpec d;
  d.format = format;
  d.paths = std::move(paths);
  d.val_fraction = val_fraction;
  return d;
}

std::string load_error(const DataSpec& d, int seq_len, int vocab) {
  try {
    TokenData::load(d, seq_len, vocab);
  } catch (const SpecError& e) {
    return e.what();
  }
  return "";
}

std::string counting_text(size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) s.push_back(char('a' + i % 26));
  return s;
}

}  // namespace

TEST_F(DataTest, TextBytesAreTokensAndFilesConcatenate) {
  std::string a = write("a.txt", "hello ");
  std::string b = write("b.txt", std::string("w\xff\x00rld", 5) + std::string(89, 'z'));
  TokenData d = TokenData::load(spec("text", {a, b}, 0.5), 4, 256);
  // 6 + 94 = 100 tokens: 50 train, 50 val.
  ASSERT_EQ(d.train().size(), 50u);
  ASSERT_EQ(d.val().size(), 50u);
  std::vector<uint16_t> head(d.train().begin(), d.train().begin() + 11);
  EXPECT_EQ(head, std::vector<uint16_t>({'h', 'e', 'l', 'l', 'o', ' ', 'w', 255, 0, 'r', 'l'}));
  EXPECT_EQ(d.val().back(), 'z');
}

TEST_F(DataTest, SplitIsTheLastFraction) {
  std::string p = write("c.txt", counting_text(1000));
  TokenData d = TokenData::load(spec("text", {p}, 0.1), 8, 256);
  EXPECT_EQ(d.train().size(), 900u);
  EXPECT_EQ(d.val().size(), 100u);
  // The validation split is the tail of the stream, in order.
  EXPECT_EQ(d.val()[0], 'a' + 900 % 26);
  EXPECT_EQ(d.train()[899], 'a' + 899 % 26);

  TokenData e = TokenData::load(spec("text", {p}, 0.25), 8, 256);
  EXPECT_EQ(e.train().size(), 750u);
  EXPECT_EQ(e.val().size(), 250u);
}

TEST_F(DataTest, BinIsLittleEndianUint16) {
  std::string p = write_u16("t.bin", {0, 1, 258, 65535, 7, 300, 4, 5, 6, 9});
  TokenData d = TokenData::load(spec("bin", {p}, 0.5), 2, 65536);
  EXPECT_EQ(d.train(), std::vector<uint16_t>({0, 1, 258, 65535, 7}));
  EXPECT_EQ(d.val(), std::vector<uint16_t>({300, 4, 5, 6, 9}));
}

TEST_F(DataTest, BinRejectsOddBytesAndTokensOverVocab) {
  std::string odd = write("odd.bin", std::string(11, '\x01'));
  std::string msg = load_error(spec("bin", {odd}), 2, 1000);
  EXPECT_HAS(msg, odd);
  EXPECT_HAS(msg, "11 bytes");
  EXPECT_HAS(msg, "odd");

  std::string big = write_u16("big.bin", {1, 2, 3, 50000, 4, 60000, 5, 6, 7, 8});
  msg = load_error(spec("bin", {big}), 2, 50000);
  EXPECT_HAS(msg, big);
  EXPECT_HAS(msg, "token 50000 at position 3");
  EXPECT_HAS(msg, "model.vocab_size 50000");
}

TEST_F(DataTest, TextTokensOverVocabRejected) {
  std::string p = write("hi.txt", counting_text(100));
  EXPECT_HAS(load_error(spec("text", {p}), 4, 64), "at position 0");
}

TEST_F(DataTest, MissingAndEmptyFiles) {
  std::string msg = load_error(spec("text", {"/nonexistent/dir/x.txt"}), 4, 256);
  EXPECT_HAS(msg, "/nonexistent/dir/x.txt");
  EXPECT_HAS(msg, "cannot read");
  EXPECT_HAS(load_error(spec("text", {testing::TempDir()}), 4, 256), "is a directory");
  std::string empty = write("empty.txt", "");
  std::string ok = write("ok.txt", counting_text(100));
  msg = load_error(spec("text", {ok, empty}), 4, 256);
  EXPECT_HAS(msg, empty);
  EXPECT_HAS(msg, "is empty");
}

TEST_F(DataTest, SplitsTooShortForOneSample) {
  std::string p = write("short.txt", counting_text(100));
  // val: 10 tokens, needs seq_len + 1 = 17.
  std::string msg = load_error(spec("text", {p}, 0.1), 16, 256);
  EXPECT_HAS(msg, "validation split holds 10 tokens");
  EXPECT_HAS(msg, "model.seq_len + 1 = 17");
  // train: 5 tokens.
  msg = load_error(spec("text", {p}, 0.95), 16, 256);
  EXPECT_HAS(msg, "training split holds 5 tokens");
  // Exactly seq_len + 1 in each is enough.
  EXPECT_EQ(load_error(spec("text", {p}, 0.5), 49, 256), "");
}

TEST_F(DataTest, UnigramLossOfEquiprobableSymbols) {
  // val split = last half: "abcd" repeated -> 4 equiprobable symbols -> ln 4 nats.
  std::string text = std::string(400, 'x');
  for (int i = 0; i < 100; ++i) text += "abcd";
  std::string p = write("u.txt", text);
  TokenData d = TokenData::load(spec("text", {p}, 0.5), 8, 256);
  EXPECT_NEAR(d.unigram_loss(), std::log(4.0), 1e-12);

  // 3/4 'a', 1/4 'b': H = -(0.75 ln 0.75 + 0.25 ln 0.25).
  std::string t2 = std::string(400, 'x');
  for (int i = 0; i < 100; ++i) t2 += "aaab";
  TokenData e = TokenData::load(spec("text", {write("u2.txt", t2)}, 0.5), 8, 256);
  EXPECT_NEAR(e.unigram_loss(), -(0.75 * std::log(0.75) + 0.25 * std::log(0.25)), 1e-12);
}

TEST_F(DataTest, SamplerIsDeterministicAndShifted) {
  std::string text;
  for (int i = 0; i < 5000; ++i) text.push_back(char(i * 7919 % 251));
  TokenData d = TokenData::load(spec("text", {write("s.txt", text)}, 0.2), 16, 256);

  Microbatch a = swarm::sample_microbatch(d, Split::kTrain, 42, 3, 4, 16);
  Microbatch b = swarm::sample_microbatch(d, Split::kTrain, 42, 3, 4, 16);
  EXPECT_EQ(a.samples, 4);
  EXPECT_EQ(a.seq_len, 16);
  ASSERT_EQ(a.x.size(), 64u);
  ASSERT_EQ(a.y.size(), 64u);
  EXPECT_EQ(a.x, b.x);
  EXPECT_EQ(a.y, b.y);

  // A different index, seed or split gives different text.
  EXPECT_NE(swarm::sample_microbatch(d, Split::kTrain, 42, 4, 4, 16).x, a.x);
  EXPECT_NE(swarm::sample_microbatch(d, Split::kTrain, 43, 3, 4, 16).x, a.x);
  EXPECT_NE(swarm::sample_microbatch(d, Split::kVal, 42, 3, 4, 16).x, a.x);
  // Samples inside one microbatch differ from one another.
  EXPECT_FALSE(std::equal(a.x.begin(), a.x.begin() + 16, a.x.begin() + 16));
  // The first samples of a larger microbatch are those of a smaller one with the same key.
  Microbatch big = swarm::sample_microbatch(d, Split::kTrain, 42, 3, 8, 16);
  EXPECT_TRUE(std::equal(a.x.begin(), a.x.end(), big.x.begin()));

  // y is x shifted by one, and each row is a contiguous slice of the split.
  for (const Microbatch& mb : {a, big, swarm::sample_microbatch(d, Split::kVal, 7, 0, 8, 16)}) {
    for (int s = 0; s < mb.samples; ++s) {
      for (int t = 0; t + 1 < mb.seq_len; ++t) {
        EXPECT_EQ(mb.y[size_t(s * mb.seq_len + t)], mb.x[size_t(s * mb.seq_len + t + 1)]);
      }
    }
  }
  for (int s = 0; s < a.samples; ++s) {
    const auto& tr = d.train();
    auto it = std::search(tr.begin(), tr.end(), a.x.begin() + s * 16, a.x.begin() + s * 16 + 16);
    ASSERT_NE(it, tr.end());
    EXPECT_EQ(*(it + 16), a.y[size_t(s * 16 + 15)]);
  }
}

TEST_F(DataTest, SamplerCoversEveryStartIncludingTheLast) {
  // train = 10 tokens 0..9, seq_len 4: valid starts 0..5 (y needs tokens up to 9).
  std::vector<uint16_t> toks;
  for (uint16_t i = 0; i < 20; ++i) toks.push_back(i);
  TokenData d = TokenData::load(spec("bin", {write_u16("r.bin", toks)}, 0.5), 4, 100);
  std::vector<int> seen(10, 0);
  for (uint64_t i = 0; i < 2000; ++i) {
    Microbatch mb = swarm::sample_microbatch(d, Split::kTrain, 1, i, 1, 4);
    ASSERT_LE(mb.x[0], 5);
    ASSERT_EQ(mb.y[3], mb.x[0] + 4);
    seen[size_t(mb.x[0])] += 1;
  }
  for (int o = 0; o <= 5; ++o) EXPECT_GT(seen[size_t(o)], 200) << "start " << o;  // ~333 each
}

TEST_F(DataTest, SamplerOnAJobSpecSizedSplit) {
  // seq_len exactly fills the split: the only start is 0.
  std::vector<uint16_t> toks = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  TokenData d = TokenData::load(spec("bin", {write_u16("one.bin", toks)}, 0.5), 4, 100);
  Microbatch mb = swarm::sample_microbatch(d, Split::kVal, 99, 12345, 2, 4);
  EXPECT_EQ(mb.x, std::vector<int32_t>({6, 7, 8, 9, 6, 7, 8, 9}));
  EXPECT_EQ(mb.y, std::vector<int32_t>({7, 8, 9, 10, 7, 8, 9, 10}));
  EXPECT_THROW(swarm::sample_microbatch(d, Split::kVal, 99, 0, 1, 5), SpecError);
}

// A job's data is read by the router: a device, a FIFO, or more bytes than the router allows
// (one large file listed many times) is refused before anything is read, and a FIFO does not
// block the reader.
TEST_F(DataTest, OnlyRegularFilesWithinTheByteLimitAreRead) {
  EXPECT_HAS(load_error(spec("text", {"/dev/zero"}), 4, 256), "\"/dev/zero\" is not a regular file");
  const std::string fifo = testing::TempDir() + "swarm_data_fifo_" + std::to_string(getpid());
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  files_.push_back(fifo);
  EXPECT_HAS(load_error(spec("text", {fifo}), 4, 256), "is not a regular file (a device, FIFO or socket)");
  const std::string p = write("big.txt", counting_text(1000));
  std::vector<std::string> many(300, p);
  try {
    TokenData::load(spec("text", many), 4, 256, /*max_bytes=*/100000);
    FAIL() << "loaded 300 KB under a 100 KB limit";
  } catch (const SpecError& e) {
    EXPECT_HAS(e.what(), "takes the job's data past the limit");
    EXPECT_HAS(e.what(), "--max-data-bytes");
  }
  EXPECT_NO_THROW(TokenData::load(spec("text", {p, p}), 4, 256, /*max_bytes=*/2000));
}
