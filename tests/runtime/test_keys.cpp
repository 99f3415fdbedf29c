// test_keys.cpp: keypair files, the authorized file, routing ids from keys, and the bound on a
// round's contributions (runtime/keys.h, runtime/diloco.h).
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <fstream>

#include "runtime/diloco.h"
#include "runtime/errors.h"
#include "runtime/keys.h"

using namespace swarm;

namespace {

std::string temp_dir() {
  char tmpl[] = "/tmp/swarm-keys-test-XXXXXX";
  return mkdtemp(tmpl);
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Keys, AKeypairIsWrittenPrivateReadBackAndNeverOverwritten) {
  const std::string dir = temp_dir();
  const KeyPair k = generate_keypair();
  write_keypair(dir + "/a", k);
  struct stat st {};
  ASSERT_EQ(::stat((dir + "/a.key").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  const KeyPair back = read_keypair(dir + "/a");
  EXPECT_EQ(back.public_key, k.public_key);
  EXPECT_EQ(back.secret_key, k.secret_key);
  EXPECT_EQ(read_public_key(dir + "/a.pub"), k.public_key);
  EXPECT_EQ(read_public_key(k.public_key), k.public_key);
  EXPECT_NE(message_of([&] { write_keypair(dir + "/a", generate_keypair()); }).find("exists"), std::string::npos);
  // A secret others can read is refused, with the fix.
  chmod((dir + "/a.key").c_str(), 0644);
  EXPECT_NE(message_of([&] { read_keypair(dir + "/a.key"); }).find("chmod 600"), std::string::npos);
}

TEST(Keys, TheAuthorizedFileSaysWhichLineIsWrong) {
  const std::string dir = temp_dir();
  const KeyPair a = generate_keypair(), b = generate_keypair();
  std::ofstream(dir + "/ok") << "# comment\n\n" << a.public_key << " stage gpu-box-1\n" << b.public_key << " admin\n";
  const std::vector<Authorized> list = read_authorized(dir + "/ok");
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].role, Role::kStage);
  EXPECT_EQ(list[0].name, "gpu-box-1");
  EXPECT_EQ(list[1].role, Role::kAdmin);
  EXPECT_EQ(list[1].name, b.public_key.substr(0, 8));
  std::ofstream(dir + "/role") << a.public_key << " root someone\n";
  EXPECT_NE(message_of([&] { read_authorized(dir + "/role"); }).find(":1: role \"root\""), std::string::npos);
  std::ofstream(dir + "/key") << "# x\nnot-a-key client bob\n";
  EXPECT_NE(message_of([&] { read_authorized(dir + "/key"); }).find(":2: expected `KEY ROLE NAME`"), std::string::npos);
  std::ofstream(dir + "/twice") << a.public_key << " stage x\n" << a.public_key << " admin y\n";
  EXPECT_NE(message_of([&] { read_authorized(dir + "/twice"); }).find("listed twice"), std::string::npos);
}

TEST(Keys, ARoutingIdIsTheKeysOwn) {
  const KeyPair a = generate_keypair(), b = generate_keypair();
  EXPECT_EQ(routing_id_of(a.public_key), routing_id_of(a.public_key));
  EXPECT_NE(routing_id_of(a.public_key), routing_id_of(b.public_key));
  EXPECT_EQ(routing_id_of(a.public_key).rfind("k-", 0), 0u);
}

TEST(Outliers, AnOutsizedOrNonFiniteContributionIsLeftOutAndReported) {
  // The lower median of {1, 1.2, 1.4e6} is 1.2: 1.4e6 is over 4 x 1.2.
  EXPECT_EQ(diloco::outliers({{1, 0}, {0, 1.2f}, {1e6f, 1e6f}}, {1, 1, 1}).left_out, std::vector<size_t>{2});
  EXPECT_TRUE(diloco::outliers({{1, 0}, {0, 1.2f}, {3, 3}}, {1, 1, 1}).left_out.empty());   // 4.24 < 4.8: kept
  // Two peers: the lower median is the smaller norm, so the larger one cannot run away.
  EXPECT_EQ(diloco::outliers({{1, 0}, {0, 100}}, {1, 1}).left_out, std::vector<size_t>{1});
  // Non-finite ones always go; a lone contribution never does (one peer: exact).
  EXPECT_EQ(diloco::outliers({{1, 0}, {0, 1}, {NAN, 0}}, {1, 1, 1}).left_out, std::vector<size_t>{2});
  EXPECT_EQ(diloco::outliers({{1, 0}, {0, 1}, {INFINITY, 0}}, {1, 1, 0}).left_out, std::vector<size_t>{2});
  EXPECT_TRUE(diloco::outliers({{1e9f}}, {1}).left_out.empty());
  // Norms, not norms per sample: a peer that served a tenth of the samples in the same inner steps
  // has a Δ of the same size, and is not left out; weight 0 (no inner step) is never an outlier.
  EXPECT_TRUE(diloco::outliers({{3, 0}, {0, 1}}, {100, 10}).left_out.empty());
  EXPECT_EQ(diloco::outliers({{3, 0}, {0, 1}, {0, 1e3f}}, {100, 10, 100}).left_out, std::vector<size_t>{2});
  EXPECT_TRUE(diloco::outliers({{3, 0}, {0, 1}, {0, 1e3f}}, {100, 10, 0}).left_out.empty());
  // Counted against a peer only far past any honest spread (kBlameFactor), or not finite.
  EXPECT_EQ(diloco::outliers({{1, 0}, {0, 1.2f}, {1e6f, 1e6f}}, {1, 1, 1}).far, std::vector<size_t>{2});
  EXPECT_TRUE(diloco::outliers({{1, 0}, {0, 1}, {0, 50}}, {1, 1, 1}).far.empty());
  EXPECT_EQ(diloco::outliers({{1, 0}, {0, 1}, {NAN, 0}}, {1, 1, 1}).far, std::vector<size_t>{2});
  // The yardstick is the peers that trained at least half as much as the most: a newcomer's
  // small Δ (it synced one step ago) does not make the peer that trained all along an outlier.
  EXPECT_TRUE(diloco::outliers({{0, 5}, {1, 0}}, {500, 100}).left_out.empty());
  EXPECT_EQ(diloco::outliers({{0, 5}, {1, 0}, {0, 1e4f}}, {500, 100, 50}).left_out, std::vector<size_t>{2});
  // Gradient sums by norm / sqrt(samples): 16 samples with a sum 4x as long as 1 sample's is
  // honest (scores 1 and 1), a sum 10^6 x as long is not, whatever the samples it claims.
  EXPECT_TRUE(diloco::outliers({{1, 0}, {0, 4}}, {1, 16}, true).left_out.empty());
  EXPECT_EQ(diloco::outliers({{1, 0}, {0, 4}, {1e6f, 0}}, {1, 16, 16}, true).left_out, std::vector<size_t>{2});
  // At weight 0 a sum counts as one sample: an honest peer with nothing served sends zeros.
  EXPECT_EQ(diloco::outliers({{1, 0}, {0, 1}, {0, 0}, {0, 50}}, {1, 1, 0, 0}, true).left_out, std::vector<size_t>{3});
}
