// Flights: work in flight by key, so that a later caller asking for the same key waits for the one in flight and
// then reads its result (from wherever that work leaves it) instead of doing the same work again.
//
//   std::optional<Flights<K>::Ticket> ticket = flights.WaitOrStart(key, deadline);
//   if (!ticket) { ...read what the other flight brought; if more is needed: ticket.emplace(flights.Start(key)); }
//   ...do the work...                                // the flight lands when `ticket` goes
//
// Thread safety: every method is safe from any thread.
#ifndef ORBITKV_BASE_FLIGHTS_H_
#define ORBITKV_BASE_FLIGHTS_H_

#include <condition_variable>
#include <functional>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>

#include "base/clock.h"
#include "base/mutex.h"
#include "base/thread_annotations.h"

namespace orbitkv {

template <typename Key, typename Hash = std::hash<Key>>
class Flights {
  struct Flight {
    bool landed = false;  // guarded by the Flights' mutex
    std::condition_variable_any cv;
  };

 public:
  // Lands its flight when it goes (waiters wake).
  class Ticket {
   public:
    Ticket(Flights* flights, Key key, std::shared_ptr<Flight> flight)
        : flights_(flights), key_(std::move(key)), flight_(std::move(flight)) {}
    Ticket(Ticket&& other) noexcept
        : flights_(std::exchange(other.flights_, nullptr)),
          key_(std::move(other.key_)),
          flight_(std::move(other.flight_)) {}
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    Ticket& operator=(Ticket&&) = delete;
    ~Ticket() {
      if (flights_ != nullptr) flights_->Land(key_, flight_);
    }

   private:
    Flights* flights_;
    Key key_;
    std::shared_ptr<Flight> flight_;
  };

  // When a flight of `key` is in flight, waits until it landed or `deadline` passed and returns none (the caller
  // reads what it brought); otherwise starts one in the same step (no second caller can start one meanwhile).
  std::optional<Ticket> WaitOrStart(const Key& key, Deadline deadline) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    auto it = flights_.find(key);
    if (it == flights_.end()) {
      auto flight = std::make_shared<Flight>();
      flights_.emplace(key, flight);
      return std::optional<Ticket>(std::in_place, this, key, std::move(flight));
    }
    std::shared_ptr<Flight> flight = it->second;
    while (!flight->landed && !deadline.Expired()) flight->cv.wait_until(mu_, deadline.when());
    return std::nullopt;
  }
  // A flight of `key`: from now on, the one callers of `key` wait for.
  [[nodiscard]] Ticket Start(const Key& key) EXCLUDES(mu_) {
    auto flight = std::make_shared<Flight>();
    {
      MutexLock lock(&mu_);
      flights_[key] = flight;
    }
    return Ticket(this, key, std::move(flight));
  }

 private:
  void Land(const Key& key, const std::shared_ptr<Flight>& flight) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    flight->landed = true;
    auto it = flights_.find(key);
    if (it != flights_.end() && it->second == flight) flights_.erase(it);
    flight->cv.notify_all();
  }

  Mutex mu_;
  std::unordered_map<Key, std::shared_ptr<Flight>, Hash> flights_ GUARDED_BY(mu_);
};

}  // namespace orbitkv

#endif  // ORBITKV_BASE_FLIGHTS_H_
