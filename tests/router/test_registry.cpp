// test_registry.cpp: the router's registry of peers (router/registry.h): lookups by routing id.
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "router/registry.h"

using namespace swarm;
using namespace swarm::router;

namespace {

msg::Hello hello(const std::string& name) {
  msg::Hello h;
  h.name = name;
  return h;
}

}  // namespace

// A peer removed is not found (the index remembers its last hit: a removal forgets it), and one
// that says HELLO again under the same id is found as its new record, with the others' records
// untouched.
TEST(Registry, FindNeverReturnsARemovedPeer) {
  Registry reg(500, 3);
  Peer& a = reg.add("p-a", hello("a"), 0);
  reg.add("p-b", hello("b"), 0);
  ASSERT_EQ(reg.find("p-a"), &a);
  ASSERT_NE(reg.find("p-b"), nullptr);
  EXPECT_EQ(reg.find("p-a")->hello.name, "a");
  EXPECT_EQ(reg.find("p-c"), nullptr);
  reg.remove("p-a");
  EXPECT_EQ(reg.find("p-a"), nullptr);
  EXPECT_EQ(static_cast<const Registry&>(reg).find("p-a"), nullptr);
  Peer& again = reg.add("p-a", hello("a-again"), 1);
  EXPECT_EQ(reg.find("p-a"), &again);
  EXPECT_EQ(reg.find("p-a")->hello.name, "a-again");
  EXPECT_EQ(reg.find("p-b")->hello.name, "b");
  reg.remove("p-b");
  EXPECT_EQ(reg.find("p-b"), nullptr);
  EXPECT_EQ(reg.find("p-a"), &again);
  reg.check_index();
}

// The index by id holds up under churn: peers joining and leaving in a random order, thousands
// of them, every lookup agreeing with the registry's own records (collisions, wrap-around and
// removals in the middle of a probe run included).
TEST(Registry, LookupsAgreeWithTheRecordsUnderChurn) {
  Registry reg(500, 3);
  std::mt19937_64 rng(7);
  std::set<std::string> live;
  for (int round = 0; round < 4000; ++round) {
    const std::string id = "p-" + std::to_string(rng() % 1500);
    if (live.count(id) && rng() % 3 == 0) {
      reg.remove(id);
      live.erase(id);
    } else {
      reg.add(id, hello(id), double(round));
      live.insert(id);
    }
    if (round % 500 == 0 || round == 3999) {
      reg.check_index();
      ASSERT_EQ(reg.size(), live.size());
      for (int k = 0; k < 1500; ++k) {
        const std::string q = "p-" + std::to_string(k);
        const Peer* p = reg.find(q);
        ASSERT_EQ(p != nullptr, live.count(q) == 1) << q;
        if (p) EXPECT_EQ(p->id, q);
      }
    }
  }
}
