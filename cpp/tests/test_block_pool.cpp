// CPUBlockPool: slot allocation and freeing.
#include <gtest/gtest.h>

#include <stdexcept>

#include "kvoff/block_pool.h"

namespace kvoff {
namespace {

TEST(CPUBlockPool, FreshPoolHandsOutIdsInOrder) {
  CPUBlockPool pool(4);
  EXPECT_EQ(pool.num_blocks(), 4u);
  EXPECT_EQ(pool.num_free(), 4u);
  for (std::uint32_t i = 0; i < 4; ++i) {
    EXPECT_FALSE(pool.is_allocated(i));
    EXPECT_EQ(pool.allocate(), i);
    EXPECT_TRUE(pool.is_allocated(i));
  }
  EXPECT_EQ(pool.num_free(), 0u);
  EXPECT_EQ(pool.num_allocated(), 4u);
}

TEST(CPUBlockPool, FreedSlotIsReusedFirst) {
  CPUBlockPool pool(4);
  for (int i = 0; i < 4; ++i) {
    pool.allocate();
  }
  pool.free(2);
  pool.free(0);
  EXPECT_EQ(pool.num_free(), 2u);
  EXPECT_EQ(pool.allocate(), 0u);  // LIFO
  EXPECT_EQ(pool.allocate(), 2u);
}

TEST(CPUBlockPool, FullPoolThrowsLengthError) {
  CPUBlockPool pool(1);
  pool.allocate();
  EXPECT_THROW(pool.allocate(), std::length_error);
  EXPECT_EQ(pool.num_free(), 0u);
}

TEST(CPUBlockPool, DoubleFreeAndOutOfRangeThrowAndLeavePoolUnchanged) {
  CPUBlockPool pool(3);
  pool.allocate();
  pool.free(0);
  EXPECT_THROW(pool.free(0), std::invalid_argument);
  EXPECT_THROW(pool.free(3), std::out_of_range);
  EXPECT_THROW((void)pool.is_allocated(7), std::out_of_range);
  EXPECT_EQ(pool.num_free(), 3u);
  EXPECT_EQ(pool.allocate(), 0u);
  EXPECT_EQ(pool.allocate(), 1u);
  EXPECT_EQ(pool.allocate(), 2u);
}

TEST(CPUBlockPool, RejectsBadSizesNamingTheValue) {
  for (const std::int64_t bad : {std::int64_t{0}, std::int64_t{-5}, std::int64_t{1} << 31}) {
    try {
      CPUBlockPool pool(bad);
      FAIL() << "no exception for num_blocks=" << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(std::to_string(bad)), std::string::npos) << e.what();
    }
  }
}

TEST(CPUBlockPool, LargePoolOnHugePagesHandsOutEveryIdOnce) {
  // 4M slots: the free list and flags take LargePageAllocator's huge-page path.
  const std::uint32_t n = 1u << 22;
  CPUBlockPool pool(n);
  EXPECT_EQ(pool.allocate(), 0u);
  EXPECT_EQ(pool.allocate(), 1u);
  pool.prefetch(n - 1);  // a hint: changes nothing
  pool.free(0);
  EXPECT_EQ(pool.allocate(), 0u);
  EXPECT_EQ(pool.num_free(), n - 2);
  EXPECT_TRUE(pool.is_allocated(1));
  EXPECT_FALSE(pool.is_allocated(n - 1));
}

}  // namespace
}  // namespace kvoff
