// tests/support/staging_checks.hpp - what every host communicator must do with device tensors:
// stage them through pinned memory (copied in, operated on, copied back), in the sync and the
// `_async` forms, with nothing left allocated. Runs against support/fake_device.hpp so it needs no
// GPU. Each check runs on every rank of `comm` and returns the failures it saw as text.
#pragma once

#include <string>
#include <vector>

#include "support/fake_device.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/tensor/tensor.hpp"

namespace tandem::test {

using FakeView = View<float, fake_device>;

/// Runs the staged operations on comm; returns what went wrong ("" when nothing did). The copy
/// and allocation counters are per process: where ranks are threads of one process, pass
/// per_rank_counters = false and check staging_counters.pinned_live after the ranks have ended.
template <class Comm>
std::string check_device_staging(Comm& comm, bool per_rank_counters = true) {
  std::string failures;
  auto expect_count = [&](bool ok, const std::string& what) {
    if (per_rank_counters && !ok)
      failures += "rank " + std::to_string(comm.rank()) + ": " + what + "\n";
  };
  auto expect = [&](bool ok, const std::string& what) {
    if (!ok) failures += "rank " + std::to_string(comm.rank()) + ": " + what + "\n";
  };
  const int n = comm.size();
  const int me = comm.rank();
  const int live_before = staging_counters.pinned_live.load();

  // In-place all_reduce: one pinned buffer, copied in and back.
  std::vector<float> storage(5);
  for (std::size_t i = 0; i < storage.size(); ++i) storage[i] = float(me + 1) * float(i + 1);
  const int in_before = staging_counters.to_pinned.load();
  const int back_before = staging_counters.to_device.load();
  comm.all_reduce(FakeView(storage.data(), storage.size()), ReduceOp::sum);
  const float ranks_sum = float(n * (n + 1) / 2);
  for (std::size_t i = 0; i < storage.size(); ++i) {
    expect(storage[i] == ranks_sum * float(i + 1), "all_reduce element " + std::to_string(i));
  }
  expect_count(staging_counters.to_pinned.load() - in_before == 1, "all_reduce copied in once");
  expect_count(staging_counters.to_device.load() - back_before == 1, "all_reduce copied back once");

  // `_async`: the output is on the device when the Work completes.
  std::vector<float> gathered(storage.size() * static_cast<std::size_t>(n), -1.0f);
  std::vector<float> mine(storage.size(), float(me));
  Work work = comm.all_gather_async(View<const float, fake_device>(mine.data(), mine.size()),
                                    FakeView(gathered.data(), gathered.size()));
  work.wait();
  for (int r = 0; r < n; ++r) {
    for (std::size_t i = 0; i < mine.size(); ++i) {
      expect(gathered[static_cast<std::size_t>(r) * mine.size() + i] == float(r),
             "all_gather_async slot of rank " + std::to_string(r));
    }
  }

  // broadcast: the root only reads, the others only write.
  std::vector<float> value(3, me == 0 ? 42.0f : 0.0f);
  const int writes_before = staging_counters.to_device.load();
  comm.broadcast(FakeView(value.data(), value.size()), 0);
  for (float v : value) expect(v == 42.0f, "broadcast value");
  expect_count(staging_counters.to_device.load() - writes_before == (me == 0 ? 0 : 1),
               "broadcast wrote back only on the receivers");

  // point to point: rank 0 sends, rank 1 receives asynchronously.
  if (n > 1 && me < 2) {
    std::vector<float> message(4, me == 0 ? 7.5f : 0.0f);
    if (me == 0) {
      comm.send(View<const float, fake_device>(message.data(), message.size()), 1, 7);
    } else {
      Work received = comm.recv_async(FakeView(message.data(), message.size()), 0, 7);
      received.wait();
      for (float v : message) expect(v == 7.5f, "recv_async from rank 0");
    }
  }

  comm.barrier();
  expect_count(staging_counters.pinned_live.load() == live_before, "every pinned buffer was freed");
  return failures;
}

}  // namespace tandem::test
