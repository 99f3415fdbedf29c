// test_dispatch.cpp: the dispatcher's choice (router/dispatch.h) on constructed candidates.
#include <gtest/gtest.h>

#include <cmath>

#include "router/dispatch.h"

using namespace swarm;

namespace {
// `name` only says in the test what the candidate stands for.
Candidate peer(const char* /*name*/, double queued, double ms, bool affinity = false, bool excluded = false) {
  Candidate c;
  c.queued_units = queued;
  c.ms_per_unit = ms;
  c.affinity = affinity;
  c.excluded = excluded;
  return c;
}
}  // namespace

TEST(Dispatch, LeastExpectedCompletion) {
  // 2 queued units at 10 ms beat 0 queued at 40 ms: (2+1)*10 < (0+1)*40.
  EXPECT_EQ(choose_peer({peer("slow", 0, 40), peer("fast", 2, 10)}, kForwardUnits, kBackwardCachedUnits), 1);
  EXPECT_EQ(choose_peer({peer("slow", 0, 40), peer("fast", 5, 10)}, kForwardUnits, kBackwardCachedUnits), 0);
}

TEST(Dispatch, UnmeasuredPeerEntersAtTheFastestSpeed) {
  // Not measured: counted at 10 ms, so with an empty queue it is tried.
  EXPECT_EQ(choose_peer({peer("busy", 3, 10), peer("new", 0, 0)}, kForwardUnits, kBackwardCachedUnits), 1);
}

TEST(Dispatch, BackwardStaysWithTheGraphUnlessAnotherPeerIsClearlyQuicker) {
  // Same speed. The holder: (2 queued + 2 cached) = 4 units. The other: 0 queued, 3 units to
  // recompute, plus 2 charged for the capacity the recompute takes = 5: the holder wins,
  // where plain completion time (4 vs 3) would have sent it away.
  EXPECT_EQ(choose_peer({peer("other", 0, 10), peer("holder", 2, 10, true)}, kBackwardRecomputeUnits, kBackwardCachedUnits), 1);
  // A holder with a long queue loses: 10 + 2 = 12 units against 5.
  EXPECT_EQ(choose_peer({peer("other", 0, 10), peer("holder", 10, 10, true)}, kBackwardRecomputeUnits, kBackwardCachedUnits), 0);
  // The holder excluded (banned, or failed this hop): no charge, the other takes it.
  EXPECT_EQ(choose_peer({peer("other", 1, 10), peer("holder", 0, 10, true, true)}, kBackwardRecomputeUnits, kBackwardCachedUnits), 0);
}

TEST(Dispatch, NoEligiblePeer) {
  EXPECT_EQ(choose_peer({peer("a", 0, 10, false, true)}, kForwardUnits, kBackwardCachedUnits), -1);
  EXPECT_EQ(choose_peer({}, kForwardUnits, kBackwardCachedUnits), -1);
}

TEST(Dispatch, AFullPeerIsPassedOverAndNoneOpenMeansTheHopWaits) {
  // The fast peer would win, but its queue is at its bound: the slow one takes the hop.
  Candidate fast = peer("fast", 10, 10);
  fast.full = true;
  EXPECT_EQ(choose_peer({peer("slow", 0, 40), fast}, kForwardUnits, kBackwardCachedUnits), 0);
  Candidate slow = peer("slow", 25, 40);
  slow.full = true;
  EXPECT_EQ(choose_peer({slow, fast}, kForwardUnits, kBackwardCachedUnits), -1);
}

TEST(Dispatch, APeersQueueHoldsMaxQueuedSecondsOfItsWorkAndAtLeastFourUnits) {
  EXPECT_DOUBLE_EQ(queue_bound_units(10, 1.0), 100);             // 1 s at 10 ms per unit
  EXPECT_DOUBLE_EQ(queue_bound_units(500, 1.0), kMinQueuedUnits); // a slow peer still gets a few
  EXPECT_DOUBLE_EQ(queue_bound_units(0, 1.0), kMinQueuedUnits);   // not measured yet
  EXPECT_TRUE(std::isinf(queue_bound_units(10, 0)));             // 0: no bound
}
