#include "storage/extent_allocator.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace orbitkv::storage {
namespace {

constexpr uint64_t kPage = ExtentAllocator::kAlignment;

TEST(ExtentAllocatorTest, ValidatesFiles) {
  EXPECT_EQ(ExtentAllocator::Create({}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ExtentAllocator::Create({kPage, 0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ExtentAllocator::Create({kPage + 1}).status().code(), StatusCode::kInvalidArgument);
  auto allocator = ExtentAllocator::Create({4 * kPage, 8 * kPage});
  ASSERT_TRUE(allocator.ok());
  EXPECT_EQ((*allocator)->capacity_bytes(), 12 * kPage);
  EXPECT_EQ((*allocator)->free_bytes(), 12 * kPage);
  EXPECT_EQ((*allocator)->largest_free_bytes(), 8 * kPage);
}

TEST(ExtentAllocatorTest, RoundsUpSpreadsOverFilesAndReportsExhaustion) {
  auto allocator = *ExtentAllocator::Create({4 * kPage, 4 * kPage});
  auto a = allocator->Allocate(1);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->bytes, kPage);
  auto b = allocator->Allocate(kPage + 1);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->bytes, 2 * kPage);
  EXPECT_NE(a->file, b->file);  // rotation spreads writes over files
  EXPECT_EQ(allocator->allocated_bytes(), 3 * kPage);
  EXPECT_EQ(allocator->Allocate(0).status().code(), StatusCode::kInvalidArgument);
  auto too_big = allocator->Allocate(4 * kPage);  // 3 and 2 pages free, none contiguous enough
  EXPECT_EQ(too_big.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(too_big.status().message().find("contiguous"), std::string::npos);
}

TEST(ExtentAllocatorTest, ReleaseCoalescesBackToOneRun) {
  auto allocator = *ExtentAllocator::Create({6 * kPage});
  std::vector<Extent> extents;
  for (int i = 0; i < 3; ++i) extents.push_back(*allocator->Allocate(2 * kPage));
  EXPECT_EQ(allocator->free_bytes(), 0u);
  allocator->Release(extents[1]);  // middle first: no neighbour is free
  EXPECT_EQ(allocator->largest_free_bytes(), 2 * kPage);
  allocator->Release(extents[0]);  // merges with the run after it
  EXPECT_EQ(allocator->largest_free_bytes(), 4 * kPage);
  allocator->Release(extents[2]);  // merges with the run before it
  EXPECT_EQ(allocator->largest_free_bytes(), 6 * kPage);
  EXPECT_EQ(allocator->allocated_bytes(), 0u);
  EXPECT_TRUE(allocator->Allocate(6 * kPage).ok());
}

TEST(ExtentAllocatorTest, DoubleFreeAndForeignExtentsAreProgrammingErrors) {
  auto allocator = *ExtentAllocator::Create({4 * kPage});
  Extent a = *allocator->Allocate(kPage);
  allocator->Release(a);
  EXPECT_DEATH(allocator->Release(a), "already free");
  EXPECT_DEATH(allocator->Release(Extent{3, 0, kPage}), "file 3");
  EXPECT_DEATH(allocator->Release(Extent{0, 8 * kPage, kPage}), "beyond");
}

TEST(ExtentAllocatorTest, RestartClaimsRecoveredExtentsAndRefusesOverlaps) {
  auto allocator = *ExtentAllocator::Create({8 * kPage});
  ASSERT_TRUE(allocator->MarkUsed(Extent{0, 2 * kPage, 2 * kPage}).ok());
  EXPECT_EQ(allocator->MarkUsed(Extent{0, 3 * kPage, 2 * kPage}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(allocator->MarkUsed(Extent{0, 1, kPage}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(allocator->MarkUsed(Extent{0, 7 * kPage, 2 * kPage}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(allocator->MarkUsed(Extent{1, 0, kPage}).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(allocator->MarkUsed(Extent{0, 6 * kPage, 2 * kPage}).ok());
  EXPECT_EQ(allocator->allocated_bytes(), 4 * kPage);
  // New allocations avoid the claimed extents.
  auto fresh = allocator->Allocate(3 * kPage);
  EXPECT_EQ(fresh.status().code(), StatusCode::kResourceExhausted);  // runs left: [0,2) and [4,6)
  auto two = allocator->Allocate(2 * kPage);
  ASSERT_TRUE(two.ok());
  EXPECT_TRUE(two->offset == 0 || two->offset == 4 * kPage);
}

TEST(ExtentAllocatorTest, RandomAllocationsNeverOverlapAndAccountingIsExact) {
  auto allocator = *ExtentAllocator::Create({64 * kPage, 32 * kPage, 48 * kPage});
  std::mt19937_64 rng(7);
  std::vector<Extent> live;
  std::vector<std::vector<bool>> used = {std::vector<bool>(64), std::vector<bool>(32), std::vector<bool>(48)};
  uint64_t expected = 0;
  for (int step = 0; step < 5000; ++step) {
    if (!live.empty() && (rng() % 3 == 0 || allocator->free_bytes() < 8 * kPage)) {
      const size_t i = rng() % live.size();
      const Extent e = live[i];
      for (uint64_t p = e.offset / kPage; p < (e.offset + e.bytes) / kPage; ++p) used[e.file][p] = false;
      allocator->Release(e);
      expected -= e.bytes;
      live[i] = live.back();
      live.pop_back();
    } else {
      auto e = allocator->Allocate((rng() % 8 + 1) * kPage - rng() % kPage);
      if (!e.ok()) {
        ASSERT_EQ(e.status().code(), StatusCode::kResourceExhausted);
        continue;
      }
      for (uint64_t p = e->offset / kPage; p < (e->offset + e->bytes) / kPage; ++p) {
        ASSERT_FALSE(used[e->file][p]) << "overlap at step " << step;
        used[e->file][p] = true;
      }
      expected += e->bytes;
      live.push_back(*e);
    }
    ASSERT_EQ(allocator->allocated_bytes(), expected);
    ASSERT_EQ(allocator->allocated_bytes() + allocator->free_bytes(), allocator->capacity_bytes());
  }
  for (const Extent& e : live) allocator->Release(e);
  EXPECT_EQ(allocator->allocated_bytes(), 0u);
  EXPECT_EQ(allocator->largest_free_bytes(), 64 * kPage);  // every file coalesced back to one run
}

}  // namespace
}  // namespace orbitkv::storage
