// test_registry.cpp: the router's registry of peers (router/registry.h): lookups by routing id.
#include <gtest/gtest.h>

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

// A peer removed is not found, and one that says HELLO again under the same id is found as its
// new record, with the others' records untouched.
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
