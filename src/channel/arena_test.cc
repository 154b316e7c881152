#include "channel/arena.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

namespace orbitkv::channel {
namespace {

WelcomeBody WelcomeFor(const DescriptorArena& arena) {
  WelcomeBody w{};
  w.session_epoch = arena.session_epoch();
  w.arena_bytes = arena.layout().arena_bytes;
  w.ring_entries = arena.layout().ring_entries;
  w.payload_slots = arena.layout().payload_slots;
  w.slot_bytes = arena.layout().slot_bytes;
  return w;
}

ScopedFd Dup(const ScopedFd& fd) { return ScopedFd(fcntl(fd.get(), F_DUPFD_CLOEXEC, 0)); }

TEST(ArenaLayoutTest, ValidatesEveryField) {
  EXPECT_TRUE(ArenaLayout::Compute(256, 64, 65536).ok());
  EXPECT_EQ(ArenaLayout::Compute(100, 64, 65536).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ArenaLayout::Compute(8, 64, 65536).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ArenaLayout::Compute(8192, 64, 65536).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ArenaLayout::Compute(256, 0, 65536).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ArenaLayout::Compute(256, 2000, 65536).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ArenaLayout::Compute(256, 64, 5000).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ArenaLayout::Compute(256, 64, 2 << 20).status().code(), StatusCode::kInvalidArgument);
  auto layout = *ArenaLayout::Compute(16, 2, 4096);
  EXPECT_EQ(layout.request_ring_offset % 64, 0u);
  EXPECT_EQ(layout.reply_ring_offset % 64, 0u);
  EXPECT_EQ(layout.slots_offset % 4096, 0u);
  EXPECT_GE(layout.reply_ring_offset, layout.request_ring_offset + sizeof(RingControl) + 16 * sizeof(Descriptor));
  // One claim word per slot after the slots, the arena rounded up to a page.
  EXPECT_EQ(layout.claims_offset, layout.slots_offset + 2 * 4096);
  EXPECT_EQ(layout.arena_bytes, layout.claims_offset + 4096);
}

TEST(ArenaTest, AttachSeesTheSameMemoryAndChecksTheHeader) {
  auto created = DescriptorArena::Create(*ArenaLayout::Compute(16, 4, 4096), 77);
  ASSERT_TRUE(created.ok()) << created.status();
  auto attached = DescriptorArena::Attach(Dup((*created)->fd()), WelcomeFor(**created));
  ASSERT_TRUE(attached.ok()) << attached.status();
  (*created)->slot(3)[10] = 0x5a;
  EXPECT_EQ((*attached)->slot(3)[10], 0x5a);
  // Resizing is sealed off, so neither side can truncate the other's mapping.
  EXPECT_NE(ftruncate((*created)->fd().get(), 4096), 0);

  WelcomeBody wrong_epoch = WelcomeFor(**created);
  wrong_epoch.session_epoch = 78;
  EXPECT_EQ(DescriptorArena::Attach(Dup((*created)->fd()), wrong_epoch).status().code(), StatusCode::kDataLoss);
  WelcomeBody wrong_size = WelcomeFor(**created);
  wrong_size.payload_slots = 8;
  wrong_size.arena_bytes = ArenaLayout::Compute(16, 8, 4096)->arena_bytes;
  EXPECT_EQ(DescriptorArena::Attach(Dup((*created)->fd()), wrong_size).status().code(), StatusCode::kDataLoss);
}

TEST(ArenaTest, AttachRefusesAnUnsealedMemfd) {
  auto layout = *ArenaLayout::Compute(16, 1, 4096);
  ScopedFd fd(memfd_create("unsealed", MFD_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  ASSERT_EQ(ftruncate(fd.get(), static_cast<off_t>(layout.arena_bytes)), 0);
  WelcomeBody w{};
  w.session_epoch = 1;
  w.arena_bytes = layout.arena_bytes;
  w.ring_entries = 16;
  w.payload_slots = 1;
  w.slot_bytes = 4096;
  EXPECT_EQ(DescriptorArena::Attach(std::move(fd), w).status().code(), StatusCode::kPermissionDenied);
}

Descriptor Numbered(uint64_t n) {
  Descriptor d{};
  d.magic = kMagic;
  d.request_id = n;
  return d;
}

TEST(RingTest, FifoUntilFullThenBackpressure) {
  auto arena = *DescriptorArena::Create(*ArenaLayout::Compute(16, 1, 4096), 1);
  RingProducer producer(arena->request_control(), arena->request_entries(), 16);
  RingConsumer consumer(arena->request_control(), arena->request_entries(), 16);
  Descriptor out;
  EXPECT_FALSE(*consumer.TryPop(&out));
  for (uint64_t i = 0; i < 16; ++i) ASSERT_TRUE(producer.TryPush(Numbered(i)).ok());
  EXPECT_EQ(producer.TryPush(Numbered(99)).code(), StatusCode::kResourceExhausted);
  for (uint64_t i = 0; i < 40; ++i) {
    ASSERT_TRUE(*consumer.TryPop(&out));
    EXPECT_EQ(out.request_id, i);
    ASSERT_TRUE(producer.TryPush(Numbered(i + 16)).ok());
  }
}

TEST(RingTest, CorruptIndicesFromThePeerAreDataLoss) {
  auto arena = *DescriptorArena::Create(*ArenaLayout::Compute(16, 1, 4096), 1);
  RingConsumer consumer(arena->request_control(), arena->request_entries(), 16);
  Descriptor out;
  arena->request_control()->head = 1000;  // a hostile or broken producer
  EXPECT_EQ(consumer.TryPop(&out).status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(consumer.PrepareToWait().status().code(), StatusCode::kDataLoss);
  RingProducer producer(arena->reply_control(), arena->reply_entries(), 16);
  arena->reply_control()->tail = 5;  // a consumer claiming to have read what was never written
  EXPECT_EQ(producer.TryPush(Numbered(1)).code(), StatusCode::kDataLoss);
}

TEST(RingTest, WaitHandshakeNeverLosesAWakeup) {
  auto arena = *DescriptorArena::Create(*ArenaLayout::Compute(16, 1, 4096), 1);
  RingProducer producer(arena->request_control(), arena->request_entries(), 16);
  RingConsumer consumer(arena->request_control(), arena->request_entries(), 16);
  EXPECT_FALSE(*consumer.PrepareToWait());
  EXPECT_TRUE(producer.ConsumerWaiting());
  ASSERT_TRUE(producer.TryPush(Numbered(1)).ok());
  consumer.ClearWaiting();
  EXPECT_FALSE(producer.ConsumerWaiting());
  EXPECT_TRUE(*consumer.PrepareToWait());  // the push is seen: do not sleep
  consumer.ClearWaiting();
}

}  // namespace
}  // namespace orbitkv::channel
