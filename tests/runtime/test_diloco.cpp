// test_diloco.cpp: the outer step's arithmetic in closed form (runtime/diloco.h): the
// sample-weighted mean the router forms, the outer step every peer applies, and the streaming
// schedule of fragments.
#include <gtest/gtest.h>

#include <set>

#include "runtime/diloco.h"

using namespace swarm;

TEST(Diloco, SampleWeightingThreeToOne) {
  // Two peers' outer gradients with 3:1 sample counts: the mean is the 3:1 weighted average.
  const std::vector<float> a{1.f, -2.f, 0.5f, 4.f}, b{5.f, 2.f, -1.5f, 0.f};
  std::vector<float> sum;
  diloco::accumulate(sum, a.data(), a.size(), 3.f);
  diloco::accumulate(sum, b.data(), b.size(), 1.f);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_FLOAT_EQ(sum[i] / 4.f, 0.75f * a[i] + 0.25f * b[i]) << i;
}

TEST(Diloco, OuterSgdWithLrOneAndNoMomentumAveragesTheWeights) {
  // theta_g - 1 * mean(theta_g - theta_i) = mean(theta_i), whatever theta_g was.
  std::vector<float> theta_g{0.3f, -1.f, 2.f}, mom(3, 0.f);
  const std::vector<float> t1{0.5f, -0.5f, 1.f}, t2{0.1f, -1.5f, 3.f};
  std::vector<float> d1(3), d2(3), sum;
  for (size_t i = 0; i < 3; ++i) d1[i] = theta_g[i] - t1[i], d2[i] = theta_g[i] - t2[i];
  diloco::accumulate(sum, d1.data(), 3, 1.f);
  diloco::accumulate(sum, d2.data(), 3, 1.f);
  for (float& v : sum) v /= 2.f;
  diloco::outer_step(theta_g.data(), mom.data(), sum.data(), 3, 1.f, 0.f, false);
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(theta_g[i], 0.5f * (t1[i] + t2[i]), 1e-6) << i;
  // One peer: theta_g becomes that peer's weights (what plain training would have).
  std::vector<float> g{1.f, 2.f}, m(2, 0.f), t{0.25f, 1.75f}, d{g[0] - t[0], g[1] - t[1]};
  diloco::outer_step(g.data(), m.data(), d.data(), 2, 1.f, 0.f, false);
  EXPECT_FLOAT_EQ(g[0], t[0]);
  EXPECT_FLOAT_EQ(g[1], t[1]);
}

TEST(Diloco, NesterovMomentumClosedForm) {
  // Two steps with d = 1, lr 0.5, mu 0.9: m1 = 1, update1 = 1 + 0.9 = 1.9;
  // m2 = 1.9, update2 = 1 + 0.9 * 1.9 = 2.71.
  float g = 10.f, m = 0.f;
  const float d = 1.f;
  diloco::outer_step(&g, &m, &d, 1, 0.5f, 0.9f, true);
  EXPECT_FLOAT_EQ(m, 1.f);
  EXPECT_FLOAT_EQ(g, 10.f - 0.5f * 1.9f);
  diloco::outer_step(&g, &m, &d, 1, 0.5f, 0.9f, true);
  EXPECT_FLOAT_EQ(m, 1.9f);
  EXPECT_FLOAT_EQ(g, 10.f - 0.5f * 1.9f - 0.5f * 2.71f);
  // Plain momentum: the update is the momentum itself.
  float g2 = 0.f, m2 = 0.5f;
  diloco::outer_step(&g2, &m2, &d, 1, 1.f, 0.5f, false);
  EXPECT_FLOAT_EQ(m2, 1.25f);
  EXPECT_FLOAT_EQ(g2, -1.25f);
}

TEST(Diloco, FragmentsTileTheParameters) {
  for (size_t P : {1u, 7u, 100u, 123457u})
    for (int F : {1, 2, 3, 4, 7}) {
      size_t next = 0;
      for (int f = 0; f < F; ++f) {
        const auto [lo, hi] = diloco::fragment_range(P, F, f);
        EXPECT_EQ(lo, next) << P << " " << F << " " << f;
        EXPECT_LE(hi - lo, P / size_t(F) + 1);
        next = hi;
      }
      EXPECT_EQ(next, P);
    }
}

TEST(Diloco, StreamingSyncsEveryFragmentExactlyOncePerHSteps) {
  for (auto [H, F] : {std::pair{8, 4}, {50, 4}, {10, 1}, {6, 6}, {7, 3}}) {
    // Over any window of H consecutive steps, each fragment syncs exactly once.
    for (int start = 1; start <= 3 * H; ++start) {
      std::multiset<int> seen;
      for (int s = start; s < start + H; ++s) {
        const int f = diloco::fragment_due(s, H, F);
        if (f >= 0) seen.insert(f);
      }
      ASSERT_EQ(seen.size(), size_t(F)) << "H " << H << " F " << F << " from step " << start;
      for (int f = 0; f < F; ++f) EXPECT_EQ(seen.count(f), 1u) << "H " << H << " F " << F << " fragment " << f;
    }
    // Without streaming: every multiple of H.
    if (F == 1)
      for (int s = 1; s < 5 * H; ++s) EXPECT_EQ(diloco::fragment_due(s, H, 1), s % H == 0 ? 0 : -1);
  }
  EXPECT_EQ(diloco::fragment_due(0, 8, 4), -1);
}
