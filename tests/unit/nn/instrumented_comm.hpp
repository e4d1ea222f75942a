// tests/unit/nn/instrumented_comm.hpp - a LocalComm test double for SyncBatchNorm (both faces:
// nn/ and torch/): it counts the collectives SyncBatchNorm runs (all_gather, all_reduce), to see
// which calls communicate, and throws from them while `failing` is set, as a collective that
// finds its peer gone does (without reaching the other ranks: every rank's double fails alike).
//   InstrumentedComm comm(std::move(local));  comm.failing = true;  // bn.forward(...) throws
#pragma once

#include <optional>
#include <utility>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/core/error.hpp"

namespace tandem::test {

class InstrumentedComm : public LocalComm {
 public:
  explicit InstrumentedComm(LocalComm&& comm) : LocalComm(std::move(comm)) {}

  template <class... Args>
  void all_gather(Args&&... args) {
    count("all_gather");
    LocalComm::all_gather(std::forward<Args>(args)...);
  }
  template <class... Args>
  void all_reduce(Args&&... args) {
    count("all_reduce");
    LocalComm::all_reduce(std::forward<Args>(args)...);
  }
  [[nodiscard]] std::optional<InstrumentedComm> split(int color, int key = 0) {
    auto part = LocalComm::split(color, key);
    if (!part) return std::nullopt;
    return InstrumentedComm(std::move(*part));
  }

  int collectives = 0;   ///< all_gather and all_reduce calls so far (failed ones too)
  bool failing = false;  ///< while set, those calls throw a tandem::Error

 private:
  void count(const char* operation) {
    ++collectives;
    if (failing) throw Error(rank(), operation, "the test's peer is gone");
  }
};
static_assert(Communicator<InstrumentedComm>);

}  // namespace tandem::test
