#include <gtest/gtest.h>

#include <thread>

#include "channel/arena.h"

namespace orbitkv::channel {
namespace {

Descriptor Numbered(uint64_t n) {
  Descriptor d{};
  d.magic = kMagic;
  d.request_id = n;
  return d;
}

TEST(RingConcurrencyTest, OneProducerOneConsumerDeliverEverythingInOrder) {
  auto arena = *DescriptorArena::Create(*ArenaLayout::Compute(16, 1, 4096), 1);
  constexpr uint64_t kCount = 200000;
  std::thread producer_thread([&] {
    RingProducer producer(arena->request_control(), arena->request_entries(), 16);
    for (uint64_t i = 0; i < kCount;) {
      Status s = producer.TryPush(Numbered(i));
      if (s.ok()) {
        ++i;
      } else {
        ASSERT_EQ(s.code(), StatusCode::kResourceExhausted);
        std::this_thread::yield();
      }
    }
  });
  RingConsumer consumer(arena->request_control(), arena->request_entries(), 16);
  Descriptor out;
  for (uint64_t expected = 0; expected < kCount;) {
    auto got = consumer.TryPop(&out);
    ASSERT_TRUE(got.ok());
    if (!*got) {
      std::this_thread::yield();
      continue;
    }
    ASSERT_EQ(out.request_id, expected);
    ++expected;
  }
  producer_thread.join();
}

}  // namespace
}  // namespace orbitkv::channel
